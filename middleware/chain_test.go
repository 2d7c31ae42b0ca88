package middleware

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// chainArgs is a representative tool argument struct.
type chainArgs struct {
	Path  string            `json:"path" validate:"required,max=200,clean" audit:"digest" desc:"file path"`
	Mode  string            `json:"mode,omitempty" validate:"omitempty,oneof=read write" audit:"clear"`
	Label string            `json:"label,omitempty" validate:"max=100" audit:"clear"`
	Count int               `json:"count,omitempty" validate:"min=0,max=10"`
	Tags  []string          `json:"tags,omitempty" validate:"max=3,dive,max=10" audit:"digest"`
	Env   map[string]string `json:"env,omitempty" validate:"max=4,dive,max=20" audit:"digest"`
	Force *bool             `json:"force,omitempty"`
}

const (
	testSecret = "chain-test-secret-0123456789"
	toolName   = "do_thing"
)

// Token-shaped values, assembled so that no scanner flags this file.
var (
	testGHP = "gh" + "p_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4"
	testPAT = "github_" + "pat_" + "11ABCDEFG0123456789_abcdefghijklmnop"
)

// fakeClock is a manually advanced clock shared by the quota store and the
// rejection throttle.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

type harness struct {
	t         *testing.T
	root      string
	auditPath string
	log       *audit.Log
	store     *quota.Store
	clock     *fakeClock
	logBuf    *syncBuffer
	calls     atomic.Int64
	handler   server.ToolHandlerFunc // the tool body; counts calls
	h         server.ToolHandlerFunc // the body wrapped in the chain
	body      func(ctx context.Context, args *chainArgs) (*mcp.CallToolResult, error)
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

type harnessOpts struct {
	callsPerMinute int
	maxArgBytes    int
	throttle       *RejectionThrottle
	auditWrap      func(Auditor) Auditor
}

func newHarness(t *testing.T, o harnessOpts) *harness {
	t.Helper()
	if o.callsPerMinute == 0 {
		o.callsPerMinute = 1000
	}
	ctx := context.Background()
	root := t.TempDir()
	keys, err := audit.LoadKeys(audit.KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	hx := &harness{t: t, root: root, auditPath: filepath.Join(root, "audit.db"),
		clock: &fakeClock{t: time.Date(2025, 3, 10, 12, 0, 0, 0, time.UTC)}, logBuf: &syncBuffer{}}
	hx.log, err = audit.Open(ctx, audit.Options{Path: hx.auditPath, CheckpointPath: filepath.Join(root, "audit.checkpoints"),
		Keys: keys, CheckpointInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hx.log.Close() })
	hx.store, err = quota.Open(ctx, filepath.Join(root, "state.db"), hx.clock.Now)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hx.store.Close() })
	if o.throttle != nil {
		o.throttle.now = hx.clock.Now
	}
	spec := Args[chainArgs](o.maxArgBytes)
	spec.Toolset = "testset"
	deps := Deps{
		Specs: func(name string) (ArgSpec, bool) {
			if name == toolName {
				return spec, true
			}
			return ArgSpec{}, false
		},
		Limits:     func(identity.Principal) quota.Limits { return quota.Limits{CallsPerMinute: o.callsPerMinute} },
		Limiter:    hx.store,
		Audit:      hx.log,
		Metrics:    NewMetrics(),
		Redactor:   redact.New([]string{testSecret, string(keys.HMACKey), hex.EncodeToString(keys.HMACKey)}, []string{root}),
		Log:        zerolog.New(hx.logBuf),
		Now:        hx.clock.Now,
		Rejections: o.throttle,
	}
	if o.auditWrap != nil {
		deps.Audit = o.auditWrap(deps.Audit)
	}
	hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
		return mcp.NewToolResultText("ok"), nil
	}
	hx.handler = func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		hx.calls.Add(1)
		args, ok := ArgsFrom[chainArgs](ctx)
		if !ok {
			return nil, errors.New("handler reached without validated arguments")
		}
		return hx.body(ctx, args)
	}
	// Compose exactly as server.MCPServer does: the first middleware given
	// to WithToolHandlerMiddleware is the outermost.
	mws := Chain(deps)
	h := hx.handler
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	hx.h = h
	return hx
}

func alice() context.Context {
	return identity.WithPrincipal(context.Background(), identity.Principal{ID: "alice", Tier: quota.TierPro})
}

func request(tool, raw string) mcp.CallToolRequest {
	var req mcp.CallToolRequest
	req.Params.Name = tool
	if raw != "" {
		req.Params.RawArguments = json.RawMessage(raw)
	}
	return req
}

// call runs one call and requires the chain to return a result, never a Go
// error: the sanitize stage turns every error into a result.
func (hx *harness) call(ctx context.Context, raw string) *mcp.CallToolResult {
	hx.t.Helper()
	res, err := hx.h(ctx, request(toolName, raw))
	if err != nil {
		hx.t.Fatalf("chain returned a Go error: %v", err)
	}
	if res == nil {
		hx.t.Fatal("chain returned a nil result")
	}
	return res
}

// rows reads the audit log back through its export.
func (hx *harness) rows() []audit.Entry {
	hx.t.Helper()
	var buf bytes.Buffer
	if err := audit.Export(context.Background(), hx.auditPath, "jsonl", &buf); err != nil {
		hx.t.Fatalf("export: %v", err)
	}
	var out []audit.Entry
	sc := bufio.NewScanner(&buf)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e audit.Entry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			hx.t.Fatalf("export line %q: %v", sc.Text(), err)
		}
		out = append(out, e)
	}
	return out
}

func (hx *harness) exportText() string {
	var buf bytes.Buffer
	if err := audit.Export(context.Background(), hx.auditPath, "jsonl", &buf); err != nil {
		hx.t.Fatal(err)
	}
	return buf.String()
}

// errBody checks res is a structured error and returns its body.
func errBody(t *testing.T, res *mcp.CallToolResult, code brokererr.Code) map[string]any {
	t.Helper()
	if !res.IsError {
		t.Fatalf("want error %s, got success: %#v", code, res.Content)
	}
	body, ok := res.StructuredContent.(map[string]any)
	if !ok {
		t.Fatalf("structuredContent is %T, want an object", res.StructuredContent)
	}
	if body["error"] != string(code) {
		t.Fatalf("error = %v, want %s (message %v)", body["error"], code, body["message"])
	}
	if _, ok := body["message"].(string); !ok {
		t.Fatalf("message missing: %#v", body)
	}
	if _, ok := body["retryable"].(bool); !ok {
		t.Fatalf("retryable missing: %#v", body)
	}
	// The text content carries the same JSON for clients without structured output.
	if len(res.Content) != 1 {
		t.Fatalf("content: %#v", res.Content)
	}
	tc, ok := res.Content[0].(mcp.TextContent)
	if !ok {
		t.Fatalf("content[0] is %T", res.Content[0])
	}
	var fromText map[string]any
	if err := json.Unmarshal([]byte(tc.Text), &fromText); err != nil || fromText["error"] != string(code) || fromText["message"] != body["message"] {
		t.Fatalf("text content %q does not match structured %v (%v)", tc.Text, body, err)
	}
	return body
}

func TestChainUnauthenticated(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	res := hx.call(context.Background(), `{"path":"a"}`)
	body := errBody(t, res, brokererr.Unauthenticated)
	if body["retryable"] != false {
		t.Errorf("retryable = %v", body["retryable"])
	}
	// A principal with an empty ID is no principal.
	res = hx.call(identity.WithPrincipal(context.Background(), identity.Principal{}), `{"path":"a"}`)
	errBody(t, res, brokererr.Unauthenticated)
	if n := hx.calls.Load(); n != 0 {
		t.Fatalf("handler ran %d times", n)
	}
	rows := hx.rows()
	if len(rows) != 2 {
		t.Fatalf("got %d audit rows, want 2: %+v", len(rows), rows)
	}
	for _, r := range rows {
		if r.Phase != audit.PhaseOutcome || r.Outcome != audit.OutcomeDenied || r.ErrorCode != string(brokererr.Unauthenticated) ||
			r.Tool != toolName || r.Principal != "" || !strings.HasPrefix(r.CallID, "call_") {
			t.Errorf("row %+v", r)
		}
	}
	if rows[0].CallID == rows[1].CallID {
		t.Error("two calls share a call_id")
	}
}

func TestChainInvalidArguments(t *testing.T) {
	hx := newHarness(t, harnessOpts{maxArgBytes: 256})
	cases := []struct {
		name, raw, want string
	}{
		{"unknown field", `{"path":"a","evil":1}`, `unknown field "evil"`},
		{"wrong type", `{"path":5}`, `field "path" must be a string`},
		{"wrong nested type", `{"path":"a","tags":[1]}`, `must be a string`},
		{"non-object", `["path"]`, "must be a JSON object"},
		{"string", `"path"`, "must be a JSON object"},
		{"trailing garbage", `{"path":"a"} x`, "single JSON object"},
		{"two objects", `{"path":"a"}{"path":"b"}`, "single JSON object"},
		{"syntax", `{"path":`, "not valid"},
		{"invalid utf8", "{\"path\":\"\xff\"}", "UTF-8"},
		{"oversized", `{"path":"` + strings.Repeat("a", 300) + `"}`, "at most 256"},
		{"missing required", `{}`, `field "path" is required`},
		{"null is empty", `null`, `field "path" is required`},
		{"enum", `{"path":"a","mode":"exec"}`, `field "mode" must be one of: read, write`},
		{"max", `{"path":"a","count":11}`, `field "count" must be at most 10`},
		{"max items", `{"path":"a","tags":["1","2","3","4"]}`, `field "tags" must be at most 3 items`},
		{"dive max", `{"path":"a","tags":["12345678901"]}`, `field "tags[0]" must be at most 10 characters`},
		{"NUL", `{"path":"a\u0000b"}`, "without NUL"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			body := errBody(t, hx.call(alice(), c.raw), brokererr.InvalidInput)
			if msg := body["message"].(string); !strings.Contains(msg, c.want) {
				t.Errorf("message %q does not contain %q", msg, c.want)
			}
			if body["retryable"] != false {
				t.Errorf("retryable = %v", body["retryable"])
			}
		})
	}
	if n := hx.calls.Load(); n != 0 {
		t.Fatalf("handler ran %d times", n)
	}
	rows := hx.rows()
	if len(rows) != len(cases) {
		t.Fatalf("got %d audit rows, want %d", len(rows), len(cases))
	}
	for _, r := range rows {
		if r.Phase != audit.PhaseOutcome || r.Outcome != audit.OutcomeDenied || r.ErrorCode != string(brokererr.InvalidInput) || r.Principal != "alice" {
			t.Errorf("row %+v", r)
		}
		if string(r.Params) != "{}" {
			t.Errorf("refused call's params = %s, want {}", r.Params)
		}
	}
}

func TestChainUnknownTool(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	res, err := hx.h(alice(), request("no_such_tool", `{}`))
	if err != nil {
		t.Fatal(err)
	}
	body := errBody(t, res, brokererr.InternalError)
	if body["message"] != "internal error" {
		t.Errorf("message %q", body["message"])
	}
	if hx.calls.Load() != 0 {
		t.Fatal("handler ran")
	}
}

func TestChainHappyPathAudit(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	hx.body = func(_ context.Context, a *chainArgs) (*mcp.CallToolResult, error) {
		if a.Path != "secret/code.py" || a.Mode != "read" || a.Count != 3 || len(a.Tags) != 2 || a.Force == nil || !*a.Force {
			return nil, fmt.Errorf("args not decoded: %+v", a)
		}
		hx.clock.Add(1500 * time.Millisecond)
		return mcp.NewToolResultText("done"), nil
	}
	raw := `{"path":"secret/code.py","mode":"read","label":"key ` + testGHP + `","count":3,"tags":["x","y"],"env":{"K":"v"},"force":true}`
	res := hx.call(alice(), raw)
	if res.IsError {
		t.Fatalf("call failed: %#v", res.StructuredContent)
	}
	if hx.calls.Load() != 1 {
		t.Fatalf("handler ran %d times", hx.calls.Load())
	}
	rows := hx.rows()
	if len(rows) != 2 {
		t.Fatalf("got %d rows", len(rows))
	}
	intent, outcome := rows[0], rows[1]
	if intent.Phase != audit.PhaseIntent || outcome.Phase != audit.PhaseOutcome {
		t.Fatalf("phases %q, %q", intent.Phase, outcome.Phase)
	}
	if intent.CallID == "" || intent.CallID != outcome.CallID {
		t.Errorf("call ids %q, %q", intent.CallID, outcome.CallID)
	}
	if intent.Principal != "alice" || intent.Tool != toolName || outcome.Outcome != audit.OutcomeSuccess || outcome.ErrorCode != "" {
		t.Errorf("rows %+v / %+v", intent, outcome)
	}
	if outcome.DurationMS != 1500 {
		t.Errorf("duration_ms = %d, want 1500", outcome.DurationMS)
	}
	var params map[string]any
	if err := json.Unmarshal(intent.Params, &params); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte("secret/code.py"))
	wantPath := map[string]any{"bytes": float64(len("secret/code.py")), "sha256": hex.EncodeToString(sum[:8])}
	if fmt.Sprint(params["path"]) != fmt.Sprint(wantPath) {
		t.Errorf("path summary = %v, want %v", params["path"], wantPath)
	}
	if params["mode"] != "read" {
		t.Errorf("clear field mode = %v", params["mode"])
	}
	if params["label"] != "key [REDACTED]" {
		t.Errorf("clear field label = %v, want its token redacted", params["label"])
	}
	if params["count"] != float64(3) || params["force"] != true {
		t.Errorf("scalars: %v", params)
	}
	if tags, _ := params["tags"].(map[string]any); tags["count"] != float64(2) || tags["sha256"] == nil {
		t.Errorf("tags summary = %v", params["tags"])
	}
	if env, _ := params["env"].(map[string]any); env["count"] != float64(1) {
		t.Errorf("env summary = %v", params["env"])
	}
	text := hx.exportText()
	for _, leak := range []string{"secret/code.py", testGHP} {
		if strings.Contains(text, leak) {
			t.Errorf("audit log contains %q", leak)
		}
	}
}

// TestChainClockSteppedBack: a clock stepped back during a call still
// yields its outcome row (a duration cannot be negative, so it is 0
// rather than a row the log refuses), and later calls pass the rate
// limiter and are audited as usual.
func TestChainClockSteppedBack(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
		hx.clock.Add(-time.Hour)
		return mcp.NewToolResultText("done"), nil
	}
	for i := range 3 {
		if res := hx.call(alice(), `{"path":"a"}`); res.IsError {
			t.Fatalf("call %d: %v", i, res.StructuredContent)
		}
	}
	rows := hx.rows()
	if len(rows) != 6 {
		t.Fatalf("%d audit rows for 3 calls, want 6", len(rows))
	}
	for _, r := range rows {
		if r.Phase == audit.PhaseOutcome && (r.DurationMS != 0 || r.Outcome != audit.OutcomeSuccess) {
			t.Fatalf("outcome row %+v", r)
		}
	}
}

func TestChainRateLimit(t *testing.T) {
	hx := newHarness(t, harnessOpts{callsPerMinute: 2})
	for i := 0; i < 2; i++ {
		if res := hx.call(alice(), `{"path":"a"}`); res.IsError {
			t.Fatalf("call %d refused: %v", i, res.StructuredContent)
		}
	}
	body := errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.RateLimitExceeded)
	if body["retryable"] != true {
		t.Errorf("retryable = %v", body["retryable"])
	}
	if ra, ok := body["retry_after_s"].(float64); !ok || ra < 1 || ra > 120 {
		t.Errorf("retry_after_s = %v", body["retry_after_s"])
	}
	if !strings.Contains(body["message"].(string), "2 calls per minute") {
		t.Errorf("message %q", body["message"])
	}
	if hx.calls.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2", hx.calls.Load())
	}
	rows := hx.rows()
	if len(rows) != 5 {
		t.Fatalf("got %d rows, want 2 intent+outcome pairs and 1 refusal", len(rows))
	}
	last := rows[4]
	if last.Phase != audit.PhaseOutcome || last.Outcome != audit.OutcomeRateLimited || last.ErrorCode != string(brokererr.RateLimitExceeded) {
		t.Errorf("refusal row %+v", last)
	}
	// Another principal has its own budget.
	bob := identity.WithPrincipal(context.Background(), identity.Principal{ID: "bob", Tier: quota.TierFree})
	if res := hx.call(bob, `{"path":"a"}`); res.IsError {
		t.Fatalf("bob refused: %v", res.StructuredContent)
	}
	// Once the sliding window has moved on, alice may call again.
	hx.clock.Add(time.Duration(body["retry_after_s"].(float64)) * time.Second)
	if res := hx.call(alice(), `{"path":"a"}`); res.IsError {
		t.Fatalf("alice still refused: %v", res.StructuredContent)
	}
}

// Calls refused at validation still count toward the rate limit: a flood
// of invalid calls meets RATE_LIMIT_EXCEEDED, and validation still comes
// first (no handler, no intent row, INVALID_INPUT while under the limit).
func TestChainInvalidCallsCountTowardRateLimit(t *testing.T) {
	hx := newHarness(t, harnessOpts{callsPerMinute: 3})
	for i := 0; i < 3; i++ {
		errBody(t, hx.call(alice(), `{"evil":1}`), brokererr.InvalidInput)
	}
	body := errBody(t, hx.call(alice(), `{"evil":1}`), brokererr.RateLimitExceeded)
	if ra, ok := body["retry_after_s"].(float64); !ok || ra < 1 {
		t.Errorf("retry_after_s = %v", body["retry_after_s"])
	}
	// The invalid calls spent the budget of valid ones too.
	errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.RateLimitExceeded)
	if n := hx.calls.Load(); n != 0 {
		t.Fatalf("handler ran %d times", n)
	}
	for _, r := range hx.rows() {
		if r.Phase != audit.PhaseOutcome {
			t.Errorf("refused call wrote a %s row", r.Phase)
		}
	}
	// Another principal is unaffected.
	bob := identity.WithPrincipal(context.Background(), identity.Principal{ID: "bob", Tier: quota.TierFree})
	if res := hx.call(bob, `{"path":"a"}`); res.IsError {
		t.Fatalf("bob refused: %v", res.StructuredContent)
	}
}

func TestChainAuditFailClosed(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	if err := hx.log.Close(); err != nil {
		t.Fatal(err)
	}
	body := errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.Unavailable)
	if body["retryable"] != true {
		t.Errorf("retryable = %v", body["retryable"])
	}
	if hx.calls.Load() != 0 {
		t.Fatal("handler ran although the intent row could not be written")
	}
	if strings.Contains(body["message"].(string), "closed") {
		t.Errorf("message leaks the cause: %q", body["message"])
	}
}

// TestChainAuditSyncFailClosed: an intent row the audit writer committed
// but could not fsync refuses the call; the handler never runs.
func TestChainAuditSyncFailClosed(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	if res := hx.call(alice(), `{"path":"a"}`); res.IsError {
		t.Fatalf("first call refused: %v", res.StructuredContent)
	}
	ran := hx.calls.Load()
	if err := os.Remove(hx.auditPath + "-wal"); err != nil {
		t.Fatal(err)
	}
	errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.Unavailable)
	if hx.calls.Load() != ran {
		t.Fatal("handler ran although the intent row could not be made durable")
	}
}

func TestChainSanitizesErrors(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	hostPath := filepath.Join(hx.root, "workspaces", "alice", "main.py")

	t.Run("plain error", func(t *testing.T) {
		hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
			return nil, fmt.Errorf("open %s: token %s rejected", hostPath, testSecret)
		}
		body := errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.InternalError)
		if body["message"] != "internal error" || body["retryable"] != false {
			t.Errorf("body %v", body)
		}
	})

	t.Run("broker error", func(t *testing.T) {
		hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
			return nil, brokererr.Wrap(errors.New("cause "+testSecret), brokererr.FileNotFound,
				"%s and %s not found under %s/ws %s", testSecret, testPAT, hx.root, strings.Repeat("padding ", 60))
		}
		body := errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.FileNotFound)
		msg := body["message"].(string)
		if len(msg) > MaxMessageLen {
			t.Errorf("message is %d bytes", len(msg))
		}
		for _, leak := range []string{testSecret, testPAT, hx.root, "github_pat_"} {
			if strings.Contains(msg, leak) {
				t.Errorf("message %q leaks %q", msg, leak)
			}
		}
		if !strings.HasPrefix(msg, "[REDACTED] and [REDACTED] not found under [PATH]/ws padding") || !strings.HasSuffix(msg, "…") {
			t.Errorf("message %q", msg)
		}
	})

	t.Run("typed nil broker error", func(t *testing.T) {
		hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
			var e *brokererr.Error
			return nil, e
		}
		errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.InternalError)
	})

	t.Run("nil result", func(t *testing.T) {
		hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) { return nil, nil }
		errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.InternalError)
	})

	// The server-side log keeps a cause, redacted.
	logs := hx.logBuf.String()
	if !strings.Contains(logs, `"cause":"open [PATH]`) {
		t.Errorf("log lacks the redacted cause: %s", logs)
	}
	for _, leak := range []string{testSecret, hx.root, testPAT} {
		if strings.Contains(logs, leak) {
			t.Errorf("log leaks %q", leak)
		}
	}
	for _, r := range hx.rows() {
		if r.Phase == audit.PhaseOutcome && r.Outcome != audit.OutcomeFailure {
			t.Errorf("outcome row %+v, want failure", r)
		}
	}
}

func TestChainHandlerPanic(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
		panic("boom " + testSecret)
	}
	body := errBody(t, hx.call(alice(), `{"path":"a"}`), brokererr.InternalError)
	if body["message"] != "internal error" {
		t.Errorf("message %q", body["message"])
	}
	rows := hx.rows()
	if len(rows) != 2 || rows[1].Outcome != audit.OutcomeFailure || rows[1].ErrorCode != string(brokererr.InternalError) || rows[0].CallID != rows[1].CallID {
		t.Fatalf("rows %+v", rows)
	}
	hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
		return mcp.NewToolResultText("fine"), nil
	}
	if res := hx.call(alice(), `{"path":"a"}`); res.IsError {
		t.Fatalf("call after panic failed: %v", res.StructuredContent)
	}
	if hx.calls.Load() != 2 {
		t.Fatalf("handler ran %d times", hx.calls.Load())
	}
	if rows := hx.rows(); len(rows) != 4 || rows[3].Outcome != audit.OutcomeSuccess {
		t.Fatalf("rows %+v", rows)
	}
}

func TestChainRedactsOutput(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	hx.body = func(context.Context, *chainArgs) (*mcp.CallToolResult, error) {
		res := mcp.NewToolResultText("value " + testSecret + " and " + testGHP)
		res.Content = append(res.Content,
			&mcp.TextContent{Type: "text", Text: "ptr " + testSecret},
			mcp.EmbeddedResource{Type: "resource", Resource: mcp.TextResourceContents{URI: "file:///x", Text: "emb " + testGHP}},
			&mcp.EmbeddedResource{Type: "resource", Resource: &mcp.TextResourceContents{URI: "file:///y?t=" + testSecret, Text: "emb " + testSecret}},
			mcp.ResourceLink{Type: "resource_link", URI: "https://x/?token=" + testGHP, Name: testSecret, Title: "t " + testGHP, Description: "d " + testSecret},
			&mcp.ResourceLink{Type: "resource_link", URI: "https://x/", Name: "n", Title: testSecret},
		)
		res.StructuredContent = map[string]any{
			"out":   "secret " + testSecret,
			"list":  []string{testGHP},
			"inner": struct{ Key string }{Key: testGHP},
		}
		return res, nil
	}
	res := hx.call(alice(), `{"path":"a"}`)
	b, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	wire := string(b)
	for _, leak := range []string{testSecret, testGHP, "gh" + "p_"} {
		if strings.Contains(wire, leak) {
			t.Errorf("result leaks %q: %s", leak, wire)
		}
	}
	if strings.Count(wire, redact.Marker) < 13 {
		t.Errorf("expected every value redacted: %s", wire)
	}
	sc := res.StructuredContent.(map[string]any)
	if sc["out"] != "secret [REDACTED]" || sc["inner"].(map[string]any)["Key"] != redact.Marker {
		t.Errorf("structured %v", sc)
	}
}

func TestRedactResultRawAndUnencodable(t *testing.T) {
	r := redact.New([]string{testSecret}, nil)
	// mcp-go sends RawStructuredContent in preference to StructuredContent.
	res := &mcp.CallToolResult{RawStructuredContent: json.RawMessage(`{"a":"` + testSecret + `"}`)}
	b, _ := json.Marshal(RedactResult(r, res))
	if strings.Contains(string(b), testSecret) || !strings.Contains(string(b), redact.Marker) {
		t.Errorf("raw structured content: %s", b)
	}
	// Invalid raw JSON is dropped, not passed through.
	res = &mcp.CallToolResult{RawStructuredContent: json.RawMessage(`{"a":"` + testSecret)}
	if out := RedactResult(r, res); len(out.RawStructuredContent) != 0 {
		t.Errorf("invalid raw kept: %s", out.RawStructuredContent)
	}
	// Content that cannot be re-encoded is dropped, not passed through.
	res = &mcp.CallToolResult{StructuredContent: map[string]any{"s": testSecret, "c": make(chan int)}}
	if out := RedactResult(r, res); out.StructuredContent != nil {
		t.Errorf("unencodable structured content kept: %v", out.StructuredContent)
	}
	if RedactResult(r, nil) != nil {
		t.Error("nil result")
	}
}

func TestChainRejectionThrottle(t *testing.T) {
	th := NewRejectionThrottle(1, 2)
	hx := newHarness(t, harnessOpts{throttle: th})
	for i := 0; i < 10; i++ {
		errBody(t, hx.call(alice(), `{"nope":1}`), brokererr.InvalidInput)
	}
	rows := hx.rows()
	if len(rows) != 2 {
		t.Fatalf("flood of 10 wrote %d rows, want 2", len(rows))
	}
	// Admitted calls are not throttled: their intent and outcome rows are
	// written, without a suppressed count.
	if res := hx.call(alice(), `{"path":"a"}`); res.IsError {
		t.Fatal(res.StructuredContent)
	}
	if rows = hx.rows(); len(rows) != 4 || bytes.Contains(rows[2].Params, []byte("suppressed")) {
		t.Fatalf("rows %+v", rows)
	}
	// Another principal has its own allowance.
	errBody(t, hx.call(context.Background(), `{}`), brokererr.Unauthenticated)
	if rows = hx.rows(); len(rows) != 5 {
		t.Fatalf("unauthenticated refusal throttled with alice's: %d rows", len(rows))
	}
	hx.clock.Add(time.Second)
	errBody(t, hx.call(alice(), `["x"]`), brokererr.InvalidInput)
	rows = hx.rows()
	if len(rows) != 6 {
		t.Fatalf("got %d rows, want 6", len(rows))
	}
	var params map[string]any
	if err := json.Unmarshal(rows[5].Params, &params); err != nil {
		t.Fatal(err)
	}
	if params["suppressed_rejections"] != float64(8) {
		t.Errorf("params = %s, want suppressed_rejections 8", rows[5].Params)
	}
	// The count resets once reported.
	hx.clock.Add(time.Second)
	errBody(t, hx.call(alice(), `["x"]`), brokererr.InvalidInput)
	if rows = hx.rows(); len(rows) != 7 || bytes.Contains(rows[6].Params, []byte("suppressed")) {
		t.Fatalf("rows %+v", rows)
	}
}

func TestChainConcurrentCalls(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			raw := `{"path":"a"}`
			if i%2 == 1 {
				raw = `{"bad":1}`
			}
			res, err := hx.h(alice(), request(toolName, raw))
			if err != nil || res == nil || res.IsError != (i%2 == 1) {
				t.Errorf("call %d: %v %v", i, res, err)
			}
		}(i)
	}
	wg.Wait()
	if rows := hx.rows(); len(rows) != 4*2+4 {
		t.Fatalf("got %d rows, want 12", len(rows))
	}
}

// Issue 10 item 21: every row of a call says where it came from: the
// transport, the peer's address and user agent (cleaned and capped), the
// MCP session and the tool's toolset; refused calls' rows too.
func TestRowsCarryTheSource(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	ua := "evil\x1b]0;pwned\x07agent/" + strings.Repeat("z", 600)
	ctx := WithSource(alice(), audit.Source{Transport: "http", ClientAddr: "192.0.2.7:40112", UserAgent: ua})
	ctx = server.NewMCPServer("t", "1").WithContext(ctx, server.NewInProcessSession("mcp-sess-42", nil))
	hx.call(ctx, `{"path":"a"}`)                                                                // intent + outcome
	hx.call(ctx, `{"path":"a","unknown":true}`)                                                 // refused: one row
	hx.call(WithSource(context.Background(), audit.Source{Transport: "stdio"}), `{"path":"a"}`) // unauthenticated
	rows := hx.rows()
	if len(rows) != 4 {
		t.Fatalf("%d rows: %+v", len(rows), rows)
	}
	for _, r := range rows[:3] {
		s := r.Source
		if s.Transport != "http" || s.ClientAddr != "192.0.2.7:40112" || s.MCPSession != "mcp-sess-42" || s.Toolset != "testset" {
			t.Errorf("row %d (%s %s) source %+v", r.Seq, r.Phase, r.ErrorCode, s)
		}
		if len(s.UserAgent) != audit.MaxUserAgent || strings.ContainsAny(s.UserAgent, "\x1b\x07") || !strings.HasPrefix(s.UserAgent, "evil\uFFFD]0;pwned\uFFFDagent/") {
			t.Errorf("row %d user agent %q", r.Seq, s.UserAgent)
		}
	}
	if s := rows[3].Source; s.Transport != "stdio" || s.ClientAddr != "" || s.MCPSession != "" || s.Toolset != "testset" {
		t.Errorf("stdio row source %+v", s)
	}
	keys, err := audit.LoadVerifyKeys(audit.KeyConfig{Root: hx.root})
	if err != nil {
		t.Fatal(err)
	}
	if rep, err := audit.Verify(context.Background(), audit.VerifyOptions{Path: hx.auditPath,
		CheckpointPath: filepath.Join(hx.root, "audit.checkpoints"), Keys: keys}); err != nil || !rep.OK {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}

// TestOutcomeDetailInOutcomeRow: what a handler records with OutcomeDetail
// lands in its call's outcome row only (the intent row was written
// before), and a call that records nothing keeps {}.
func TestOutcomeDetailInOutcomeRow(t *testing.T) {
	hx := newHarness(t, harnessOpts{})
	hx.body = func(ctx context.Context, a *chainArgs) (*mcp.CallToolResult, error) {
		if a.Mode == "read" {
			return mcp.NewToolResultText("done"), nil
		}
		OutcomeDetail(ctx, "build", "continuing as execution exec_1")
		OutcomeDetail(ctx, "execution_id", "exec_1")
		return mcp.NewToolResultText("started"), nil
	}
	OutcomeDetail(context.Background(), "ignored", true) // outside the chain: no effect, no panic
	for _, mode := range []string{"write", "read"} {
		if res := hx.call(alice(), `{"path":"a.txt","mode":"`+mode+`"}`); res.IsError {
			t.Fatalf("%s: %#v", mode, res.StructuredContent)
		}
	}
	rows := hx.rows()
	if len(rows) != 4 {
		t.Fatalf("got %d rows", len(rows))
	}
	var detail map[string]any
	if err := json.Unmarshal(rows[1].Params, &detail); err != nil {
		t.Fatal(err)
	}
	if rows[1].Phase != audit.PhaseOutcome || len(detail) != 2 || detail["build"] != "continuing as execution exec_1" || detail["execution_id"] != "exec_1" {
		t.Errorf("outcome params %s", rows[1].Params)
	}
	if strings.Contains(string(rows[0].Params), "exec_1") {
		t.Errorf("intent params %s", rows[0].Params)
	}
	if string(rows[3].Params) != "{}" {
		t.Errorf("plain call's outcome params %s", rows[3].Params)
	}
}

// outcomeSignal is an Auditor that closes written once an outcome row is
// appended.
type outcomeSignal struct {
	Auditor
	once    sync.Once
	written chan struct{}
}

func (o *outcomeSignal) Append(ctx context.Context, r audit.Record) (int64, error) {
	seq, err := o.Auditor.Append(ctx, r)
	if r.Phase == audit.PhaseOutcome {
		o.once.Do(func() { close(o.written) })
	}
	return seq, err
}

// TestBesideOutcome: the work runs while the outcome row is written (it
// waits here for that row, so run before it the call would never end),
// and the answer comes only once it is done; a panic in it is logged and
// the answer stands. Outside the chain it runs at once.
func TestBesideOutcome(t *testing.T) {
	sig := &outcomeSignal{written: make(chan struct{})}
	hx := newHarness(t, harnessOpts{auditWrap: func(a Auditor) Auditor { sig.Auditor = a; return sig }})
	var done atomic.Bool
	hx.body = func(ctx context.Context, a *chainArgs) (*mcp.CallToolResult, error) {
		BesideOutcome(ctx, func() {
			select {
			case <-sig.written:
				done.Store(true)
			case <-time.After(30 * time.Second):
			}
		})
		if a.Mode == "read" {
			BesideOutcome(ctx, func() { panic("settle failed") })
		}
		return mcp.NewToolResultText("ok"), nil
	}
	if res := hx.call(alice(), `{"path":"a.txt","mode":"write"}`); res.IsError {
		t.Fatalf("%#v", res.StructuredContent)
	}
	if !done.Load() {
		t.Fatal("the answer came before the work beside the outcome row was done, or the work ran before the row")
	}
	if res := hx.call(alice(), `{"path":"a.txt","mode":"read"}`); res.IsError {
		t.Fatalf("after a panic beside the outcome: %#v", res.StructuredContent)
	}
	if !strings.Contains(hx.logBuf.String(), "beside_outcome_panic") {
		t.Errorf("the panic was not logged: %s", hx.logBuf.String())
	}
	ran := false
	BesideOutcome(context.Background(), func() { ran = true })
	if !ran {
		t.Error("outside the chain the work did not run at once")
	}
}
