package tests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/client/transport"
	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

const testToken = "test-token-0123456789abcdef"

type usage struct {
	Principal string `json:"principal"`
	Tier      string `json:"tier"`
	Limits    struct {
		CallsPerMinute int `json:"calls_per_minute"`
	} `json:"limits"`
	Remaining struct {
		CallsThisMinute int `json:"calls_this_minute"`
	} `json:"remaining"`
}

func TestHTTPInitializeListAndUsage(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken})
	c := b.Client(t, testToken)
	ctx := context.Background()
	tools, err := c.ListTools(ctx, mcp.ListToolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]mcp.Tool{}
	for _, tl := range tools.Tools {
		names[tl.Name] = tl
	}
	gu, ok := names["get_usage"]
	if !ok {
		t.Fatalf("get_usage not listed: %v", names)
	}
	var wire struct {
		InputSchema map[string]any `json:"inputSchema"`
	}
	j, _ := json.Marshal(gu)
	if err := json.Unmarshal(j, &wire); err != nil || wire.InputSchema["additionalProperties"] != false {
		t.Fatalf("get_usage schema not strict: %s", j)
	}
	var u usage
	res := callTool(t, c, "get_usage", map[string]any{})
	resultJSON(t, res, &u)
	if res.IsError || u.Principal != "default" || u.Tier != "pro" || u.Limits.CallsPerMinute != 100 {
		t.Fatalf("usage = %+v", u)
	}
	if u.Remaining.CallsThisMinute != 99 {
		t.Fatalf("remaining calls = %d, want 99 after one call", u.Remaining.CallsThisMinute)
	}
}

func TestStdioServesProtocolOnlyOnStdout(t *testing.T) {
	c := StartStdio(t, "", nil)
	var u usage
	resultJSON(t, callTool(t, c, "get_usage", nil), &u)
	if u.Principal != "local" || u.Tier != "pro" {
		t.Fatalf("stdio principal = %+v, want local/pro", u)
	}
	// A second call proves the stream was not corrupted by stray output.
	resultJSON(t, callTool(t, c, "get_usage", map[string]any{}), &u)
	if u.Remaining.CallsThisMinute != 98 {
		t.Fatalf("remaining = %d, want 98", u.Remaining.CallsThisMinute)
	}
}

func TestStdioRejectsBadLinesAndKeepsServing(t *testing.T) {
	cmd := exec.Command(brokerBin, "serve", "--transport", "stdio")
	cmd.Env = brokerEnv(t.TempDir(), "", nil)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	var stderr syncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // EOF ends the broker, which removes its sandboxes
		_ = stdin.Close()
		kill := time.AfterFunc(20*time.Second, func() { _ = cmd.Process.Kill() })
		_ = cmd.Wait()
		kill.Stop()
	})
	lines := []string{
		`{not json`,
		"{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"tools/call\",\"params\":{\"name\":\"get_usage\",\"arguments\":{\"\xff\":1}}}",
		`{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"get_usage","arguments":[1,2]}}`,
		`{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"get_usage","arguments":{}}}`,
	}
	go func() {
		for _, l := range lines {
			_, _ = io.WriteString(stdin, l+"\n")
		}
	}()
	byID := map[float64]map[string]any{}
	sc := bufio.NewScanner(stdout)
	deadline := time.AfterFunc(30*time.Second, func() { _ = cmd.Process.Kill() })
	defer deadline.Stop()
	for len(byID) < 3 && sc.Scan() {
		var msg map[string]any
		if err := json.Unmarshal(sc.Bytes(), &msg); err != nil {
			t.Fatalf("stdout carries a non-JSON line %q", sc.Text())
		}
		if id, ok := msg["id"].(float64); ok {
			byID[id] = msg
		}
	}
	stdin.Close()
	for _, id := range []float64{7, 8} {
		res, _ := byID[id]["result"].(map[string]any)
		sc, _ := res["structuredContent"].(map[string]any)
		if res["isError"] != true || sc["error"] != "INVALID_INPUT" {
			t.Errorf("id %v: want INVALID_INPUT tool error, got %v", id, byID[id])
		}
	}
	if res, _ := byID[9]["result"].(map[string]any); res == nil || res["isError"] == true {
		t.Errorf("valid call after bad input failed: %v\n%s", byID[9], stderr.String())
	}
}

func TestHTTPAuthRequired(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken})
	for name, header := range map[string]string{"missing": "", "wrong": "Bearer not-the-token-at-all", "basic": "Basic dXNlcjpwYXNz"} {
		req, _ := http.NewRequest(http.MethodPost, b.URL+"/mcp", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/list"}`))
		if header != "" {
			req.Header.Set("Authorization", header)
		}
		resp := do(t, req)
		if resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer ") {
			t.Errorf("%s token: status %d, WWW-Authenticate %q", name, resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
		}
	}
	req, _ := http.NewRequest(http.MethodGet, b.URL+"/metrics", nil)
	if resp := do(t, req); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("/metrics without token: %d", resp.StatusCode)
	}
}

func TestGeneratedTokenIsKeptPrivate(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{})
	st, err := os.Stat(filepath.Join(b.Root, "api_token"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("token file: %v mode %v", err, st.Mode())
	}
	if strings.Contains(b.Logs(), b.Token) {
		t.Fatal("the generated token appears in the logs")
	}
	c := b.Client(t, b.Token)
	callTool(t, c, "get_usage", nil)
	b.Stop(t)
	// A restart reuses the same token.
	b2 := StartHTTP(t, BrokerOpts{Root: b.Root})
	if b2.Token != b.Token {
		t.Fatal("token changed across restart")
	}
	callTool(t, b2.Client(t, b2.Token), "get_usage", nil)
}

func TestDNSRebindingAndOriginRejected(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken})
	cases := map[string]func(*http.Request){
		"evil host":   func(r *http.Request) { r.Host = "evil.example" },
		"evil origin": func(r *http.Request) { r.Header.Set("Origin", "https://evil.example") },
		"null origin": func(r *http.Request) { r.Header.Set("Origin", "null") },
	}
	for name, mutate := range cases {
		req, _ := http.NewRequest(http.MethodPost, b.URL+"/mcp", strings.NewReader(`{}`))
		req.Header.Set("Authorization", "Bearer "+testToken)
		mutate(req)
		if resp := do(t, req); resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s: status %d, want 403", name, resp.StatusCode)
		}
	}
	req, _ := http.NewRequest(http.MethodGet, b.URL+"/healthz", nil)
	req.Header.Set("Origin", "http://localhost:3000")
	if resp := do(t, req); resp.StatusCode != http.StatusOK {
		t.Errorf("localhost origin refused: %d", resp.StatusCode)
	}
}

func TestSessionBoundToPrincipal(t *testing.T) {
	tokens, other := writeTokens(t, map[string]string{"alice": "pro", "mallory": "pro"})
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens}})
	c, err := client.NewStreamableHttpClient(b.URL+"/mcp",
		transport.WithHTTPHeaders(map[string]string{"Authorization": "Bearer " + other["alice"]}))
	if err != nil {
		t.Fatal(err)
	}
	initClient(t, c)
	sid := c.GetSessionId()
	if sid == "" {
		t.Fatal("no session id")
	}
	post := func(token, session, body string) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, b.URL+"/mcp", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Mcp-Session-Id", session)
		return do(t, req)
	}
	list := `{"jsonrpc":"2.0","id":5,"method":"tools/list"}`
	if resp := post(other["mallory"], sid, list); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("mallory using alice's session: %d, want 404", resp.StatusCode)
	}
	if resp := post(other["alice"], "mcp-session-forged", list); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("forged session: %d, want 404", resp.StatusCode)
	}
	if resp := post(other["alice"], sid, list); resp.StatusCode != http.StatusOK {
		t.Fatalf("alice's own session: %d", resp.StatusCode)
	}
	// The server's notification stream is served at /mcp/events too.
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.URL+"/mcp/events", nil)
	req.Header.Set("Authorization", "Bearer "+other["alice"])
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Mcp-Session-Id", sid)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("/mcp/events: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	cancel()
	resp.Body.Close()
	// DELETE ends the session; it cannot be used afterwards.
	del, _ := http.NewRequest(http.MethodDelete, b.URL+"/mcp", nil)
	del.Header.Set("Authorization", "Bearer "+other["alice"])
	del.Header.Set("Mcp-Session-Id", sid)
	if resp := do(t, del); resp.StatusCode >= 300 {
		t.Fatalf("DELETE: %d", resp.StatusCode)
	}
	if resp := post(other["alice"], sid, list); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("deleted session still usable: %d", resp.StatusCode)
	}
}

func TestRateLimitPersistsAcrossRestart(t *testing.T) {
	tokens, tok := writeTokens(t, map[string]string{"free-user": "free"})
	env := map[string]string{"MCP_TOKENS_FILE": tokens, "RATE_LIMIT_PER_MINUTE": "3"}
	b := StartHTTP(t, BrokerOpts{Env: env})
	c := b.Client(t, tok["free-user"])
	for i := 0; i < 3; i++ {
		if res := callTool(t, c, "get_usage", nil); res.IsError {
			t.Fatalf("call %d refused: %+v", i+1, res.Content)
		}
	}
	e := mustToolError(t, callTool(t, c, "get_usage", nil), "RATE_LIMIT_EXCEEDED")
	if !e.Retryable || e.RetryAfterS == nil || *e.RetryAfterS < 1 || *e.RetryAfterS > 120 {
		t.Fatalf("rate limit error = %+v", e)
	}
	b.Stop(t)
	b2 := StartHTTP(t, BrokerOpts{Root: b.Root, Env: env})
	mustToolError(t, callTool(t, b2.Client(t, tok["free-user"]), "get_usage", nil), "RATE_LIMIT_EXCEEDED")
	metrics := get(t, b2, tok["free-user"], "/metrics")
	if !strings.Contains(metrics, `sandbox_broker_rate_limit_rejections_total{tool="get_usage"} 1`) ||
		!strings.Contains(metrics, `sandbox_broker_tool_calls_total{outcome="rate_limited",tool="get_usage"} 1`) {
		t.Fatalf("metrics lack the rejection:\n%s", grepLines(metrics, "sandbox_broker_"))
	}
}

func TestBadInputGetsClearErrorsAndServerKeepsServing(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken})
	c := b.Client(t, testToken)
	sid := c.GetSessionId()
	raw := func(body []byte) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, b.URL+"/mcp", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+testToken)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Mcp-Session-Id", sid)
		resp := do(t, req)
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := raw([]byte(`{"jsonrpc":"2.0","id":1,`)); !strings.Contains(body, `"code":-32700`) {
		t.Errorf("malformed JSON: %d %s", code, body)
	}
	if code, body := raw([]byte("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\",\"x\":\"\xc3\x28\"}")); code != 400 || !strings.Contains(body, "UTF-8") {
		t.Errorf("invalid UTF-8: %d %s", code, body)
	}
	big := bytes.Repeat([]byte("A"), 33<<20)
	if code, body := raw(append(append([]byte(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"get_usage","arguments":{"a":"`), big...), `"}}}`...)); code != 413 || !strings.Contains(body, "exceeds") {
		t.Errorf("33 MB body: %d %.200s", code, body)
	}
	tenMB := strings.Repeat("B", 10<<20)
	e := mustToolError(t, callTool(t, c, "get_usage", map[string]any{"blob": tenMB}), "INVALID_INPUT")
	if !strings.Contains(e.Message, "at most") {
		t.Errorf("10 MB arguments: %q", e.Message)
	}
	mustToolError(t, callTool(t, c, "get_usage", map[string]any{"unexpected": 1}), "INVALID_INPUT")
	mustToolError(t, callTool(t, c, "get_usage", []any{1, 2}), "INVALID_INPUT")
	mustToolError(t, callTool(t, c, "get_usage", "a string"), "INVALID_INPUT")
	// Typed fields: validation runs before any handler or backend.
	for _, args := range []map[string]any{
		{"language": 5, "code": "print(1)"},
		{"language": "python", "code": "print(1)", "timeout_s": "ten"},
		{"language": "python", "code": "print(1)", "timeout_s": 1.5},
		{"language": "python", "code": "print(1)", "session_id": "../etc"},
		{"language": "python"},
		{"language": "python", "code": "x", "Code": "y"},
	} {
		mustToolError(t, callTool(t, c, "run_code", args), "INVALID_INPUT")
	}
	var req mcp.CallToolRequest
	req.Params.Name = "no_such_tool"
	if _, err := c.CallTool(context.Background(), req); err == nil {
		t.Error("unknown tool: want a JSON-RPC error")
	}
	if res := callTool(t, c, "get_usage", nil); res.IsError {
		t.Fatalf("server stopped serving after bad input: %+v", res.Content)
	}
	if code, body := raw([]byte(`{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"get_usage","arguments":{}}}`)); code != 200 || !strings.Contains(body, "principal") {
		t.Errorf("plain call after bad input: %d %s", code, body)
	}
}

// TestCanaryNeverLeaks plants secrets in config, sends them (and token
// shapes) through every path that echoes input, then searches tool results,
// logs and the audit database.
func TestCanaryNeverLeaks(t *testing.T) {
	canary := "CANARY-3f9a1c7e5b2d4a6c8e0f1a2b3c4d5e6f"
	fakePAT := "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ"
	env := map[string]string{"FILE_SECRET": canary + "-file", "AUDIT_HMAC_KEY": canary + "-audit-key-material"}
	b := StartHTTP(t, BrokerOpts{Token: canary, Env: env})
	c := b.Client(t, canary)
	var outputs []string
	for _, args := range []any{
		map[string]any{canary: 1},
		map[string]any{fakePAT: 1},
		map[string]any{"x": canary + "-file"},
		map[string]any{"ghp_" + strings.Repeat("a", 36): fakePAT},
		nil,
	} {
		res := callTool(t, c, "get_usage", args)
		j, _ := json.Marshal(res)
		outputs = append(outputs, string(j))
	}
	b.Stop(t)
	export := runBroker(t, b.Root, "audit", "export", "--format", "jsonl")
	dbBytes := readAll(t, filepath.Join(b.Root, "audit.db"))
	wal, _ := os.ReadFile(filepath.Join(b.Root, "audit.db-wal"))
	for name, hay := range map[string]string{
		"tool results": strings.Join(outputs, "\n"),
		"logs":         b.Logs(),
		"audit export": export,
		"audit db":     string(dbBytes) + string(wal),
	} {
		for _, needle := range []string{canary, "github_pat_11ABC", "ghp_aaaa"} {
			if strings.Contains(hay, needle) {
				t.Errorf("%s contain %q", name, needle)
			}
		}
	}
	if !strings.Contains(strings.Join(outputs, ""), "[REDACTED]") {
		t.Error("the echoed field name was not replaced by [REDACTED]")
	}
}

func TestAuditRecordsEveryCallAndVerifies(t *testing.T) {
	tokens, tok := writeTokens(t, map[string]string{"auditor": "free"})
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens, "RATE_LIMIT_PER_MINUTE": "3"}})
	c := b.Client(t, tok["auditor"])
	callTool(t, c, "get_usage", nil)
	callTool(t, c, "get_usage", map[string]any{"bogus": true}) // refused at validation, and counted
	callTool(t, c, "get_usage", nil)
	callTool(t, c, "get_usage", nil)
	b.Stop(t)
	out := runBroker(t, b.Root, "audit", "export", "--format", "jsonl")
	type row struct {
		Seq       int64  `json:"seq"`
		CallID    string `json:"call_id"`
		Phase     string `json:"phase"`
		Principal string `json:"principal"`
		Tool      string `json:"tool"`
		Outcome   string `json:"outcome"`
		ErrorCode string `json:"error_code"`
	}
	var rows []row
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var r row
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("export line %q: %v", line, err)
		}
		rows = append(rows, r)
	}
	want := []struct{ phase, outcome, code string }{
		{"intent", "", ""}, {"outcome", "success", ""},
		{"outcome", "denied", "INVALID_INPUT"},
		{"intent", "", ""}, {"outcome", "success", ""},
		{"outcome", "rate_limited", "RATE_LIMIT_EXCEEDED"},
	}
	if len(rows) != len(want) {
		t.Fatalf("got %d rows, want %d:\n%s", len(rows), len(want), out)
	}
	for i, w := range want {
		r := rows[i]
		if r.Seq != int64(i+1) || r.Phase != w.phase || r.Outcome != w.outcome || r.ErrorCode != w.code || r.Principal != "auditor" || r.Tool != "get_usage" {
			t.Errorf("row %d = %+v, want %+v", i, r, w)
		}
	}
	if rows[0].CallID != rows[1].CallID {
		t.Error("intent and outcome rows do not share a call_id")
	}
	if v := runBroker(t, b.Root, "audit", "verify"); !strings.HasPrefix(v, "OK") {
		t.Fatalf("verify: %s", v)
	}
}

func TestHealthEndpointsAndResource(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken})
	if body := getNoAuth(t, b, "/healthz"); !strings.Contains(body, `"ok"`) {
		t.Fatalf("/healthz: %s", body)
	}
	var ready struct {
		Status     string            `json:"status"`
		Components map[string]string `json:"components"`
	}
	if err := json.Unmarshal([]byte(getNoAuth(t, b, "/readyz")), &ready); err != nil || ready.Status != "ok" ||
		ready.Components["audit_log"] != "ok" || ready.Components["state_store"] != "ok" {
		t.Fatalf("/readyz: %+v %v", ready, err)
	}
	c := b.Client(t, testToken)
	var rr mcp.ReadResourceRequest
	rr.Params.URI = "health://check"
	res, err := c.ReadResource(context.Background(), rr)
	if err != nil || len(res.Contents) != 1 {
		t.Fatalf("health resource: %v %v", res, err)
	}
	text := res.Contents[0].(mcp.TextResourceContents).Text
	var h struct {
		Status  string `json:"status"`
		UptimeS *int64 `json:"uptime_s"`
	}
	if err := json.Unmarshal([]byte(text), &h); err != nil || h.Status != "ok" || h.UptimeS == nil {
		t.Fatalf("health://check = %s", text)
	}
}

func TestConfigErrorsNameTheVariable(t *testing.T) {
	for env, want := range map[string]string{
		"MCP_HTTP_ADDR=not-an-addr":           "MCP_HTTP_ADDR",
		"RATE_LIMIT_PER_MINUTE=lots":          "RATE_LIMIT_PER_MINUTE",
		"FILE_SECRET=short-secret-value-xyz1": "FILE_SECRET",
		"MCP_TRANSPORT=carrier-pigeon":        "MCP_TRANSPORT",
	} {
		cmd := exec.Command(brokerBin, "serve")
		cmd.Env = append(brokerEnv(t.TempDir(), "", nil), env)
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), want) {
			t.Errorf("%s: err=%v out=%s", env, err, out)
		}
		if strings.Contains(env, "SECRET") && strings.Contains(string(out), "short-secret-value") {
			t.Errorf("secret value echoed: %s", out)
		}
	}
}

// --- helpers ---

func writeTokens(t testing.TB, principals map[string]string) (path string, tokens map[string]string) {
	t.Helper()
	tokens = map[string]string{}
	var entries []identity.TokenEntry
	for p, tier := range principals {
		tok := "tok-" + p + "-" + strings.Repeat("x", 24)
		tokens[p] = tok
		entries = append(entries, identity.TokenEntry{Principal: p, Tier: tier, TokenSHA256: identity.HashToken(tok)})
	}
	b, _ := json.Marshal(entries)
	path = filepath.Join(t.TempDir(), "tokens.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, tokens
}

func do(t testing.TB, req *http.Request) *http.Response {
	t.Helper()
	ctx, cancel := context.WithTimeout(req.Context(), 60*time.Second)
	t.Cleanup(cancel)
	resp, err := http.DefaultClient.Do(req.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(body))
	return resp
}

func get(t testing.TB, b *Broker, token, path string) string {
	req, _ := http.NewRequest(http.MethodGet, b.URL+path, nil)
	req.Header.Set("Authorization", "Bearer "+token)
	body, _ := io.ReadAll(do(t, req).Body)
	return string(body)
}

func getNoAuth(t testing.TB, b *Broker, path string) string {
	req, _ := http.NewRequest(http.MethodGet, b.URL+path, nil)
	body, _ := io.ReadAll(do(t, req).Body)
	return string(body)
}

func runBroker(t testing.TB, root string, args ...string) string {
	t.Helper()
	cmd := exec.Command(brokerBin, args...)
	cmd.Env = brokerEnv(root, "", nil)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	_ = cmd.Run()
	return out.String() + errb.String()
}

func readAll(t testing.TB, path string) []byte {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestInitializeFloodEvictsOnlyTheFlooder: one principal opening sessions in
// a loop loses its own oldest sessions, never another principal's.
func TestInitializeFloodEvictsOnlyTheFlooder(t *testing.T) {
	tokens, tok := writeTokens(t, map[string]string{"alice": "pro", "mallory": "pro"})
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens}})
	initialize := func(token string) string {
		req, _ := http.NewRequest(http.MethodPost, b.URL+"/mcp", strings.NewReader(
			`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"f","version":"1"}}}`))
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp := do(t, req)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("initialize: %d", resp.StatusCode)
		}
		return resp.Header.Get("Mcp-Session-Id")
	}
	list := func(token, sid string) int {
		req, _ := http.NewRequest(http.MethodPost, b.URL+"/mcp", strings.NewReader(`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`))
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Mcp-Session-Id", sid)
		return do(t, req).StatusCode
	}
	alice := initialize(tok["alice"])
	first := initialize(tok["mallory"])
	for i := 0; i < 120; i++ {
		initialize(tok["mallory"])
	}
	if code := list(tok["alice"], alice); code != http.StatusOK {
		t.Fatalf("alice's session was evicted by mallory's flood: %d", code)
	}
	if code := list(tok["mallory"], first); code != http.StatusNotFound {
		t.Fatalf("mallory's oldest session should have been evicted: %d", code)
	}
}

// TestStdioClientCloseLeavesNoSandboxes: a stdio client closing, as
// mcp-go's does (stdin and stderr closed, then a wait), ends the broker
// cleanly and removes its containers. Before, the first log line of the
// shutdown went to the closed stderr and SIGPIPE killed the broker there.
func TestStdioClientCloseLeavesNoSandboxes(t *testing.T) {
	requireDocker(t)
	root := brokerRoot(t)
	c := StartStdio(t, root, map[string]string{"SANDBOX_POOL_SIZE": "1"})
	if r, _ := run(t, c, map[string]any{"language": "python", "code": "print(6 * 7)"}); strings.TrimSpace(r.Stdout) != "42" {
		t.Fatalf("run: %+v", r)
	}
	containers := func() []string {
		out, err := exec.Command("docker", "ps", "-aq", "--filter", "label=sandbox.root="+root).Output()
		if err != nil {
			t.Fatal(err)
		}
		return strings.Fields(string(out))
	}
	if len(containers()) == 0 {
		t.Fatal("no container under the broker's root before the close")
	}
	if err := c.Close(); err != nil {
		t.Fatalf("the broker did not exit cleanly: %v", err)
	}
	if left := containers(); len(left) != 0 {
		t.Fatalf("%d containers left after the client closed", len(left))
	}
}
