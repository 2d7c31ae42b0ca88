package codesandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
)

func TestNewRefusesBadConfig(t *testing.T) {
	for _, o := range []Options{
		{APIKey: ""},
		{APIKey: "k", BaseURL: "http://api.example.com"},
		{APIKey: "k", BaseURL: "ftp://127.0.0.1"},
		{APIKey: "k", BaseURL: "https://user:pw@api.example.com"},
		{APIKey: "k", BaseURL: "https://api.example.com?x=1"},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("accepted %+v", o)
		}
	}
	for _, u := range []string{"", "https://api.together.ai/csb/sdk", "http://127.0.0.1:1", "http://localhost:8080/"} {
		if _, err := New(Options{APIKey: "k", BaseURL: u}); err != nil {
			t.Errorf("%q: %v", u, err)
		}
	}
}

func TestClientLifecycle(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	cx := ctx(t)

	mi, err := c.MetaInfo(cx)
	if err != nil || mi.Auth.Team == "" || mi.RateLimits.ConcurrentVMs.Limit != 10 || mi.RateLimits.RequestsHourly.Reset == "" {
		t.Fatalf("MetaInfo: %+v %v", mi, err)
	}
	priv, pp := PrivacyPrivate, true
	fr, err := c.Fork(cx, UniversalTemplate, ForkRequest{
		Title: "demo", Privacy: &priv, PrivatePreview: &pp, Tags: []string{"t1"},
		StartOptions: &StartOptions{Tier: "Pico", HibernationTimeoutSeconds: 120, AutomaticWakeupConfig: &WakeupConfig{HTTP: true}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if fr.StartResponse == nil || fr.StartResponse.BootupType != "FORK" || fr.StartResponse.PitcherToken == "" ||
		fr.StartResponse.UserWorkspacePath != csbfake.UserWorkspacePath {
		t.Fatalf("fork: %+v", fr)
	}
	// One call created and started the VM.
	if n := count(f, "POST", "/vm/"+fr.ID+"/start"); n != 0 {
		t.Fatalf("separate start calls: %d", n)
	}
	var body map[string]any
	_ = json.Unmarshal(f.Requests()[len(f.Requests())-1].Body, &body)
	so := body["start_options"].(map[string]any)
	if body["privacy"] != float64(2) || body["private_preview"] != true || so["tier"] != "Pico" || so["hibernation_timeout_seconds"] != float64(120) {
		t.Fatalf("fork body: %v", body)
	}

	sb, err := c.GetSandbox(cx, fr.ID)
	if err != nil || sb.ID != fr.ID || sb.Privacy != 2 || sb.Title == nil || *sb.Title != "demo" || sb.Tags[0] != "t1" {
		t.Fatalf("GetSandbox: %+v %v", sb, err)
	}
	list, err := c.ListSandboxes(cx, ListOptions{Tags: []string{"t1"}, PageSize: 5, Running: true})
	if err != nil || len(list.Sandboxes) != 1 || list.Pagination.NextPage != nil {
		t.Fatalf("ListSandboxes: %+v %v", list, err)
	}
	run, err := c.RunningVMs(cx)
	if err != nil || run.ConcurrentVMCount != 1 || run.VMs[0].ID != fr.ID {
		t.Fatalf("RunningVMs: %+v %v", run, err)
	}
	if err := c.Hibernate(cx, fr.ID); err != nil {
		t.Fatal(err)
	}
	sr, err := c.Start(cx, fr.ID, StartOptions{})
	if err != nil || sr.BootupType != "RESUME" {
		t.Fatalf("Start: %+v %v", sr, err)
	}
	if err := c.Shutdown(cx, fr.ID); err != nil {
		t.Fatal(err)
	}
	wantCode(t, c.Shutdown(cx, fr.ID), brokererr.SandboxNotFound) // not running
	exp := time.Now().Add(time.Hour).Truncate(time.Second)
	tok, err := c.CreatePreviewToken(cx, fr.ID, exp)
	if err != nil || tok.Token == "" || tok.ExpiresAt == nil || !tok.ExpiresAt.Equal(exp) || !f.PreviewTokenValid(fr.ID, tok.Token.Reveal()) {
		t.Fatalf("CreatePreviewToken: %+v %v", tok, err)
	}
	if err := c.Delete(cx, fr.ID); err != nil {
		t.Fatal(err)
	}
	wantCode(t, c.Delete(cx, fr.ID), brokererr.SandboxNotFound)
	if st, _ := f.Sandbox(fr.ID); !st.Deleted {
		t.Fatal("not deleted")
	}
}

func TestSecretsDoNotPrint(t *testing.T) {
	sr := StartResponse{ID: "abc", PitcherToken: "pt_very_secret", ReconnectToken: "rt_secret"}
	b, _ := json.Marshal(sr)
	for _, s := range []string{fmt.Sprintf("%v", sr), fmt.Sprintf("%+v", sr), fmt.Sprintf("%#v", sr), string(b)} {
		if strings.Contains(s, "secret") {
			t.Fatalf("secret printed: %s", s)
		}
	}
	if sr.PitcherToken.Reveal() != "pt_very_secret" {
		t.Fatal("Reveal")
	}
}

func TestRateLimitExhaustedAfterRetries(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	f.FailNext(http.StatusTooManyRequests, 100)
	_, err := c.MetaInfo(ctx(t))
	e := wantCode(t, err, brokererr.RateLimitExceeded)
	// The VM budget has no reset header: the documented ~30 s refresh.
	if !e.Retryable || e.RetryAfter != fallbackRetryAfter || !strings.Contains(e.Message, "concurrently running VMs") {
		t.Fatalf("error: %+v", e)
	}
	if n := count(f, "GET", "/meta/info"); n != 1+defaultMaxRetries {
		t.Fatalf("attempts: %d", n)
	}
}

func TestRateLimitRecoversBeforeMaxRetries(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	f.Inject(csbfake.Fault{Status: 429, N: 2, NoErrors: true})
	if _, err := c.MetaInfo(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if n := count(f, "GET", "/meta/info"); n != 3 {
		t.Fatalf("attempts: %d", n)
	}
}

func TestRateLimitFarResetIsNotWaitedFor(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	reset := time.Now().Add(20 * time.Minute)
	f.Inject(csbfake.Fault{Status: 429, N: 10, Budget: "requests", Reset: reset})
	start := time.Now()
	_, err := c.MetaInfo(ctx(t))
	e := wantCode(t, err, brokererr.RateLimitExceeded)
	if e.RetryAfter < 19*time.Minute || e.RetryAfter > 21*time.Minute || e.RetryAfter%time.Second != 0 {
		t.Fatalf("RetryAfter: %v", e.RetryAfter)
	}
	if !strings.Contains(e.Message, "API requests per hour") {
		t.Fatalf("message: %q", e.Message)
	}
	if n := count(f, "GET", "/meta/info"); n != 1 || time.Since(start) > 5*time.Second {
		t.Fatalf("retried a 20-minute reset: %d requests", n)
	}
}

func TestServerErrorsRetriedWithBoundedJitter(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, func(o *Options) { o.RetryBase = 10 * time.Millisecond; o.MaxRetryWait = 40 * time.Millisecond })
	f.FailNext(http.StatusServiceUnavailable, 4)
	start := time.Now()
	_, err := c.Start(ctx(t), "abc123", StartOptions{})
	took := time.Since(start)
	e := wantCode(t, err, brokererr.Unavailable)
	if !e.Retryable || !strings.Contains(e.Message, "503") {
		t.Fatalf("error: %+v", e)
	}
	if n := count(f, "POST", "/vm/abc123/start"); n != 4 {
		t.Fatalf("attempts: %d", n)
	}
	// Waits are 10·2^i ms capped at 40, jittered to [d/2, d]: 5+10+20 ≤ total ≤ 10+20+40 (+ request time).
	if took < 35*time.Millisecond || took > 3*time.Second {
		t.Fatalf("retry time %v outside the jitter bounds", took)
	}

	// A transient 502 is retried to success.
	f.FailNext(http.StatusBadGateway, 2)
	if _, err := c.MetaInfo(ctx(t)); err != nil {
		t.Fatal(err)
	}
}

func TestForkNotRetriedOnServerError(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	f.FailNext(http.StatusInternalServerError, 1)
	_, err := c.Fork(ctx(t), UniversalTemplate, ForkRequest{})
	wantCode(t, err, brokererr.Unavailable)
	if n := count(f, "POST", "/sandbox/"+UniversalTemplate+"/fork"); n != 1 {
		t.Fatalf("fork sent %d times: a retry could create a second sandbox", n)
	}
}

func TestBackoffJitter(t *testing.T) {
	c := &Client{step: 100 * time.Millisecond, maxWait: time.Second}
	for attempt, d := range []time.Duration{100, 200, 400, 800, 1000, 1000} {
		d *= time.Millisecond
		seen := map[time.Duration]bool{}
		for range 200 {
			w := c.backoff(attempt)
			if w < d/2 || w > d {
				t.Fatalf("attempt %d: %v outside [%v, %v]", attempt, w, d/2, d)
			}
			seen[w] = true
		}
		if len(seen) < 10 {
			t.Fatalf("attempt %d: no jitter (%d distinct values)", attempt, len(seen))
		}
	}
}

func TestAuthFailureHidesKey(t *testing.T) {
	f := csbfake.New(t, "csb_v1_the_right_key")
	var log logBuf
	c := newClient(t, f, &log, nil) // sends testKey, which is wrong
	_, err := c.MetaInfo(ctx(t))
	e := wantCode(t, err, brokererr.PermissionDenied)
	for _, s := range []string{err.Error(), e.Message, fmt.Sprintf("%+v", err), errors.Unwrap(err).Error(), log.String()} {
		if strings.Contains(s, testKey) {
			t.Fatalf("key leaked: %s", s)
		}
	}
	if r := f.Requests(); len(r) != 1 || r[0].Authorized {
		t.Fatalf("requests: %+v", r)
	}
	// 403 (missing scope) is the same to the caller.
	f2 := newFake(t)
	c2 := newClient(t, f2, nil, nil)
	f2.FailNext(http.StatusForbidden, 1)
	wantCode(t, func() error { _, err := c2.MetaInfo(ctx(t)); return err }(), brokererr.PermissionDenied)
	if n := len(f2.Requests()); n != 1 {
		t.Fatalf("403 retried: %d", n)
	}
}

func TestNotFound(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	_, err := c.GetSandbox(ctx(t), "zzzzzz")
	wantCode(t, err, brokererr.SandboxNotFound)
	if n := len(f.Requests()); n != 1 {
		t.Fatalf("404 retried: %d", n)
	}
	// IDs that could steer the path are refused without a request.
	f.ResetRequests()
	for _, id := range []string{"", "../meta/info", "abc/tokens", "ABC", "a?b", "a%2f", strings.Repeat("a", 33)} {
		_, err := c.GetSandbox(ctx(t), id)
		wantCode(t, err, brokererr.SandboxNotFound)
		wantCode(t, c.Delete(ctx(t), id), brokererr.SandboxNotFound)
	}
	if _, err := c.Fork(ctx(t), "../x", ForkRequest{}); err == nil {
		t.Fatal("bad template accepted")
	}
	if n := len(f.Requests()); n != 0 {
		t.Fatalf("bad IDs reached the server: %d requests", n)
	}
}

func TestContextHonoured(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	f.Inject(csbfake.Fault{N: 1, Delay: time.Minute})
	cx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.MetaInfo(cx)
	wantCode(t, err, brokererr.SandboxTimeout)
	if time.Since(start) > 5*time.Second {
		t.Fatal("deadline ignored")
	}
	// A cancelled caller gets its own error back, not a retry loop.
	f.FailNext(503, 100)
	cx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, err := c.MetaInfo(cx2); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
	// The per-attempt timeout turns a hung server into UNAVAILABLE after retries.
	f2 := newFake(t)
	c2 := newClient(t, f2, nil, func(o *Options) { o.Timeout = 50 * time.Millisecond; o.MaxRetries = 1 })
	f2.Inject(csbfake.Fault{N: 2, Delay: time.Minute})
	_, err = c2.MetaInfo(ctx(t))
	wantCode(t, err, brokererr.Unavailable)
	if n := len(f2.Requests()); n != 2 {
		t.Fatalf("attempts: %d", n)
	}
}

func TestUnusableResponses(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	// A strict fake refuses what the client must never send: an unknown
	// field would come back as 422 and map to INTERNAL_ERROR.
	f.FailNext(http.StatusUnprocessableEntity, 1)
	_, err := c.MetaInfo(ctx(t))
	wantCode(t, err, brokererr.InternalError)
}

func TestNotFoundMeansWhatTheCallNames(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	// A 404 from an endpoint that names no sandbox is a wrong base URL,
	// not a missing sandbox (Destroy would take that for success).
	f.Inject(csbfake.Fault{Status: http.StatusNotFound, N: 1, Path: "/meta/info"})
	_, err := c.MetaInfo(ctx(t))
	if e := wantCode(t, err, brokererr.InternalError); !strings.Contains(e.Message, "CSB_API_URL") {
		t.Fatalf("message: %q", e.Message)
	}
	_, err = c.Fork(ctx(t), "nosuchtpl", ForkRequest{})
	if e := wantCode(t, err, brokererr.InternalError); !strings.Contains(e.Message, "template") {
		t.Fatalf("message: %q", e.Message)
	}
	_, err = c.Start(ctx(t), "zzzzzz", StartOptions{})
	wantCode(t, err, brokererr.SandboxNotFound)
	_, err = c.CreatePreviewToken(ctx(t), "zzzzzz", time.Now().Add(time.Hour))
	wantCode(t, err, brokererr.SandboxNotFound)
}

func TestDefaultBaseURLFollowsKey(t *testing.T) {
	for key, want := range map[string]string{"csb_v1_abc": DefaultBaseURL, "tgp_v1_abc": TogetherBaseURL} {
		c, err := New(Options{APIKey: key})
		if err != nil || c.base.String() != want {
			t.Errorf("%s: %v %v", key, c.base, err)
		}
	}
	c, err := New(Options{APIKey: "tgp_v1_abc", BaseURL: "https://api.codesandbox.stream/"})
	if err != nil || c.base.String() != "https://api.codesandbox.stream" {
		t.Fatalf("explicit base URL: %v %v", c.base, err)
	}
}

func TestSlowCallsGetLongerAttempts(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, func(o *Options) { o.Timeout = 300 * time.Millisecond; o.MaxRetries = -1 })
	fr, err := c.Fork(ctx(t), UniversalTemplate, ForkRequest{StartOptions: &StartOptions{}})
	if err != nil {
		t.Fatal(err)
	}
	// Shutdown "can take ~30 s": an answer later than Timeout but within
	// twice that still counts; the same delay on another call does not.
	f.Inject(csbfake.Fault{N: 1, Delay: 450 * time.Millisecond, Path: "/vm/" + fr.ID + "/shutdown"})
	if err := c.Shutdown(ctx(t), fr.ID); err != nil {
		t.Fatalf("slow shutdown: %v", err)
	}
	f.Inject(csbfake.Fault{N: 1, Delay: 450 * time.Millisecond, Path: "/meta/info"})
	_, err = c.MetaInfo(ctx(t))
	wantCode(t, err, brokererr.Unavailable)
}

func TestUndocumentedScalarTypesDecode(t *testing.T) {
	var mi MetaInfo
	body := `{"rate_limits":{"requests_hourly":{"limit":10,"remaining":1,"reset":"2025-10-09T09:00:00Z"},
		"sandboxes_hourly":{"limit":10,"remaining":1,"reset":1760000600},"concurrent_vms":{"limit":1,"remaining":0,"reset":null}}}`
	if err := json.Unmarshal([]byte(body), &mi); err != nil {
		t.Fatal(err)
	}
	if mi.RateLimits.RequestsHourly.Reset != "2025-10-09T09:00:00Z" || mi.RateLimits.SandboxesHourly.Reset != "1760000600" || mi.RateLimits.ConcurrentVMs.Reset != "" {
		t.Fatalf("%+v", mi.RateLimits)
	}
	var run RunningVMs
	if err := json.Unmarshal([]byte(`{"vms":[{"id":"a","specs":{"cpu":0.5,"memory":2048,"storage":20},"credit_basis":5}]}`), &run); err != nil {
		t.Fatal(err)
	}
	if run.VMs[0].Specs.CPU != 0.5 || run.VMs[0].CreditBasis != "5" {
		t.Fatalf("%+v", run.VMs[0])
	}
	var v FlexValue
	if err := json.Unmarshal([]byte(`{"a":1}`), &v); err == nil {
		t.Fatal("object accepted as a scalar")
	}
}

func TestForkRetriedOnlyOnRequestLevel429(t *testing.T) {
	f := newFake(t)
	c := newClient(t, f, nil, nil)
	forkPath := "/sandbox/" + UniversalTemplate + "/fork"
	// The hourly request budget refused the call as a whole: retry.
	// (Its reset has just passed, so the retry comes without a long wait.)
	f.Inject(csbfake.Fault{Status: 429, N: 1, Budget: "requests", Reset: time.Now().Add(-time.Second), Path: forkPath})
	if _, err := c.Fork(ctx(t), UniversalTemplate, ForkRequest{StartOptions: &StartOptions{}}); err != nil {
		t.Fatal(err)
	}
	if n := count(f, "POST", forkPath); n != 2 {
		t.Fatalf("fork attempts after a request-budget 429: %d", n)
	}
	// The VM budget may have refused only the start of a sandbox that now
	// exists: no retry, RATE_LIMIT_EXCEEDED at once.
	f.ResetRequests()
	f.Inject(csbfake.Fault{Status: 429, N: 5, Budget: "vms", Path: forkPath})
	_, err := c.Fork(ctx(t), UniversalTemplate, ForkRequest{StartOptions: &StartOptions{}})
	wantCode(t, err, brokererr.RateLimitExceeded)
	if n := count(f, "POST", forkPath); n != 1 {
		t.Fatalf("fork attempts after a VM-budget 429: %d", n)
	}
	// Start is idempotent and is retried on the same 429.
	f.ResetRequests()
	f.Inject(csbfake.Fault{Status: 429, N: 1, Budget: "vms", Path: "/vm/abc123/start"})
	_, err = c.Start(ctx(t), "abc123", StartOptions{})
	wantCode(t, err, brokererr.SandboxNotFound)
	if n := count(f, "POST", "/vm/abc123/start"); n != 2 {
		t.Fatalf("start attempts: %d", n)
	}
}
