package tests

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// rawRequest sends a request line and headers byte for byte (no client-side
// cleaning) and reads the response.
func rawRequest(t testing.TB, b *Broker, method, target string, headers ...string) *http.Response {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s\r\n", method, target, strings.Join(append(headers, ""), "\r\n"))
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

// TestNonCanonicalPathsRefused: the broker refuses a request path that
// is not canonical before any routing, instead of the ServeMux answering
// 307 with a cleaned Location (issue 15: //files/…, /./files/…, /x/../files/…).
func TestNonCanonicalPathsRefused(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none"}})
	const ws = "0123456789abcdef0123456789abcdef"
	q := "?exp=9999999999&kid=k1&sig=AAAA"
	auth := "Authorization: Bearer " + testToken
	for _, target := range []string{
		"//files/" + ws + "/out.txt" + q,
		"/./files/" + ws + "/out.txt" + q,
		"/x/../files/" + ws + "/out.txt" + q,
		"/x/%2e%2e/files/" + ws + "/out.txt" + q,
		"/%2e/files/" + ws + "/out.txt" + q,
		"/files/" + ws + "/../" + ws + "/out.txt" + q,
		"//preview/" + ws + "/index.html",
		"/preview/" + ws + "/../../mcp",
		"/preview/./" + ws + "/",
		"//mcp",
		"/./mcp",
		"/mcp/.",
		"/x/../mcp",
		"//healthz",
		"/healthz/.",
		"/metrics/..",
		"/x//",
	} {
		for _, method := range []string{http.MethodGet, http.MethodPost} {
			resp := rawRequest(t, b, method, target, auth, "Content-Length: 0")
			if resp.StatusCode != http.StatusForbidden || resp.Header.Get("Location") != "" {
				t.Errorf("%s %s: %d (Location %q), want 403", method, target, resp.StatusCode, resp.Header.Get("Location"))
			}
		}
	}
	// Canonical paths are routed as before.
	for target, want := range map[string]int{
		"/healthz":                        http.StatusOK,
		"/nope/":                          http.StatusNotFound,
		"/files/" + ws + "/out.txt" + q:   http.StatusForbidden, // the handler's own refusal
		"/files/" + ws + "/a%2Fb.txt" + q: http.StatusForbidden,
	} {
		if resp := rawRequest(t, b, http.MethodGet, target); resp.StatusCode != want {
			t.Errorf("GET %s: %d, want %d", target, resp.StatusCode, want)
		}
	}
}
