package tests

import (
	"encoding/json"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"testing"
)

// previewListenAddr is the preview listener's address, from the broker's
// "preview_listening" log line (logged before the MCP listener starts).
func previewListenAddr(t *testing.T, b *Broker) string {
	t.Helper()
	for _, line := range strings.Split(b.Logs(), "\n") {
		var ev struct{ Message, Addr string }
		if json.Unmarshal([]byte(line), &ev) == nil && ev.Message == "preview_listening" {
			return ev.Addr
		}
	}
	t.Fatalf("no preview_listening in the broker's log:\n%s", b.Logs())
	return ""
}

// TestPreviewListenerServesOnlyPreviews: the preview listener answers only
// /preview/{id}/ on that sandbox's own host, with the preview CSP on every
// answer; it refuses other hosts, another sandbox's host, and requests a
// page of another origin made; its cookie is host-only, path-scoped,
// HttpOnly, and (on a localhost name) Secure, SameSite=None and
// Partitioned, so it reaches the preview framed by the web console and
// under no other top-level site; and the broker's MCP listener refuses a preview's
// Origin even when MCP_ALLOWED_ORIGINS lists it. PREVIEW_BASE_URL stands
// for a reverse proxy: links use it while the listener has its own port.
func TestPreviewListenerServesOnlyPreviews(t *testing.T) {
	requireNodeRunner(t)
	const otherID = "0123456789abcdef0123456789abcdef"
	proxied := "http://" + otherID + ".preview.localhost:8443"
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0",
		"PREVIEW_BASE_URL": "http://*.preview.localhost:8443", "MCP_ALLOWED_ORIGINS": proxied}})
	addr := previewListenAddr(t, b)
	c := b.Client(t, testToken)
	var created projectCreated
	resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "edge", "template": "node"}), &created)
	id := created.SandboxID
	host := id + ".preview.localhost:8443"
	link, err := url.Parse(created.PreviewURL)
	if err != nil || link.Scheme+"://"+link.Host != "http://"+host || link.Path != "/preview/"+id+"/" {
		t.Fatalf("preview link %q does not use PREVIEW_BASE_URL", created.PreviewURL)
	}
	target := link.RequestURI()

	ok, page := rawRequestTo(t, addr, host, http.MethodGet, target)
	if ok.StatusCode != http.StatusOK || !strings.Contains(page, "Hello from Node.js") {
		t.Fatalf("preview through its own host: %d", ok.StatusCode)
	}
	if csp := ok.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "sandbox") || !strings.Contains(csp, "allow-same-origin") {
		t.Errorf("preview CSP %q", csp)
	}
	cookies := ok.Cookies()
	if len(cookies) != 1 || cookies[0].Name != "sbx_preview" || cookies[0].Path != "/preview/"+id+"/" || cookies[0].Domain != "" ||
		!cookies[0].HttpOnly || cookies[0].SameSite != http.SameSiteNoneMode || !cookies[0].Partitioned || !cookies[0].Secure {
		t.Errorf("preview cookie %+v", cookies)
	}
	// The cookie alone authorises the page's own requests.
	if r, _ := rawRequestTo(t, addr, host, http.MethodGet, "/preview/"+id+"/other", "Cookie: sbx_preview="+cookies[0].Value); r.StatusCode != http.StatusOK {
		t.Errorf("with the cookie: %d", r.StatusCode)
	}

	for _, tc := range []struct {
		name, host, target string
		headers            []string
		want               int
	}{
		{"the broker's host", "127.0.0.1", target, nil, http.StatusForbidden},
		{"localhost", "localhost:8443", target, nil, http.StatusForbidden},
		{"a name under the preview host that is no sandbox ID", "www.preview.localhost", target, nil, http.StatusForbidden},
		{"a rebinding attacker's name", "evil.example", target, nil, http.StatusForbidden},
		{"another sandbox's host", otherID + ".preview.localhost:8443", target, nil, http.StatusNotFound},
		{"an Origin of another sandbox", host, target, []string{"Origin: " + proxied}, http.StatusForbidden},
		{"an opaque Origin", host, target, []string{"Origin: null"}, http.StatusForbidden},
		{"the MCP endpoint", host, "/mcp", nil, http.StatusNotFound},
		{"signed downloads", host, "/files/" + id + "/x.txt" + "?" + link.RawQuery, nil, http.StatusNotFound},
		{"health", host, "/healthz", nil, http.StatusNotFound},
		{"a non-canonical path", host, "/preview/" + id + "/../" + id + "/?" + link.RawQuery, nil, http.StatusForbidden},
		{"no proof", host, "/preview/" + id + "/", nil, http.StatusForbidden},
	} {
		r, body := rawRequestTo(t, addr, tc.host, http.MethodGet, tc.target, tc.headers...)
		if r.StatusCode != tc.want || strings.Contains(body, "Hello from Node.js") {
			t.Errorf("%s: %d, want %d", tc.name, r.StatusCode, tc.want)
		}
		if r.Header.Get("Content-Security-Policy") == "" {
			t.Errorf("%s: the answer has no CSP", tc.name)
		}
	}

	// The broker refuses a preview's Origin, listed or not.
	u, _ := url.Parse(b.URL)
	for _, origin := range []string{proxied, "http://" + host} {
		r, _ := rawRequestTo(t, u.Host, u.Host, http.MethodGet, "/healthz", "Origin: "+origin)
		if r.StatusCode != http.StatusForbidden {
			t.Errorf("MCP listener, Origin %s: %d", origin, r.StatusCode)
		}
	}
}

// TestStdioBrokerServesPreviews: over stdio the broker starts its preview
// listener too (loopback, an OS-chosen port), so a local client's
// previews open in a browser.
func TestStdioBrokerServesPreviews(t *testing.T) {
	requireNodeRunner(t)
	c := StartStdio(t, "", map[string]string{"SANDBOX_POOL_SIZE": "0"})
	var created projectCreated
	resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "local", "template": "node"}), &created)
	origin := previewOrigin(t, created.PreviewURL)
	if !strings.HasPrefix(origin, "http://"+created.SandboxID+".localhost:") {
		t.Fatalf("preview link %q", created.PreviewURL)
	}
	jar, _ := cookiejar.New(nil)
	if code, page, _ := fetch(t, previewClient(jar), created.PreviewURL); code != http.StatusOK || !strings.Contains(page, "Hello from Node.js") {
		t.Fatalf("stdio preview %d: %s", code, page)
	}
}
