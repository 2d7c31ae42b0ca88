package broker

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/config"
)

func TestCanonicalPath(t *testing.T) {
	for _, p := range []string{"/", "/mcp", "/files/abc/d.txt", "/preview/id/", "/a%20b", "/%E2%9C%93"} {
		if !canonicalPath(p) {
			t.Errorf("canonicalPath(%q) = false", p)
		}
	}
	for _, p := range []string{"", "mcp", "//mcp", "/./mcp", "/mcp/.", "/mcp/..", "/x/../mcp", "/x//", "/%2e/mcp",
		"/x/%2E%2E/mcp", "/a%2F..%2Fb", "/%2Fmcp", "/%zz", "*"} {
		if canonicalPath(p) {
			t.Errorf("canonicalPath(%q) = true", p)
		}
	}
}

// FuzzCanonicalPath: a path canonicalPath accepts is never redirected by
// http.ServeMux's cleaning, which this guard stands in front of. The
// subtree redirect ("/files" to "/files/") adds a slash and cleans
// nothing, so it is allowed.
func FuzzCanonicalPath(f *testing.F) {
	for _, s := range []string{"/", "/mcp", "//mcp", "/./x", "/x/..", "/%2e%2e/x", "/a%2Fb", "/files/x/", "/x/.", "/files"} {
		f.Add(s)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("/files/", func(http.ResponseWriter, *http.Request) {})
	f.Fuzz(func(t *testing.T, p string) {
		if !canonicalPath(p) {
			return
		}
		u, err := url.ParseRequestURI(p)
		if err != nil || strings.ContainsAny(p, "?#") {
			return
		}
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, &http.Request{Method: http.MethodGet, URL: u, Host: "x", Header: http.Header{}})
		if rec.Code >= 300 && rec.Code < 400 && rec.Header().Get("Location") != p+"/" {
			t.Fatalf("accepted %q but ServeMux redirects it (%d to %q)", p, rec.Code, rec.Header().Get("Location"))
		}
	})
}

// TestBodyDeadlineLiftedOnceRead: the body deadline must not cut a
// response that streams on after the body was read (SSE).
func TestBodyDeadlineLiftedOnceRead(t *testing.T) {
	b := &Broker{cfg: config.Config{BodyTimeoutS: 1}}
	srv := httptest.NewServer(b.boundBody(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.ReadAll(r.Body); err != nil {
			t.Errorf("read body: %v", err)
		}
		w.WriteHeader(http.StatusOK)
		http.NewResponseController(w).Flush()
		// Outlive the body deadline, as a long SSE response does.
		select {
		case <-r.Context().Done():
			_, _ = io.WriteString(w, "cancelled")
		case <-time.After(1500 * time.Millisecond):
			_, _ = io.WriteString(w, "streamed")
		}
	})))
	defer srv.Close()
	resp, err := http.Post(srv.URL, "application/json", strings.NewReader(`{"jsonrpc":"2.0"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	if string(got) != "streamed" {
		t.Fatalf("response after the body deadline: %q", got)
	}
}
