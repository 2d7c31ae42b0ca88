package modelgw

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/modelgw/anthropicfake"
)

const (
	realKey        = "sk-ant-api03-real-operator-key-0123456789"
	placeholderKey = "sandbox-placeholder"
)

// memAudit keeps rows in memory; fail makes Append fail.
type memAudit struct {
	mu   sync.Mutex
	rows []audit.Record
	fail bool
}

func (m *memAudit) Append(_ context.Context, r audit.Record) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail {
		return 0, errors.New("disk full")
	}
	m.rows = append(m.rows, r)
	return int64(len(m.rows)), nil
}

func (m *memAudit) all() []audit.Record {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]audit.Record(nil), m.rows...)
}

type harness struct {
	gw     *Gateway
	fake   *anthropicfake.Fake
	audit  *memAudit
	budget *Budget
	client *http.Client
	// refused collects what Caller.OnRefused heard.
	mu      sync.Mutex
	refused []*brokererr.Error
	egress  []string // request lines the egress side received
}

func newHarness(t *testing.T, l Limits, script anthropicfake.Script) *harness {
	t.Helper()
	fake := anthropicfake.New(anthropicfake.Options{Key: realKey, Script: script})
	t.Cleanup(fake.Close)
	b, err := OpenBudget(context.Background(), filepath.Join(t.TempDir(), "state.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	h := &harness{fake: fake, audit: &memAudit{}, budget: b}
	h.gw, err = New(Options{Upstream: fake.URL, Key: func(string) string { return realKey },
		Models: []string{"claude-sonnet-4-5", "claude-haiku-4-5"}, MaxRequestBytes: 64 << 10,
		Budget: b, Audit: h.audit, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	caller := Caller{Principal: "alice", Limits: l, SessionID: "s1", ExecutionID: "exec_1",
		OnRefused: func(e *brokererr.Error) { h.mu.Lock(); h.refused = append(h.refused, e); h.mu.Unlock() }}
	h.client = h.sandbox(t, h.gw.Handler(caller))
	return h
}

// sandbox serves handler behind Serve on a Unix socket, as a task's egress
// socket is, and returns a client that reaches it the way an agent in the
// sandbox does: through its proxy (every request absolute-form). The
// egress side answers 403 and records what reached it.
func (h *harness) sandbox(t *testing.T, handler http.Handler) *http.Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "egress.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Serve(ln, handler, func(l net.Listener) {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				line, _ := bufio.NewReader(c).ReadString('\n')
				h.mu.Lock()
				h.egress = append(h.egress, strings.TrimSpace(line))
				h.mu.Unlock()
				_, _ = io.WriteString(c, "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
				c.Close()
			}
		})
	}()
	t.Cleanup(func() {
		ln.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("Serve did not return after its listener closed")
		}
	})
	proxy, _ := url.Parse("http://127.0.0.1:1")
	return &http.Client{Transport: &http.Transport{
		Proxy: http.ProxyURL(proxy),
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}, Timeout: 30 * time.Second}
}

func (h *harness) post(t *testing.T, path, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, BaseURL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("anthropic-version", "2023-06-01")
	req.Header.Set("x-api-key", placeholderKey)
	req.Header.Set("Authorization", "Bearer "+placeholderKey)
	req.Header.Set("x-stainless-os", "Linux")
	resp, err := h.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func msgBody(model string, stream bool) string {
	return fmt.Sprintf(`{"model":%q,"max_tokens":100,"stream":%v,"messages":[{"role":"user","content":"the secret prompt text"}]}`, model, stream)
}

// TestGatewayAddsTheKeyAndCountsUsage makes a streamed and a plain call
// through the socket and checks that the upstream saw only the operator's
// key, the answer arrived whole, the tokens were charged from the usage
// the answers reported, and each call has an intent and an outcome row with
// the model and token counts but neither prompt nor key.
func TestGatewayAddsTheKeyAndCountsUsage(t *testing.T) {
	h := newHarness(t, Limits{RequestsPerDay: 10, TokensPerDay: 1 << 30},
		anthropicfake.Linear(anthropicfake.Reply{Content: []anthropicfake.Block{anthropicfake.Text("a streamed answer that spans several deltas")}}))
	resp, body := h.post(t, "/v1/messages?beta=true", msgBody("claude-sonnet-4-5", true))
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" || !strings.Contains(string(body), "event: message_stop") {
		t.Fatalf("stream: %d %q", resp.StatusCode, body)
	}
	if resp.Header.Get("request-id") == "" {
		t.Fatal("request-id not passed back")
	}
	resp, body = h.post(t, "/v1/messages", msgBody("claude-haiku-4-5", false))
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"usage"`) {
		t.Fatalf("plain: %d %q", resp.StatusCode, body)
	}
	reqs := h.fake.Requests()
	if len(reqs) != 2 {
		t.Fatalf("upstream saw %d requests", len(reqs))
	}
	var want int64
	for _, r := range reqs {
		if r.APIKey != realKey || r.Authorization != "" || r.Query != "" && r.Query != "beta=true" {
			t.Fatalf("upstream request %+v", r)
		}
		want += int64(r.InputTokens + r.OutputTokens)
	}
	s, err := h.budget.Check(context.Background(), "alice", Limits{RequestsPerDay: 10, TokensPerDay: 1 << 30})
	if err != nil || s.Requests != 2 || s.Tokens != want {
		t.Fatalf("budget %+v (%v), want 2 requests and %d tokens", s, err, want)
	}
	rows := h.audit.all()
	if len(rows) != 4 {
		t.Fatalf("%d audit rows, want 4", len(rows))
	}
	for i, r := range rows {
		raw := string(r.Params)
		if strings.Contains(raw, "secret prompt") || strings.Contains(raw, realKey) || strings.Contains(raw, placeholderKey) {
			t.Fatalf("row %d leaks: %s", i, raw)
		}
		if r.Principal != "alice" || r.Tool != "model.messages" {
			t.Fatalf("row %d: %+v", i, r)
		}
	}
	var out struct {
		Model        string `json:"model"`
		Status       int    `json:"status"`
		InputTokens  int    `json:"input_tokens"`
		OutputTokens int    `json:"output_tokens"`
	}
	if err := json.Unmarshal(rows[1].Params, &out); err != nil {
		t.Fatal(err)
	}
	if rows[0].Phase != audit.PhaseIntent || rows[1].Outcome != audit.OutcomeSuccess || out.Model != "claude-sonnet-4-5" ||
		out.Status != 200 || out.InputTokens != reqs[0].InputTokens || out.OutputTokens != reqs[0].OutputTokens {
		t.Fatalf("rows %s / %s, upstream %+v", rows[0].Params, rows[1].Params, reqs[0])
	}
	if !strings.Contains(string(rows[0].Params), `"execution_id":"exec_1"`) {
		t.Fatalf("intent row lacks the execution: %s", rows[0].Params)
	}
}

// TestGatewayRefusesBeforeForwarding: paths, methods, queries, models and
// sizes outside the allow-lists never reach the upstream.
func TestGatewayRefusesBeforeForwarding(t *testing.T) {
	h := newHarness(t, Limits{RequestsPerDay: 10, TokensPerDay: 1000}, nil)
	for _, c := range []struct {
		name, method, path, body string
		status                   int
		typ                      string
	}{
		{"other path", "POST", "/v1/models", "{}", 404, "not_found_error"},
		{"broker path", "GET", "/mcp", "", 404, "not_found_error"},
		{"get", "GET", "/v1/messages", "", 405, "invalid_request_error"},
		{"query", "POST", "/v1/messages?x=1", msgBody("claude-sonnet-4-5", false), 400, "invalid_request_error"},
		{"model", "POST", "/v1/messages", msgBody("claude-opus-9", false), 403, "permission_error"},
		{"not json", "POST", "/v1/messages", "[1,2]", 400, "invalid_request_error"},
		{"too large", "POST", "/v1/messages", `{"model":"claude-sonnet-4-5","pad":"` + strings.Repeat("x", 64<<10) + `"}`, 413, "request_too_large"},
	} {
		t.Run(c.name, func(t *testing.T) {
			req, _ := http.NewRequest(c.method, BaseURL+c.path, strings.NewReader(c.body))
			resp, err := h.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var e struct {
				Error struct{ Type, Message string }
			}
			_ = json.NewDecoder(resp.Body).Decode(&e)
			if resp.StatusCode != c.status || e.Error.Type != c.typ || resp.Header.Get("x-should-retry") != "false" {
				t.Fatalf("got %d %+v (x-should-retry %q), want %d %s", resp.StatusCode, e, resp.Header.Get("x-should-retry"), c.status, c.typ)
			}
		})
	}
	if n := len(h.fake.Requests()); n != 0 {
		t.Fatalf("%d refused requests reached the upstream", n)
	}
	s, _ := h.budget.Check(context.Background(), "alice", Limits{RequestsPerDay: 10, TokensPerDay: 1000})
	if s.Requests != 0 {
		t.Fatalf("refused requests were charged: %+v", s)
	}
}

// TestGatewayBudgets: past the request budget, then past the token
// budget, calls are refused with a non-retryable API error, the task hears
// QUOTA_EXCEEDED, and the refusal is audited as rate limited.
func TestGatewayBudgets(t *testing.T) {
	h := newHarness(t, Limits{RequestsPerDay: 2, TokensPerDay: 1 << 30}, nil)
	for i := 0; i < 2; i++ {
		if resp, b := h.post(t, "/v1/messages", msgBody("claude-sonnet-4-5", false)); resp.StatusCode != 200 {
			t.Fatalf("call %d: %d %s", i, resp.StatusCode, b)
		}
	}
	resp, body := h.post(t, "/v1/messages", msgBody("claude-sonnet-4-5", true))
	var e struct {
		Type  string
		Error struct{ Type, Message string }
	}
	_ = json.Unmarshal(body, &e)
	if resp.StatusCode != 429 || e.Type != "error" || e.Error.Type != "rate_limit_error" || !strings.Contains(e.Error.Message, "request budget (2 requests)") ||
		resp.Header.Get("x-should-retry") != "false" || resp.Header.Get("retry-after") == "" {
		t.Fatalf("third call: %d %s %v", resp.StatusCode, body, resp.Header)
	}
	if n := len(h.fake.Requests()); n != 2 {
		t.Fatalf("upstream saw %d calls, want 2", n)
	}
	h.mu.Lock()
	refused := h.refused
	h.mu.Unlock()
	if len(refused) != 1 || refused[0].Code != brokererr.QuotaExceeded {
		t.Fatalf("task heard %+v", refused)
	}
	rows := h.audit.all()
	last := rows[len(rows)-1]
	if last.Outcome != audit.OutcomeRateLimited || last.ErrorCode != string(brokererr.QuotaExceeded) {
		t.Fatalf("last row %+v", last)
	}

	// Tokens: one call spends more than the budget holds; the next is refused.
	t2 := newHarness(t, Limits{RequestsPerDay: 100, TokensPerDay: 5}, nil)
	if resp, b := t2.post(t, "/v1/messages", msgBody("claude-sonnet-4-5", true)); resp.StatusCode != 200 {
		t.Fatalf("first: %d %s", resp.StatusCode, b)
	}
	resp, body = t2.post(t, "/v1/messages", msgBody("claude-sonnet-4-5", true))
	if resp.StatusCode != 429 || !strings.Contains(string(body), "token budget (5 tokens)") {
		t.Fatalf("second: %d %s", resp.StatusCode, body)
	}
	if err := t2.gw.CheckBudget(context.Background(), "alice", Limits{RequestsPerDay: 100, TokensPerDay: 5}); brokererr.CodeOf(err) != brokererr.QuotaExceeded {
		t.Fatalf("CheckBudget: %v", err)
	}
}

// TestGatewayNeedsItsAuditRow: when the intent row cannot be written the
// call is not made.
func TestGatewayNeedsItsAuditRow(t *testing.T) {
	h := newHarness(t, Limits{RequestsPerDay: 10, TokensPerDay: 1 << 20}, nil)
	h.audit.fail = true
	resp, _ := h.post(t, "/v1/messages", msgBody("claude-sonnet-4-5", false))
	if resp.StatusCode != 503 || len(h.fake.Requests()) != 0 {
		t.Fatalf("status %d, upstream saw %d", resp.StatusCode, len(h.fake.Requests()))
	}
}

// TestMuxRoutesByRequestLine: the gateway gets its own requests, in either
// form; tunnels and other hosts go to the egress side, never the gateway.
func TestMuxRoutesByRequestLine(t *testing.T) {
	h := newHarness(t, Limits{RequestsPerDay: 10, TokensPerDay: 1 << 20}, nil)
	// Through the proxy: another host, and a CONNECT tunnel.
	req, _ := http.NewRequest("GET", "http://10.0.0.1/", nil)
	if resp, err := h.client.Do(req); err != nil || resp.StatusCode != 403 {
		t.Fatalf("other host: %v %v", resp, err)
	}
	if _, err := h.client.Get("https://example.com/"); err == nil {
		t.Fatal("a CONNECT tunnel was opened")
	}
	// Straight at the forwarder, origin-form, as a client ignoring the
	// proxy variables would.
	tr := h.client.Transport.(*http.Transport).Clone()
	tr.Proxy = nil
	direct := &http.Client{Transport: tr}
	resp, err := direct.Post("http://127.0.0.1:4321/v1/messages", "application/json", strings.NewReader(msgBody("claude-sonnet-4-5", false)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 400 { // no anthropic-version: the upstream's own refusal came back
		t.Fatalf("origin-form: %d", resp.StatusCode)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.egress) != 2 || h.egress[0] != "GET http://10.0.0.1/ HTTP/1.1" || !strings.HasPrefix(h.egress[1], "CONNECT example.com:443 ") {
		t.Fatalf("egress saw %q", h.egress)
	}
	for _, l := range []string{"GET /x HTTP/1.1", "POST http://model-gateway.invalid/v1/messages HTTP/1.1", "POST http://MODEL-GATEWAY.INVALID:80/v1 HTTP/1.1"} {
		if !forGateway(l) {
			t.Errorf("%q not routed to the gateway", l)
		}
	}
	for _, l := range []string{"CONNECT model-gateway.invalid:80 HTTP/1.1", "GET http://model-gateway.invalid.evil.com/ HTTP/1.1",
		"GET http://model-gateway.invalid:8080/ HTTP/1.1", "GET http://x@model-gateway.invalid/ HTTP/1.1", "", "GET", "GET ftp://model-gateway.invalid/ HTTP/1.1"} {
		if forGateway(l) {
			t.Errorf("%q routed to the gateway", l)
		}
	}
}

// TestBudgetTakeIsAtomic: concurrent takes never exceed the limit.
func TestBudgetTakeIsAtomic(t *testing.T) {
	b, err := OpenBudget(context.Background(), filepath.Join(t.TempDir(), "state.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	l := Limits{RequestsPerDay: 5, TokensPerDay: 100}
	var wg sync.WaitGroup
	var mu sync.Mutex
	allowed := 0
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := b.Take(context.Background(), "p", l)
			if err != nil {
				t.Error(err)
				return
			}
			if s.Exhausted == "" {
				mu.Lock()
				allowed++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if allowed != 5 {
		t.Fatalf("%d takes allowed, want 5", allowed)
	}
	s, _ := b.Check(context.Background(), "p", l)
	if s.Requests != 5 || s.Exhausted != "requests" || s.RetryAfter <= 0 || s.RetryAfter > 24*time.Hour {
		t.Fatalf("%+v", s)
	}
}

// FuzzForGateway: whatever the request line, the cheap router agrees with
// net/http's parser: a line it sends to the gateway is never a CONNECT and
// names no host but the gateway's.
func FuzzForGateway(f *testing.F) {
	for _, l := range []string{"POST http://model-gateway.invalid/v1/messages?beta=true HTTP/1.1", "GET / HTTP/1.1",
		"CONNECT example.com:443 HTTP/1.1", "GET http://model-gateway.invalid.evil/ HTTP/1.1", "GET http://MODEL-GATEWAY.invalid:80/ HTTP/1.1"} {
		f.Add(l)
	}
	f.Fuzz(func(t *testing.T, line string) {
		if !forGateway(line) || strings.ContainsAny(line, "\r\n") {
			return
		}
		req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(line + "\r\nHost: h\r\n\r\n")))
		if err != nil {
			return // net/http refuses it; the gateway's server will too
		}
		if req.Method == http.MethodConnect || req.URL.Host != "" && !IsGatewayHost(req.URL.Host) {
			t.Fatalf("%q routed to the gateway: method %s host %q", line, req.Method, req.URL.Host)
		}
	})
}
