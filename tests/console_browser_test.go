package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// screenshotDir is where browser tests leave their screenshots; CI keeps
// the folder as an artifact (.github/workflows/ci.yml).
func screenshotDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("SCREENSHOT_DIR")
	if dir == "" {
		dir = "screenshots"
	}
	dir = filepath.Join(dir, t.Name())
	if err := os.RemoveAll(dir); err != nil { // this run's shots only
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// consoleTokens writes an MCP_TOKENS_FILE with an admin and a person.
func consoleTokens(t *testing.T) (path, admin, user string) {
	t.Helper()
	admin, user = "tok-ops-"+strings.Repeat("a", 24), "tok-alice-"+strings.Repeat("b", 24)
	entries := []identity.TokenEntry{
		{Principal: "ops", Tier: "pro", TokenSHA256: identity.HashToken(admin), Admin: true},
		{Principal: "alice", Tier: "pro", TokenSHA256: identity.HashToken(user)},
	}
	raw, _ := json.Marshal(entries)
	path = filepath.Join(t.TempDir(), "tokens.json")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, admin, user
}

// consoleTab drives one tab of the console and fails the test with the
// page's console output (and a screenshot) when a step fails.
type consoleTab struct {
	*browserTab
	t     *testing.T
	shots string
	n     int
}

func (c *consoleTab) fail(what string, err error) {
	c.t.Helper()
	c.shot("failed")
	c.t.Fatalf("%s: %v\nbrowser console:\n%s", what, err, c.console())
}

// stepTimeout bounds one step, so a stuck page fails fast.
const stepTimeout = 90 * time.Second

func (c *consoleTab) do(what string, actions ...chromedp.Action[chromedp.Void]) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(c.ctx, stepTimeout)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		c.fail(what, err)
	}
}

// get runs one action that returns a value.
func tabGet[T any](c *consoleTab, what string, a chromedp.Action[T]) T {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(c.ctx, stepTimeout)
	defer cancel()
	v, err := chromedp.Run(ctx, a)
	if err != nil {
		c.fail(what, err)
	}
	return v
}

// eval evaluates a JavaScript expression (awaiting a promise).
func eval[T any](c *consoleTab, expr string) T {
	c.t.Helper()
	return tabGet(c, "evaluate "+expr, chromedp.Evaluate[T](expr, chromedp.EvalAwaitPromise))
}

// waitJS polls a JavaScript expression until it is true.
func (c *consoleTab) waitJS(what, expr string, timeout time.Duration) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(c.ctx, timeout+10*time.Second)
	defer cancel()
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](expr, chromedp.WithPollingTimeout(timeout), chromedp.WithPollingInterval(50*time.Millisecond))); err != nil {
		c.fail(what, err)
	}
}

func (c *consoleTab) text(sel string) string {
	c.t.Helper()
	return tabGet(c, "text of "+sel, chromedp.Text(chromedp.CSS(sel)))
}

func (c *consoleTab) shot(name string) {
	c.t.Helper()
	c.n++
	ctx, cancel := context.WithTimeout(c.ctx, 20*time.Second)
	defer cancel()
	buf, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		c.t.Logf("screenshot %s: %v", name, err)
		return
	}
	if err := os.WriteFile(filepath.Join(c.shots, fmt.Sprintf("%02d-%s.png", c.n, name)), buf, 0o644); err != nil {
		c.t.Logf("screenshot %s: %v", name, err)
	}
}

func (c *consoleTab) login(url, token string) {
	c.t.Helper()
	c.do("log in",
		chromedp.Navigate(url+"/console/login"),
		chromedp.SendKeys(chromedp.CSS("#token"), token),
		chromedp.Click(chromedp.CSS("#login-submit")),
		chromedp.WaitVisible(chromedp.CSS("#run-form")))
}

func newConsoleTab(t *testing.T, browser context.Context) *consoleTab {
	tab := &consoleTab{browserTab: newTab(t, browser, 5*time.Minute), t: t, shots: screenshotDir(t)}
	tab.do("viewport", chromedp.EmulateViewport(1280, 900))
	tab.watchDialogs()
	return tab
}

// watchDialogs fails the test when the page opens a dialog: script ran
// where only text should be.
func (c *consoleTab) watchDialogs() {
	opening := chromedp.Events(c.ctx, page.JavascriptDialogOpening)
	go func() {
		for e, err := range opening {
			if err != nil {
				return
			}
			c.t.Errorf("a dialog opened: %q", e.Message)
			go func() {
				_ = chromedp.Do(c.ctx, chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
					_, err := cdp.Call(ctx, t, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{})
					return err
				}))
			}()
		}
	}()
}

// hostileDir is an attacker-chosen string that lands in audit rows as is
// (execute_code records working_directory in clear): markup, an ANSI
// escape, an RTL override and length.
var hostileDir = "<img src=x onerror=alert(1)>\x1b[31m\u202Egnp.exe" + strings.Repeat("A", 900)

// TestConsoleInChromium drives the web console in headless Chromium as a
// person and as an admin: the connect page; log in; run Python that
// draws a chart and see the image; start a job and see its lines arrive
// while it runs; upload a file by drag and drop and download it; be
// refused the audit desk as a non-admin; as the admin, filter the audit
// log to that run, open its record, verify the chain, see hostile strings
// rendered inert, tail the log live, and see the person's session and her
// sandbox's refused egress in the operator view.
// Screenshots of each step go to SCREENSHOT_DIR (CI keeps them).
func TestConsoleInChromium(t *testing.T) {
	requireDocker(t)
	browser := newBrowser(t)
	tokens, adminToken, userToken := consoleTokens(t)
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens}})
	tab := newConsoleTab(t, browser)

	// The connect page: status, the MCP URL, the guides, no token.
	tab.do("connect page", chromedp.Navigate(b.URL+"/"))
	mcpURL := tab.text("#mcp-url")
	html := tabGet(tab, "page source", chromedp.OuterHTML(chromedp.CSS("html")))
	if mcpURL != b.URL+"/mcp" {
		t.Errorf("connect page shows MCP URL %q, want %q", mcpURL, b.URL+"/mcp")
	}
	if !strings.Contains(html, "claude mcp add --transport http sandbox "+b.URL+"/mcp") {
		t.Error("the Claude Code guide does not carry this broker's URL")
	}
	if strings.Contains(html, adminToken) || strings.Contains(html, userToken) {
		t.Error("the connect page shows a token")
	}
	tab.shot("connect")

	// Log in as alice and run Python that draws a chart.
	tab.login(b.URL, userToken)
	tab.shot("playground")
	tab.do("run python", chromedp.SetValue(chromedp.CSS("#language"), "python"), chromedp.Click(chromedp.CSS("#run")))
	tab.waitJS("the chart renders inline",
		`(() => { const i = document.querySelector('#run-output img.inline-image'); return !!i && i.complete && i.naturalWidth > 100 })()`, 2*time.Minute)
	stdout := tab.text("#run-stdout")
	session := eval[string](tab, `document.querySelector('#run-outcome').dataset.newSession`)
	if !strings.Contains(stdout, "saved chart.png") || !strings.HasPrefix(session, "sess_") {
		t.Fatalf("run output %q, session %q", stdout, session)
	}
	if files := tab.text("#run-output table.files"); !strings.Contains(files, "chart.png") {
		t.Errorf("the run's files do not list chart.png: %q", files)
	}
	tab.shot("chart")

	// A job's lines arrive while it runs: line 1 shows before line 5 is
	// printed (4 s later), then the exit.
	tab.do("start job", chromedp.Click(chromedp.CSS("#job-start")))
	tab.waitJS("the job's first line arrives", `(document.querySelector('#jobs-live .job pre.output')?.textContent || '').includes('line 1')`, time.Minute)
	early := eval[[]string](tab, `[document.querySelector('#jobs-live .job pre.output').textContent, document.querySelector('#jobs-live .job .status').textContent]`)
	if strings.Contains(early[0], "line 5") || strings.Contains(early[1], "completed") {
		t.Fatalf("the first line arrived only with the last: %q", early)
	}
	tab.shot("job-running")
	tab.waitJS("the job completes", `(document.querySelector('#jobs-live .job .status')?.textContent || '').includes('completed')`, time.Minute)
	done := tab.text("#jobs-live .job pre.output")
	for i := 1; i <= 5; i++ {
		if !strings.Contains(done, fmt.Sprintf("line %d", i)) {
			t.Errorf("job output lacks line %d: %q", i, done)
		}
	}
	tab.shot("job-done")

	// Upload by dropping a file on the drop zone, then download it.
	eval[bool](tab, `(() => {
		const dt = new DataTransfer();
		dt.items.add(new File(["dropped through the console\n"], "dropped.txt", {type: "text/plain"}));
		document.querySelector('#upload-form').dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
		return true })()`)
	tab.waitJS("the dropped file is listed", `(document.querySelector('#files')?.textContent || '').includes('dropped.txt')`, time.Minute)
	body := eval[string](tab, `(async () => {
		const a = [...document.querySelectorAll('#files a')].find(a => a.closest('tr').textContent.includes('dropped.txt'));
		return await (await fetch(a.href)).text() })()`)
	if body != "dropped through the console\n" {
		t.Errorf("downloaded %q", body)
	}
	tab.shot("uploaded")

	// Hostile strings reach the audit log through alice's own MCP client,
	// and a request her sandbox may not make reaches the egress proxy.
	c := b.Client(t, userToken)
	var req mcp.CallToolRequest
	req.Params.Name = "execute_code"
	req.Params.Arguments = map[string]any{"command": "true", "session_id": session, "working_directory": hostileDir}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.CallTool(ctx, req); err != nil {
		t.Fatal(err)
	}
	callTool(t, c, "execute_code", map[string]any{"session_id": session, "command": `python3 -c 'import urllib.request
try: urllib.request.urlopen("http://blocked.example.net/", timeout=10)
except Exception as e: print(e)'`, "sandbox_config": map[string]any{"network": map[string]any{"allowed_domains": []string{"*.example.org"}}}})

	// A non-admin is refused the audit desk and the operator view.
	tab.do("audit desk as a non-admin", chromedp.Navigate(b.URL+"/console/audit"))
	if status, msg := tab.text("h1"), tab.text("#error-message"); status != "403" || !strings.Contains(msg, "admins") {
		t.Errorf("non-admin audit desk: %q %q", status, msg)
	}
	tab.shot("audit-refused")
	tab.do("operator view as a non-admin", chromedp.Navigate(b.URL+"/console/operator"))
	if status := tab.text("h1"); status != "403" {
		t.Errorf("non-admin operator view: %q", status)
	}

	// The admin: filter to alice's run, open its record, verify the chain.
	tab.do("log out", chromedp.Navigate(b.URL+"/console/playground"), chromedp.Click(chromedp.CSS("#logout")), chromedp.WaitVisible(chromedp.CSS("#mcp-url")))
	tab.login(b.URL, adminToken)
	tab.do("audit desk", chromedp.Navigate(b.URL+"/console/audit"),
		chromedp.SendKeys(chromedp.CSS(`#audit-filter input[name=principal]`), "alice"),
		chromedp.SendKeys(chromedp.CSS(`#audit-filter input[name=tool]`), "run_code"),
		chromedp.Click(chromedp.CSS("#audit-apply")))
	tab.waitJS("the filter shows alice's run", `(() => { const rows = [...document.querySelectorAll('#audit-body tr')];
		return rows.length === 2 && rows.every(r => r.textContent.includes('alice') && r.textContent.includes('run_code')) })()`, 30*time.Second)
	tab.do("open the outcome row", chromedp.Click(chromedp.CSS(`#audit-body tr:first-child a`)))
	tab.waitJS("the record shows its hashes", `(document.querySelector('#record')?.textContent || '').includes('Leaf hash')`, 30*time.Second)
	if record := tab.text("#record"); !strings.Contains(record, "run_code") || !strings.Contains(record, "success") || !strings.Contains(record, "MAC") {
		t.Errorf("record: %q", record)
	}
	tab.do("open the intent row", chromedp.Click(chromedp.CSS(`#audit-body tr:last-child a`)))
	tab.waitJS("the intent's arguments summary", `(document.querySelector('#record-params')?.textContent || '').includes('"language": "python"')`, 30*time.Second)
	tab.shot("audit-filtered")
	tab.do("verify now", chromedp.Click(chromedp.CSS("#verify-now")))
	tab.waitJS("the chain verifies", `!!document.querySelector('#verify-ok')`, time.Minute)
	tab.shot("audit-verified")

	// The refusals above are rows too.
	tab.do("denied rows", chromedp.Navigate(b.URL+"/console/audit?principal=alice&outcome=denied"), chromedp.WaitVisible(chromedp.CSS("#audit-body")))
	if denied := tab.text("#audit-body"); !strings.Contains(denied, "console.audit_state") || !strings.Contains(denied, "console.operator_overview") {
		t.Errorf("no denied rows for alice's refused requests: %q", denied)
	}

	// Hostile strings render as text: no element, no dialog, the override
	// shown as a mark (the ANSI escape is JSON-escaped in the row).
	tab.do("hostile rows", chromedp.Navigate(b.URL+"/console/audit?principal=alice&tool=execute_code"),
		chromedp.Click(chromedp.CSS(`#audit-body tr:last-child a`)))
	tab.waitJS("the hostile record opens", `(document.querySelector('#record-params')?.textContent || '').includes('working_directory')`, 30*time.Second)
	injected := eval[int](tab, `document.querySelectorAll('img[src="x"], #audit-body img, #record img').length`)
	params := tab.text("#record-params")
	if injected != 0 || !strings.Contains(params, "<img src=x onerror=alert(1)>") ||
		!strings.Contains(params, "⟨U+202E⟩") || !strings.Contains(params, `\u001b[31m`) || strings.ContainsAny(params, "\u202E\x1b") {
		t.Errorf("hostile strings were not rendered inert: %d elements, params %q", injected, params)
	}
	tab.shot("audit-hostile")

	// The live tail shows a row committed after it started.
	tab.do("tail", chromedp.Navigate(b.URL+"/console/audit?principal=alice&tool=get_usage"), chromedp.Click(chromedp.CSS("#tail-start")))
	tab.waitJS("the tail is connected", `document.querySelector('#tail-table')?.getAttribute('sse-connect') !== null`, 10*time.Second)
	callTool(t, c, "get_usage", nil)
	tab.waitJS("the new row arrives in the tail", `(document.querySelector('#tail-body')?.textContent || '').includes('get_usage')`, 30*time.Second)
	tab.shot("audit-tail")

	// The operator view lists alice's session with its container, and the
	// egress proxy's refusal.
	tab.do("operator view", chromedp.Navigate(b.URL+"/console/operator"))
	if sessions := tab.text("#op-sessions"); !strings.Contains(sessions, session) || !strings.Contains(sessions, "alice") || !strings.Contains(sessions, "container") {
		t.Errorf("operator view sessions: %q", sessions)
	}
	if decisions := tab.text("#op-decisions"); !strings.Contains(decisions, "egress") || !strings.Contains(decisions, "blocked.example.net:80") ||
		!strings.Contains(decisions, "not_in_allowed_domains") {
		t.Errorf("operator view decisions: %q", decisions)
	}
	tab.shot("operator")
}

// TestConsoleOAuthLoginInChromium signs in through the broker's own
// authorization server: the console's client, the consent page (approved
// with the admin's token), the callback; the admin claim carries through,
// so the audit desk opens, and the login is an audit row.
func TestConsoleOAuthLoginInChromium(t *testing.T) {
	browser := newBrowser(t)
	tokens, adminToken, _ := consoleTokens(t)
	addr := freeAddr(t)
	b := StartHTTP(t, BrokerOpts{Args: []string{"--addr", addr}, Env: map[string]string{
		"MCP_TOKENS_FILE": tokens, "PUBLIC_BASE_URL": "http://" + addr, "OAUTH_MODE": "embedded", "SANDBOX_BACKEND": "none"}})
	tab := newConsoleTab(t, browser)
	tab.do("start the OAuth sign-in", chromedp.Navigate(b.URL+"/console/login"), chromedp.Click(chromedp.CSS("#oauth-login")),
		chromedp.WaitVisible(chromedp.CSS(`button[value=approve]`)))
	if page := tabGet(tab, "consent page", chromedp.OuterHTML(chromedp.CSS("body"))); !strings.Contains(page, "sandbox-broker web console") {
		t.Errorf("the consent page does not name the console: %s", page)
	}
	tab.shot("consent")
	tab.do("approve", chromedp.SendKeys(chromedp.CSS("#token"), adminToken), chromedp.Click(chromedp.CSS(`button[value=approve]`)),
		chromedp.WaitVisible(chromedp.CSS("#run-form")))
	if who := tab.text("#who"); !strings.Contains(who, "ops") || !strings.Contains(who, "admin") {
		t.Errorf("signed in as %q", who)
	}
	tab.do("audit desk", chromedp.Navigate(b.URL+"/console/audit?tool=console.login"), chromedp.WaitVisible(chromedp.CSS("#audit-body")))
	if rows := tab.text("#audit-body"); !strings.Contains(rows, "console.login") || !strings.Contains(rows, "oauth") {
		t.Errorf("login rows: %q", rows)
	}
	tab.shot("oauth-admin")
}

// TestConsoleProjectPreviewInChromium: create a project from a template in
// the playground, build it with its log streaming in, and see its preview
// in the sandboxed frame: the page renders and its own script runs there,
// on the preview's origin, not the console's.
func TestConsoleProjectPreviewInChromium(t *testing.T) {
	requireNodeRunner(t)
	browser := newBrowser(t)
	tokens, _, userToken := consoleTokens(t)
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens, "SANDBOX_POOL_SIZE": "0"}})
	tab := newConsoleTab(t, browser)
	tab.login(b.URL, userToken)
	tab.do("create a react project", chromedp.SetValue(chromedp.CSS(`#project-form select[name=template]`), "react"),
		chromedp.Click(chromedp.CSS(`#project-form button[type=submit]`)), chromedp.WaitVisible(chromedp.CSS("#project-out .project")))
	tab.do("build it", chromedp.Click(chromedp.CSS(`#project-out .project form button`)))
	tab.waitJS("the build completes", `(document.querySelector('#project-out .build')?.textContent || '').includes('Build completed')`, 3*time.Minute)
	tab.shot("project-built")
	src := eval[string](tab, `(() => { const f = document.querySelector('iframe.preview'); f.src = f.src; return f.src })()`)
	origin := previewOrigin(t, src)
	if strings.HasPrefix(origin, b.URL) {
		t.Fatalf("the preview frame is on the console's origin: %s", src)
	}
	// The frame has another origin, so Chromium runs it as a target of its
	// own; the test attaches to it as the console never could.
	var frame context.Context
	deadline := time.Now().Add(time.Minute)
	for frame == nil {
		infos, err := chromedp.Targets(tab.ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, info := range infos {
			if info.Type == "iframe" && strings.HasPrefix(info.URL, origin) {
				fctx, cancel := chromedp.NewContext(tab.ctx, chromedp.WithTargetID(info.TargetID))
				t.Cleanup(cancel)
				frame = fctx
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no frame target for %s", origin)
		}
		if frame == nil {
			time.Sleep(100 * time.Millisecond) // the frame has no event of its own to wait on before it exists
		}
	}
	fctx, cancel := context.WithTimeout(frame, stepTimeout)
	defer cancel()
	if _, err := chromedp.Run(fctx, chromedp.Poll[bool](`document.querySelector('h1')?.textContent === 'Hello from React'`,
		chromedp.WithPollingTimeout(time.Minute))); err != nil {
		t.Fatalf("the preview did not render in the frame: %v\n%s\n%s", err, tab.console(), grepLines(b.Logs(), "preview"))
	}
	if err := chromedp.Do(fctx, chromedp.Click(chromedp.CSS("button"))); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(fctx, chromedp.Poll[bool](`document.querySelector('button')?.textContent.replace(/\s+/g, ' ').trim() === 'count is 1'`,
		chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		t.Fatalf("the preview's script did not run in the frame: %v", err)
	}
	tab.shot("project-preview")
}
