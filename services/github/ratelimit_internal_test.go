package github

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	gh "github.com/google/go-github/v92/github"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

func testRepoState() *repoState {
	return &repoState{cfg: Repo{RepoID: "r"}, tok: &tokenState{write: make(chan struct{}, 1)}, status: "ok", canPush: true, writeChecked: true}
}

func response(status int, hdr map[string]string) *http.Response {
	h := http.Header{}
	for k, v := range hdr {
		h.Set(k, v)
	}
	return &http.Response{StatusCode: status, Header: h, Request: &http.Request{Method: "GET"}}
}

// apiError's classification of what GitHub answers, GitHub's rules for
// rate limits first (403 or 429; Retry-After; X-RateLimit-Remaining: 0
// with X-RateLimit-Reset; a message naming the limit, then a minute).
func TestAPIErrorClassification(t *testing.T) {
	now := time.Now()
	reset := strconv.FormatInt(now.Add(90*time.Second).Unix(), 10)
	std := map[string]string{"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": "4000", "X-RateLimit-Reset": strconv.FormatInt(now.Add(50*time.Minute).Unix(), 10)}
	with := func(extra map[string]string) map[string]string {
		out := map[string]string{}
		for k, v := range std {
			out[k] = v
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	errResp := func(status int, msg string, hdr map[string]string) error {
		return &gh.ErrorResponse{Response: response(status, hdr), Message: msg}
	}
	abuse := func(status int, hdr map[string]string, goGithubRetry *time.Duration) error {
		return &gh.AbuseRateLimitError{Response: response(status, hdr), Message: "You have exceeded a secondary rate limit.", RetryAfter: goGithubRetry}
	}
	fiftyMin := 50 * time.Minute
	blockedLeft := 42 * time.Second
	cases := []struct {
		name       string
		err        error
		code       brokererr.Code
		min, max   time.Duration
		wantStatus string
	}{
		{"primary (go-github RateLimitError)", &gh.RateLimitError{Rate: gh.Rate{Remaining: 0, Reset: gh.Timestamp{Time: now.Add(90 * time.Second)}},
			Response: response(403, with(map[string]string{"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}))},
			brokererr.RateLimitExceeded, 85 * time.Second, 91 * time.Second, "ok"},
		// go-github would say 50 min (X-RateLimit-Reset); GitHub says a minute.
		{"secondary without Retry-After", abuse(403, std, &fiftyMin), brokererr.RateLimitExceeded, time.Minute, time.Minute, "ok"},
		{"secondary with Retry-After", abuse(429, with(map[string]string{"Retry-After": "17"}), &fiftyMin), brokererr.RateLimitExceeded, 17 * time.Second, 17 * time.Second, "ok"},
		{"secondary, remaining 0", abuse(403, with(map[string]string{"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}), nil), brokererr.RateLimitExceeded, 85 * time.Second, 91 * time.Second, "ok"},
		{"go-github's own block", abuse(403, nil, &blockedLeft), brokererr.RateLimitExceeded, blockedLeft, blockedLeft, "ok"},
		{"403 secondary message, no doc URL", errResp(403, "You have exceeded a secondary rate limit and have been temporarily blocked", std), brokererr.RateLimitExceeded, time.Minute, time.Minute, "ok"},
		{"403 abuse detection message", errResp(403, "You have triggered an abuse detection mechanism.", nil), brokererr.RateLimitExceeded, time.Minute, time.Minute, "ok"},
		{"429 bare", errResp(429, "Too Many Requests", nil), brokererr.RateLimitExceeded, time.Minute, time.Minute, "ok"},
		{"429 Retry-After date", errResp(429, "", map[string]string{"Retry-After": now.Add(2 * time.Minute).UTC().Format(http.TimeFormat)}), brokererr.RateLimitExceeded, 118 * time.Second, 121 * time.Second, "ok"},
		{"403 Retry-After huge", errResp(403, "", map[string]string{"Retry-After": "999999999999"}), brokererr.RateLimitExceeded, time.Hour, time.Hour, "ok"},
		{"403 Retry-After 0", errResp(403, "", map[string]string{"Retry-After": "0"}), brokererr.RateLimitExceeded, time.Second, time.Second, "ok"},
		{"403 permission", errResp(403, "Resource not accessible by personal access token", with(map[string]string{"X-Accepted-GitHub-Permissions": "contents=write"})), brokererr.PermissionDenied, 0, 0, "token lacks permission"},
		{"401", errResp(401, "Bad credentials", nil), brokererr.GitHubAuthFailed, 0, 0, "token rejected"},
		{"404", errResp(404, "Not Found", std), brokererr.InvalidRepo, 0, 0, "ok"},
		{"409", errResp(409, "Git Repository is empty.", std), brokererr.Conflict, 0, 0, "ok"},
		{"422", errResp(422, "Update is not a fast forward", std), brokererr.Conflict, 0, 0, "ok"},
		{"502", errResp(502, "Bad Gateway", nil), brokererr.Unavailable, 0, 0, "ok"},
		{"transport", errors.New("dial tcp: connection refused"), brokererr.Unavailable, 0, 0, "ok"},
	}
	m := &Manager{log: zerolog.Nop()}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rs := testRepoState()
			got := brokererr.As(m.apiError(rs, "op", c.err))
			if got == nil || got.Code != c.code {
				t.Fatalf("got %v, want %s", got, c.code)
			}
			if c.code == brokererr.RateLimitExceeded {
				if !got.Retryable || got.RetryAfter < c.min || got.RetryAfter > c.max {
					t.Errorf("retry_after %v, want [%v, %v]", got.RetryAfter, c.min, c.max)
				}
				// The gate is closed for as long as the answer says.
				if g := brokererr.As(rs.limited(time.Now())); g == nil || g.Code != brokererr.RateLimitExceeded {
					t.Error("gate open after a rate limit")
				}
				if rs.limited(time.Now().Add(c.max+time.Second)) != nil {
					t.Error("gate still closed after the retry time")
				}
			} else if rs.limited(time.Now()) != nil {
				t.Error("gate closed by an error that is not a rate limit")
			}
			if rs.status != c.wantStatus {
				t.Errorf("status %q, want %q", rs.status, c.wantStatus)
			}
		})
	}
}

func FuzzRetryAfter(f *testing.F) {
	for _, s := range [][3]string{{"30", "", ""}, {"", "0", "1700000000"}, {"Wed, 21 Oct 2015 07:28:00 GMT", "", ""},
		{"-1", "0", "x"}, {"99999999999999999999", "", ""}, {" 5 ", "", ""}, {"", " 0", "99999999999999"}} {
		f.Add(s[0], s[1], s[2])
	}
	now := time.Unix(1_700_000_000, 0)
	f.Fuzz(func(t *testing.T, ra, remaining, reset string) {
		h := http.Header{}
		h.Set("Retry-After", ra)
		h.Set("X-RateLimit-Remaining", remaining)
		h.Set("X-RateLimit-Reset", reset)
		d, ok := retryAfter(h, now)
		if !ok && d != 0 {
			t.Fatalf("not limited but d=%v", d)
		}
		c := clampRetry(d)
		if c < time.Second || c > time.Hour {
			t.Fatalf("clamped %v to %v", d, c)
		}
		rs := testRepoState()
		be := brokererr.As(rateLimited(fmt.Errorf("x"), rs, d))
		if be == nil || be.RetryAfter != c || !be.Retryable {
			t.Fatalf("rateLimited(%v) = %+v", d, be)
		}
	})
}

func TestParseTokenExpiry(t *testing.T) {
	want := time.Date(2026, 3, 1, 12, 30, 5, 0, time.UTC)
	for in, ok := range map[string]bool{
		"2026-03-01 12:30:05 UTC":   true,
		" 2026-03-01 12:30:05 UTC ": true,
		"2026-03-01 21:30:05 +0900": true,
		"2026-03-01T12:30:05Z":      true,
		"2026-03-01 12:30:05 PST":   false, // Go would read it as UTC
		"2026-03-01 12:30:05":       false,
		"2026-02-30 12:30:05 UTC":   false,
		"":                          false,
		"never":                     false,
	} {
		got, gotOK := parseTokenExpiry(in)
		if gotOK != ok || ok && !got.Equal(want) {
			t.Errorf("%q: %v %v", in, got, gotOK)
		}
	}
}

// FuzzParseTokenExpiry: no panic; a time read comes back from its own
// rendering in GitHub's layout.
func FuzzParseTokenExpiry(f *testing.F) {
	for _, s := range []string{"2026-03-01 12:30:05 UTC", "2026-03-01 21:30:05 +0900", "2026-03-01T12:30:05Z", "9999-12-31 23:59:59 UTC", "x UTC"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, ok := parseTokenExpiry(s)
		if !ok {
			return
		}
		back, ok := parseTokenExpiry(got.Format(time.DateTime) + " UTC")
		if !ok || !back.Equal(got.Truncate(time.Second)) {
			t.Fatalf("%q → %v → %v %v", s, got, back, ok)
		}
	})
}
