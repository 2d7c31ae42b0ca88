package tests

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// requireNodeRunner is requireDocker plus the Node runner the local
// project fallback builds in.
func requireNodeRunner(t *testing.T) {
	t.Helper()
	requireDocker(t)
	if err := exec.Command("docker", "image", "inspect", "sandbox-broker/runner-node:latest").Run(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("runner image for node is missing (required in CI: runners/build.sh builds it)")
		}
		t.Skip("runner-node image missing; run `make runners`")
	}
}

// previewClient fetches preview links like a browser: every name under
// localhost (the default preview origins, {sandbox_id}.localhost) goes to
// loopback, which Go's resolver does not do by itself.
func previewClient(jar http.CookieJar) *http.Client {
	d := &net.Dialer{Timeout: 10 * time.Second}
	return &http.Client{Jar: jar, Timeout: 60 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if host, port, err := net.SplitHostPort(addr); err == nil && strings.HasSuffix(host, ".localhost") {
				addr = net.JoinHostPort("127.0.0.1", port)
			}
			return d.DialContext(ctx, network, addr)
		},
	}}
}

// previewOrigin is scheme://host:port of a preview link.
func previewOrigin(t *testing.T, link string) string {
	t.Helper()
	u, err := url.Parse(link)
	if err != nil || u.Host == "" {
		t.Fatalf("preview link %q: %v", link, err)
	}
	return u.Scheme + "://" + u.Host
}

func fetch(t *testing.T, hc *http.Client, u string) (int, string, http.Header) {
	t.Helper()
	resp, err := hc.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	return resp.StatusCode, string(b), resp.Header
}

func TestLocalReactProjectBuildsAndPreviews(t *testing.T) {
	requireNodeRunner(t)
	tokens, tok := writeTokens(t, map[string]string{"alice": "pro", "bob": "pro"})
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"SANDBOX_POOL_SIZE": "0", "MCP_TOKENS_FILE": tokens}})
	c := b.Client(t, tok["alice"])
	const marker = "Hello-from-the-model-42"
	app := "export default function App() { return <h1>" + marker + "</h1>; }\n"
	var created projectCreated
	res := callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "demo", "template": "react",
		"initial_files": map[string]string{"src/App.jsx": app}})
	if res.IsError {
		t.Fatalf("create: %+v", res.Content)
	}
	resultJSON(t, res, &created)
	// The preview has an origin of its own: the sandbox's name under
	// localhost, on the preview listener, not the broker's.
	origin := previewOrigin(t, created.PreviewURL)
	if created.Provider != "local" || !strings.HasPrefix(origin, "http://"+created.SandboxID+".localhost:") || origin == b.URL ||
		!strings.HasPrefix(created.PreviewURL, origin+"/preview/"+created.SandboxID+"/?") {
		t.Fatalf("created %+v", created)
	}

	// Before a build the preview says what to do.
	jar, _ := cookiejar.New(nil)
	hc := previewClient(jar)
	if code, _, _ := fetch(t, hc, created.PreviewURL); code == http.StatusOK {
		t.Fatal("preview served before any build")
	}

	var out projectOutput
	resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "build_output"}), &out)
	if !out.Success || !strings.Contains(strings.ToLower(out.Output), "vite") {
		t.Fatalf("build: %+v", out)
	}

	code, page, hdr := fetch(t, hc, created.PreviewURL)
	if code != http.StatusOK || !strings.Contains(page, "<div id=\"root\">") {
		t.Fatalf("preview %d: %s", code, page)
	}
	if hdr.Get("Content-Security-Policy") == "" {
		t.Error("preview has no CSP")
	}
	m := regexp.MustCompile(`src="\.?/?(assets/[^"]+\.js)"`).FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no script in page: %s", page)
	}
	// The asset is fetched with the cookie the signed link set.
	code, js, _ := fetch(t, hc, origin+"/preview/"+created.SandboxID+"/"+m[1])
	if code != http.StatusOK || !strings.Contains(js, marker) {
		t.Fatalf("asset %d, marker present: %v", code, strings.Contains(js, marker))
	}
	// Without the link or cookie, or with a tampered one: 403.
	if code, _, _ := fetch(t, previewClient(nil), origin+"/preview/"+created.SandboxID+"/"); code != http.StatusForbidden {
		t.Fatalf("no proof: %d", code)
	}
	tampered := strings.Replace(created.PreviewURL, "sig=", "sig=A", 1)
	if code, _, _ := fetch(t, previewClient(nil), tampered); code != http.StatusForbidden {
		t.Fatalf("tampered: %d", code)
	}
	// The broker's own listener serves no previews any more.
	if code, _, _ := fetch(t, &http.Client{Timeout: 10 * time.Second}, b.URL+"/preview/"+created.SandboxID+"/?"+strings.SplitN(created.PreviewURL, "?", 2)[1]); code != http.StatusNotFound {
		t.Fatalf("preview on the MCP listener: %d", code)
	}

	// A second principal cannot see or use the sandbox.
	other := b.Client(t, tok["bob"])
	mustToolError(t, callTool(t, other, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "preview_url"}), "SANDBOX_NOT_FOUND")
}

func TestLocalProjectBuildOutputIsRedacted(t *testing.T) {
	requireNodeRunner(t)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0"}})
	c := b.Client(t, testToken)
	secret := "ghp_" + strings.Repeat("Q1w2", 9)
	var created projectCreated
	resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "leaky", "template": "node",
		"initial_files": map[string]string{"package.json": `{"name":"leaky","scripts":{"build":"echo token=` + secret + ` && echo done","start":"node server.js"}}`}}), &created)
	var out projectOutput
	resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "build_output"}), &out)
	if !out.Success || !strings.Contains(out.Output, "done") || strings.Contains(out.Output, "Q1w2Q1w2") {
		t.Fatalf("build output not redacted: %+v", out)
	}
}

func TestLocalNodeProjectPreviewThroughSocket(t *testing.T) {
	requireNodeRunner(t)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0"}})
	c := b.Client(t, testToken)
	// While it answers its first request the app swaps its socket for a
	// symlink to the host's Docker socket: the broker must not follow it.
	// The swap comes before the answer, so once the test has the answer the
	// next dial meets the symlink. (Swapping after res.end() was a race:
	// the answer is in the kernel when res.end() returns, and if node was
	// descheduled before the swap, the next request reached the live
	// socket and got "answer 2". The busy loop after the answer keeps that
	// window open, so a regression to that order fails every time.)
	server := `const http = require('node:http'), fs = require('node:fs')
const sock = process.env.PREVIEW_SOCKET
let n = 0
const srv = http.createServer((req, res) => {
  n++
  console.log('request ' + n + ' ' + req.url)
  if (n === 1) { fs.unlinkSync(sock); fs.symlinkSync('/var/run/docker.sock', sock) }
  res.setHeader('Set-Cookie', 'sbx_preview=evil; Path=/')
  res.setHeader('Clear-Site-Data', '"cookies"')
  res.end('<h1>node app answer ' + n + '</h1>')
  if (n === 1) { const until = Date.now() + 300; while (Date.now() < until) {} }
})
try { fs.unlinkSync(sock) } catch {}
srv.listen(sock, () => console.log('listening'))
`
	var created projectCreated
	resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "api", "template": "node",
		"initial_files": map[string]string{"server.js": server}}), &created)
	jar, _ := cookiejar.New(nil)
	hc := previewClient(jar)
	code, page, hdr := fetch(t, hc, created.PreviewURL)
	if code != http.StatusOK || !strings.Contains(page, "node app answer 1") {
		t.Fatalf("preview %d: %s", code, page)
	}
	if hdr.Get("Content-Security-Policy") == "" {
		t.Error("preview has no CSP")
	}
	// The app's cookies and Clear-Site-Data never reach the broker's origin
	// (the broker's own preview cookie is the only one).
	for _, c := range hdr.Values("Set-Cookie") {
		if strings.Contains(c, "evil") {
			t.Errorf("app cookie passed through: %s", c)
		}
	}
	if hdr.Get("Clear-Site-Data") != "" {
		t.Error("Clear-Site-Data passed through")
	}
	code, page, _ = fetch(t, hc, previewOrigin(t, created.PreviewURL)+"/preview/"+created.SandboxID+"/version")
	if code != http.StatusBadGateway || strings.Contains(page, "ApiVersion") {
		t.Fatalf("after the symlink swap: %d %s", code, page)
	}
	// The app's own log line can reach the broker after its answer did
	// (node writes to a pipe asynchronously): wait for it, bounded.
	var out projectOutput
	for deadline := time.Now().Add(15 * time.Second); ; {
		resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "console_log"}), &out)
		if strings.Contains(out.Output, "request 1 /") || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !strings.Contains(out.Output, "request 1 /") || strings.Contains(out.Output, "request 2") {
		t.Fatalf("console_log: %q", out.Output)
	}
}

func TestLocalStaticPreviewRefusesSymlinks(t *testing.T) {
	requireNodeRunner(t)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0"}})
	c := b.Client(t, testToken)
	// The build plants links to host files in its output.
	build := `mkdir -p dist/sub && echo '<p>static ok</p>' > dist/index.html && ln -s /etc/passwd dist/leak.txt && ln -s /etc dist/sub/etc`
	var created projectCreated
	resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "links", "template": "vue",
		"initial_files": map[string]string{"package.json": `{"name":"links","scripts":{"build":"` + build + `"}}`}}), &created)
	var out projectOutput
	resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "build_output"}), &out)
	if !out.Success {
		t.Fatalf("build: %+v", out)
	}
	jar, _ := cookiejar.New(nil)
	hc := previewClient(jar)
	if code, page, _ := fetch(t, hc, created.PreviewURL); code != http.StatusOK || !strings.Contains(page, "static ok") {
		t.Fatalf("preview %d: %s", code, page)
	}
	for _, p := range []string{"leak.txt", "sub/etc/passwd", "../meta", "%2e%2e/%2e%2e/meta"} {
		code, page, _ := fetch(t, hc, previewOrigin(t, created.PreviewURL)+"/preview/"+created.SandboxID+"/"+p)
		if code == http.StatusOK || strings.Contains(page, "root:") {
			t.Errorf("%s: %d %q", p, code, page)
		}
	}
}

// TestStdioProjectWithoutPreviewLinkStillCreated: with previews turned off
// there is no address for a preview link, but the project is created all
// the same, so the tool must say it succeeded (and why the link is
// missing) rather than fail after doing the work.
func TestStdioProjectWithoutPreviewLinkStillCreated(t *testing.T) {
	requireNodeRunner(t)
	root := brokerRoot(t)
	c := StartStdio(t, root, map[string]string{"SANDBOX_POOL_SIZE": "0", "PREVIEW_ADDR": "off"})
	res := callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "offline", "template": "node",
		"initial_files": map[string]string{"server.js": "console.log('hi')\n"}})
	var created struct {
		projectCreated
		PreviewUnavailable string `json:"preview_unavailable"`
	}
	resultJSON(t, res, &created)
	if res.IsError || created.Provider != "local" || created.SandboxID == "" || created.PreviewURL != "" ||
		!strings.Contains(created.PreviewUnavailable, "PREVIEW_ADDR=off") {
		t.Fatalf("create over stdio: %+v", created)
	}
	var list struct {
		Sandboxes []struct {
			SandboxID string `json:"sandbox_id"`
		} `json:"sandboxes"`
	}
	resultJSON(t, callTool(t, c, "list_sandboxes", nil), &list)
	if len(list.Sandboxes) != 1 || list.Sandboxes[0].SandboxID != created.SandboxID {
		t.Fatalf("list_sandboxes: %+v", list)
	}
	// Asking for the link says what to configure, and that retrying will not help.
	e := mustToolError(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "preview_url"}), "NOT_CONFIGURED")
	if e.Retryable || !strings.Contains(e.Message, "PREVIEW_ADDR=off") {
		t.Fatalf("preview_url over stdio: %+v", e)
	}
	c.Close()
	if got := auditOutcomes(t, root, "create_sandbox_for_project"); strings.Join(got, ",") != "success" {
		t.Fatalf("create_sandbox_for_project audit outcomes: %v", got)
	}
}
