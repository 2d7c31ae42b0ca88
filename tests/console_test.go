package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/audit"
)

// consoleClient is a browser-like HTTP client of the console: a cookie
// jar, the headers a browser sends on same-origin requests, and the page's
// CSRF token once logged in.
type consoleClient struct {
	t    *testing.T
	base string
	hc   *http.Client
	csrf string
}

func newConsoleClient(t *testing.T, base string) *consoleClient {
	jar, _ := cookiejar.New(nil)
	return &consoleClient{t: t, base: base, hc: &http.Client{Jar: jar, Timeout: 2 * time.Minute,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

var (
	nonceField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)
	csrfMeta   = regexp.MustCompile(`<meta name="csrf-token" content="([^"]+)">`)
)

// req sends a request; header pairs override the browser-like defaults.
func (c *consoleClient) req(method, path string, form url.Values, header ...string) (*http.Response, string) {
	c.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	r, err := http.NewRequest(method, c.base+path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	if form != nil {
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if method != http.MethodGet {
		r.Header.Set("Origin", c.base)
		r.Header.Set("Sec-Fetch-Site", "same-origin")
	}
	for i := 0; i+1 < len(header); i += 2 {
		if header[i+1] == "" {
			r.Header.Del(header[i])
		} else {
			r.Header.Set(header[i], header[i+1])
		}
	}
	resp, err := c.hc.Do(r)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// login logs in with token and keeps the page's CSRF token.
func (c *consoleClient) login(token string) *http.Response {
	c.t.Helper()
	_, page := c.req("GET", "/console/login", nil)
	m := nonceField.FindStringSubmatch(page)
	if m == nil {
		c.t.Fatalf("no login nonce in %s", page)
	}
	resp, _ := c.req("POST", "/console/login", url.Values{"csrf": {m[1]}, "token": {token}})
	if resp.StatusCode != http.StatusSeeOther {
		return resp
	}
	_, page = c.req("GET", "/console/playground", nil)
	if m := csrfMeta.FindStringSubmatch(page); m != nil {
		c.csrf = m[1]
	}
	return resp
}

// auditRows reads rows of the audit log matching f, as the CLI would.
func auditRows(t *testing.T, root string, f audit.Filter) []audit.Entry {
	t.Helper()
	var out []audit.Entry
	if err := audit.Each(context.Background(), root+"/audit.db", f, func(e audit.Entry) error { out = append(out, e); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestConsoleSessionsAndCSRF: the session cookie's attributes, the CSP,
// the login form's own CSRF defence, and that a missing, forged or
// cross-origin CSRF token changes nothing (the session it tried to close
// still exists, and no close_session call was made), while the real one
// works; an admin closes another principal's session and cancels its job
// from the operator view; logging out ends the session.
func TestConsoleSessionsAndCSRF(t *testing.T) {
	requireDocker(t)
	tokens, adminToken, userToken := consoleTokens(t)
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens, "SANDBOX_POOL_SIZE": "0"}})

	cc := newConsoleClient(t, b.URL)
	resp, page := cc.req("GET", "/", nil)
	csp := resp.Header.Get("Content-Security-Policy")
	for _, want := range []string{"default-src 'none'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'", "base-uri 'none'", "form-action 'self'"} {
		if !strings.Contains(csp, want) {
			t.Errorf("CSP %q lacks %q", csp, want)
		}
	}
	if strings.Contains(csp, "unsafe") || strings.Contains(page, "<script>") || strings.Contains(page, " style=") || strings.Contains(page, " onclick=") {
		t.Errorf("inline script or style: CSP %q", csp)
	}
	if resp.Header.Get("X-Frame-Options") != "DENY" {
		t.Error("no X-Frame-Options: DENY")
	}

	// The login form needs its nonce (cookie and field alike).
	resp, _ = cc.req("POST", "/console/login", url.Values{"token": {userToken}})
	if resp.StatusCode != http.StatusForbidden || len(resp.Cookies()) > 0 && resp.Cookies()[0].Name == "sbx_console" && resp.Cookies()[0].Value != "" {
		t.Fatalf("login without its nonce: %d %v", resp.StatusCode, resp.Cookies())
	}
	if resp := cc.login("not-a-token-at-all-0123456789"); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("bad token: %d", resp.StatusCode)
	}
	resp = cc.login(userToken)
	if resp.StatusCode != http.StatusSeeOther || cc.csrf == "" {
		t.Fatalf("login: %d, csrf %q", resp.StatusCode, cc.csrf)
	}
	var session *http.Cookie
	for _, ck := range resp.Cookies() {
		if ck.Name == "sbx_console" {
			session = ck
		}
	}
	if session == nil || !session.HttpOnly || session.SameSite != http.SameSiteStrictMode || session.Path != "/" || session.Secure {
		t.Fatalf("session cookie %+v", session)
	}
	if logins := auditRows(t, b.Root, audit.Filter{Tool: "console.login"}); len(logins) != 2 ||
		logins[0].Outcome != audit.OutcomeDenied || logins[1].Outcome != audit.OutcomeSuccess || logins[1].Principal != "alice" ||
		strings.Contains(string(logins[0].Params), "not-a-token") {
		t.Fatalf("login rows: %+v", logins)
	}

	// A session made over MCP, which the forged requests try to close.
	c := b.Client(t, userToken)
	var up struct {
		SessionID string `json:"session_id"`
	}
	resultJSON(t, callTool(t, c, "upload_file", map[string]any{"path": "keep.txt", "content": "still here"}), &up)
	closeForm := url.Values{"session_id": {up.SessionID}}
	for _, tc := range []struct {
		name, path string
		header     []string
	}{
		{"no token", "", nil},
		{"forged token", "", []string{"X-CSRF-Token", "forged-" + cc.csrf[:10]}},
		{"token in the query string", "?csrf=" + cc.csrf, nil},
		{"other site", "", []string{"X-CSRF-Token", cc.csrf, "Sec-Fetch-Site", "cross-site"}},
		{"other origin", "", []string{"X-CSRF-Token", cc.csrf, "Origin", "http://evil.example"}},
		{"origin null", "", []string{"X-CSRF-Token", cc.csrf, "Origin", "null", "Sec-Fetch-Site", ""}},
	} {
		resp, body := cc.req("POST", "/console/sessions/close"+tc.path, closeForm, tc.header...)
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s: status %d: %s", tc.name, resp.StatusCode, body)
		}
	}
	if rows := auditRows(t, b.Root, audit.Filter{Tool: "close_session"}); len(rows) != 0 {
		t.Fatalf("a refused request reached close_session: %+v", rows)
	}
	resultJSON(t, callTool(t, c, "list_artifacts", map[string]any{"session_id": up.SessionID}), &struct{}{})

	resp, body := cc.req("POST", "/console/sessions/close", closeForm, "X-CSRF-Token", cc.csrf, "HX-Request", "true")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("close with the page's token: %d %s", resp.StatusCode, body)
	}
	if res := callTool(t, c, "list_artifacts", map[string]any{"session_id": up.SessionID}); !res.IsError {
		t.Fatal("the session survived being closed")
	}
	rows := auditRows(t, b.Root, audit.Filter{Tool: "close_session", Principal: "alice", Outcome: "success"})
	if len(rows) != 1 {
		t.Fatalf("close_session rows: %+v", rows)
	}
	// The row says the call came through the console, from the browser.
	if src := rows[0].Source; src.Transport != "console" || src.ClientAddr == "" || src.UserAgent == "" {
		t.Fatalf("close_session row source %+v, want the console and the browser's address and user agent", src)
	}

	// An admin closes alice's other session and cancels her job from the
	// operator view; both are audited under the admin, naming alice.
	opsClient := newConsoleClient(t, b.URL)
	if resp := opsClient.login(adminToken); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("admin login: %d", resp.StatusCode)
	}
	var other, job struct {
		SessionID   string `json:"session_id"`
		ExecutionID string `json:"execution_id"`
	}
	resultJSON(t, callTool(t, c, "upload_file", map[string]any{"path": "x.txt", "content": "x"}), &other)
	resultJSON(t, callTool(t, c, "execute_code_async", map[string]any{"command": "sleep 60", "session_id": other.SessionID}), &job)
	if resp, body := opsClient.req("POST", "/console/operator/cancel-execution", url.Values{"principal": {"alice"}, "execution_id": {job.ExecutionID}, "force": {"on"}},
		"X-CSRF-Token", opsClient.csrf, "HX-Request", "true"); resp.StatusCode != http.StatusOK || !strings.Contains(body, "cancelled") {
		t.Fatalf("admin cancel: %d %s", resp.StatusCode, body)
	}
	if resp, body := opsClient.req("POST", "/console/operator/close-session", url.Values{"principal": {"alice"}, "session_id": {other.SessionID}},
		"X-CSRF-Token", opsClient.csrf, "HX-Request", "true"); resp.StatusCode != http.StatusOK {
		t.Fatalf("admin close: %d %s", resp.StatusCode, body)
	}
	if res := callTool(t, c, "list_artifacts", map[string]any{"session_id": other.SessionID}); !res.IsError {
		t.Fatal("the admin's close left the session")
	}
	for _, tool := range []string{"console.cancel_execution", "console.close_session"} {
		rows := auditRows(t, b.Root, audit.Filter{Tool: tool, Principal: "ops"})
		if len(rows) != 2 || !strings.Contains(string(rows[0].Params), `"principal":"alice"`) || rows[1].Outcome != audit.OutcomeSuccess {
			t.Errorf("%s rows: %+v", tool, rows)
		}
	}

	// Logging out needs the token too, then ends the session.
	if resp, _ := cc.req("POST", "/console/logout", url.Values{}); resp.StatusCode != http.StatusForbidden {
		t.Errorf("logout without a token: %d", resp.StatusCode)
	}
	if resp, _ := cc.req("POST", "/console/logout", url.Values{"csrf": {cc.csrf}}); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("logout: %d", resp.StatusCode)
	}
	if resp, _ := cc.req("GET", "/console/playground", nil); resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/console/login" {
		t.Fatalf("after logout: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
}

// TestConsoleAdminViewsRefusedAndAudited: a non-admin asking for the
// audit desk, its export and tail, the operator view, or to close another
// principal's session gets 403 (or a refusal on the stream) and leaves a
// denied audit row; the admin exports the same rows as NDJSON and tails
// new ones as they are committed.
func TestConsoleAdminViewsRefusedAndAudited(t *testing.T) {
	tokens, adminToken, userToken := consoleTokens(t)
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens, "SANDBOX_BACKEND": "none"}})
	alice := newConsoleClient(t, b.URL)
	if resp := alice.login(userToken); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("login: %d", resp.StatusCode)
	}
	for _, path := range []string{"/console/audit", "/console/audit/rows?principal=ops", "/console/audit/rows/1", "/console/audit/export", "/console/operator"} {
		if resp, body := alice.req("GET", path, nil); resp.StatusCode != http.StatusForbidden || !strings.Contains(body, "PERMISSION_DENIED") {
			t.Errorf("%s as a non-admin: %d", path, resp.StatusCode)
		}
	}
	for _, path := range []string{"/console/audit/verify", "/console/operator/close-session", "/console/operator/cancel-execution"} {
		form := url.Values{"principal": {"ops"}, "session_id": {"sess_000000000000"}, "execution_id": {"exec_0"}}
		if resp, _ := alice.req("POST", path, form, "X-CSRF-Token", alice.csrf); resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s as a non-admin: %d", path, resp.StatusCode)
		}
	}
	_, stream := alice.req("GET", "/console/audit/tail", nil)
	if !strings.Contains(stream, "event: tail_error") || !strings.Contains(stream, "PERMISSION_DENIED") {
		t.Errorf("tail as a non-admin: %q", stream)
	}
	denied := auditRows(t, b.Root, audit.Filter{Principal: "alice", Outcome: "denied", ErrorCode: "PERMISSION_DENIED"})
	seen := map[string]int{}
	for _, e := range denied {
		seen[e.Tool]++
	}
	for tool, n := range map[string]int{"console.audit_state": 1, "console.audit_query": 1, "console.audit_record": 1, "console.audit_export": 1,
		"console.audit_tail": 1, "console.audit_verify": 1, "console.operator_overview": 1, "console.close_session": 1, "console.cancel_execution": 1} {
		if seen[tool] != n {
			t.Errorf("%d denied %s rows, want %d (all: %v)", seen[tool], tool, n, seen)
		}
	}

	admin := newConsoleClient(t, b.URL)
	if resp := admin.login(adminToken); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("admin login: %d", resp.StatusCode)
	}
	resp, export := admin.req("GET", "/console/audit/export?principal=alice&outcome=denied", nil)
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/x-ndjson" ||
		!strings.HasPrefix(resp.Header.Get("Content-Disposition"), "attachment") {
		t.Fatalf("export: %d %v", resp.StatusCode, resp.Header)
	}
	lines := strings.Split(strings.TrimSpace(export), "\n")
	if len(lines) != len(denied) {
		t.Fatalf("export has %d rows, the log %d", len(lines), len(denied))
	}
	for i, l := range lines {
		var e audit.Entry
		if err := json.Unmarshal([]byte(l), &e); err != nil || e.Principal != "alice" || e.Outcome != audit.OutcomeDenied || e.Seq != denied[i].Seq {
			t.Fatalf("export line %d: %s (%v)", i, l, err)
		}
	}

	// The live tail: rows committed after it started arrive as events.
	last := auditRows(t, b.Root, audit.Filter{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", b.URL+"/console/audit/tail?principal=alice&tool=get_usage&after_seq="+
		itoa(last[len(last)-1].Seq), nil)
	tail, err := admin.hc.Do(req)
	if err != nil || tail.StatusCode != http.StatusOK || tail.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("tail: %v %v", err, tail)
	}
	defer tail.Body.Close()
	callTool(t, b.Client(t, userToken), "get_usage", nil)
	rows := 0
	sc := bufio.NewScanner(tail.Body)
	for rows < 2 && sc.Scan() { // the call's intent and outcome rows
		if sc.Text() == "event: row" {
			rows++
		}
	}
	if rows != 2 {
		t.Fatalf("tail delivered %d rows: %v", rows, sc.Err())
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// TestAuditExportFollow: `audit export --follow --since N` prints the rows
// after N, then each row as it is committed; a second export from the last
// seq it printed continues without a gap or a repeat.
func TestAuditExportFollow(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none"}})
	c := b.Client(t, testToken)
	callTool(t, c, "get_usage", nil)
	rows := auditRows(t, b.Root, audit.Filter{})
	since := rows[0].Seq // resume after the first row

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, brokerBin, "audit", "export", "--format", "jsonl", "--follow", "--since", itoa(since))
	cmd.Env = brokerEnv(b.Root, "", nil)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := make(chan audit.Entry, 100)
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			var e audit.Entry
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				lines <- e
			}
		}
		close(lines)
	}()
	next := func() audit.Entry {
		select {
		case e, ok := <-lines:
			if !ok {
				t.Fatal("export ended")
			}
			return e
		case <-time.After(30 * time.Second):
			t.Fatal("no row within 30 s")
		}
		return audit.Entry{}
	}
	want := since + 1
	for ; want <= rows[len(rows)-1].Seq; want++ { // rows already there
		if e := next(); e.Seq != want {
			t.Fatalf("got seq %d, want %d", e.Seq, want)
		}
	}
	callTool(t, c, "get_usage", nil) // committed while it follows
	for range 2 {
		if e := next(); e.Seq != want || e.Tool != "get_usage" {
			t.Fatalf("followed row %+v, want seq %d", e, want)
		} else {
			want++
		}
	}
	cancel()
	_ = cmd.Wait()

	// Resuming from the last seq printed repeats nothing.
	callTool(t, c, "get_usage", nil)
	resumed, err := exec.Command(brokerBin, "audit", "export", "--since", itoa(want-1), "--root", b.Root).Output()
	if err != nil {
		t.Fatal(err)
	}
	var first audit.Entry
	if err := json.Unmarshal([]byte(strings.SplitN(string(resumed), "\n", 2)[0]), &first); err != nil || first.Seq != want {
		t.Fatalf("resumed export starts at %+v, want seq %d", first, want)
	}
}
