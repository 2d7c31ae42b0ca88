package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// requireChromium returns Debian's Chromium. CI installs it (.ci/run), so
// there its absence is a failure, not a skip.
func requireChromium(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("chromium is required in CI (.ci/run installs Debian's chromium package)")
		}
		t.Skip("chromium is not installed (apt-get install chromium)")
	}
	return p
}

// newBrowser starts headless Chromium with a fresh profile; it is closed
// when the test ends.
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	path := requireChromium(t)
	actx, cancel := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(path),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox, // root in CI
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
	)
	t.Cleanup(cancel)
	bctx, bcancel := chromedp.NewContext(actx)
	t.Cleanup(bcancel)
	if err := chromedp.Do(bctx); err != nil { // starts the browser, with no deadline
		t.Fatalf("start chromium: %v", err)
	}
	return bctx
}

// browserTab is one tab and what its page wrote to the console, including
// the browser's own log (CORS refusals land there).
type browserTab struct {
	ctx  context.Context
	mu   sync.Mutex
	msgs []string
}

func newTab(t *testing.T, browser context.Context, timeout time.Duration) *browserTab {
	t.Helper()
	tctx, cancel := chromedp.NewContext(browser)
	t.Cleanup(cancel)
	if err := chromedp.Do(tctx); err != nil { // opens the tab
		t.Fatalf("open tab: %v", err)
	}
	ctx, cancelTimeout := context.WithTimeout(tctx, timeout)
	t.Cleanup(cancelTimeout)
	tab := &browserTab{ctx: ctx}
	messages := chromedp.Console(ctx)
	go func() {
		for m, err := range messages {
			if err != nil {
				return
			}
			tab.mu.Lock()
			tab.msgs = append(tab.msgs, m.String())
			tab.mu.Unlock()
		}
	}()
	return tab
}

func (tab *browserTab) console() string {
	tab.mu.Lock()
	defer tab.mu.Unlock()
	return strings.Join(tab.msgs, "\n")
}

// isolation is what a preview page's own script can reach.
type isolation struct {
	Origin, Cookie, Health, MCP, Other string
}

// isolationProbe runs in a preview page: its origin; the cookies its
// script sees after trying to set one for all of localhost (which the
// broker and every other preview would receive); and whether it can read
// the broker's /healthz, call /mcp, or read another sandbox's preview
// (with that preview's own signed link).
const isolationProbe = `(async () => {
  const attempt = async (url, init) => {
    try { const r = await fetch(url, init); return 'read ' + r.status + ' ' + (await r.text()).slice(0, 40) }
    catch (e) { return 'blocked' }
  };
  document.cookie = 'tossed=1; Domain=localhost; Path=/';
  return JSON.stringify({
    origin: location.origin,
    cookie: document.cookie,
    health: await attempt(%[1]q + '/healthz', { credentials: 'include' }),
    mcp: await attempt(%[1]q + '/mcp', { method: 'POST', credentials: 'include',
      headers: { 'content-type': 'application/json', accept: 'application/json, text/event-stream' },
      body: JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'tools/list' }) }),
    other: await attempt(%[2]q, { credentials: 'include' }),
  });
})()`

// TestStarterPreviewsRenderInChromium builds every starter template on
// the local provider and opens its preview in headless Chromium: the page
// renders its <h1>, and its own JavaScript runs (the counter button
// counts). From inside a preview, the page's script cannot read the
// broker's origin or call /mcp, nor read another sandbox's preview, nor
// read its preview cookie or set a cookie for all of localhost (issue 10,
// item 1: React and Vue previews were blank, their crossorigin module
// script refused by CORS from the opaque origin the CSP sandbox gave the
// page).
func TestStarterPreviewsRenderInChromium(t *testing.T) {
	requireNodeRunner(t)
	browser := newBrowser(t)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0"}})
	c := b.Client(t, testToken)

	starters := []struct{ template, h1 string }{
		{"react", "Hello from React"}, {"vue", "Hello from Vue"}, {"next", "Hello from Next.js"}, {"node", "Hello from Node.js"},
	}
	links := map[string]string{}
	for _, s := range starters {
		var created projectCreated
		resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "starter-" + s.template, "template": s.template}), &created)
		if status, out := buildProject(t, c, created.SandboxID); status != "completed" {
			t.Fatalf("%s build: %s\n%s", s.template, status, out)
		}
		links[s.template] = created.PreviewURL
	}

	for _, s := range starters {
		t.Run(s.template, func(t *testing.T) {
			tab := newTab(t, browser, 90*time.Second)
			fail := func(what string, err error) {
				t.Helper()
				t.Fatalf("%s: %s: %v\nconsole:\n%s", s.template, what, err, tab.console())
			}
			if err := chromedp.Do(tab.ctx, chromedp.Navigate(links[s.template])); err != nil {
				fail("navigate", err)
			}
			if _, err := chromedp.Run(tab.ctx, chromedp.Poll[bool](fmt.Sprintf(
				`document.querySelector('h1')?.textContent === %q`, s.h1), chromedp.WithPollingTimeout(30*time.Second))); err != nil {
				fail("the page did not render its <h1> "+s.h1, err)
			}
			// The button counts only if the project's own script runs.
			if err := chromedp.Do(tab.ctx, chromedp.Click(chromedp.CSS("button"), chromedp.NodeVisible)); err != nil {
				fail("click", err)
			}
			if _, err := chromedp.Run(tab.ctx, chromedp.Poll[bool](
				`document.querySelector('button')?.textContent.replace(/\s+/g, ' ').trim() === 'count is 1'`,
				chromedp.WithPollingTimeout(30*time.Second))); err != nil {
				fail("the counter did not count: the page's JavaScript did not run", err)
			}
			if strings.Contains(tab.console(), "CORS") {
				t.Errorf("%s: CORS errors:\n%s", s.template, tab.console())
			}

			other := links["node"]
			if s.template == "node" {
				other = links["react"]
			}
			raw, err := chromedp.Run(tab.ctx, chromedp.Evaluate[string](fmt.Sprintf(isolationProbe, b.URL, other), chromedp.EvalAwaitPromise))
			if err != nil {
				fail("isolation probe", err)
			}
			var got isolation
			if err := json.Unmarshal([]byte(raw), &got); err != nil {
				t.Fatalf("probe result %q: %v", raw, err)
			}
			if got.Origin != previewOrigin(t, links[s.template]) || got.Origin == "null" || got.Cookie != "" ||
				got.Health != "blocked" || got.MCP != "blocked" || got.Other != "blocked" {
				t.Errorf("%s: from inside the preview: %+v", s.template, got)
			}
		})
	}
	// The servers refused those requests too; the browser's CORS check was
	// not the only thing in the way.
	for _, ev := range []string{`"message":"origin_rejected"`, `"message":"preview_origin_rejected"`} {
		if !strings.Contains(b.Logs(), ev) {
			t.Errorf("no %s in the broker's log", ev)
		}
	}
}
