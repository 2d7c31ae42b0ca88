package broker

import (
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/files"
)

const testID = "0123456789abcdef0123456789abcdef"

func TestPreviewSite(t *testing.T) {
	for _, tc := range []struct {
		base, origin string
		accept       []string // Host headers for testID
		refuse       []string
	}{
		{"http://*.localhost:8081", "http://" + testID + ".localhost:8081",
			[]string{testID + ".localhost:8081", testID + ".LOCALHOST", strings.ToUpper(testID) + ".localhost:1"},
			[]string{"localhost:8081", "127.0.0.1:8081", "x.localhost", testID + ".localhost.evil", "a." + testID + ".localhost", testID[1:] + ".localhost", ""}},
		{"https://*.preview.example.net", "https://" + testID + ".preview.example.net",
			[]string{testID + ".preview.example.net", testID + ".preview.example.net:443"},
			[]string{"preview.example.net", testID + ".example.net", testID + ".preview.example.net.evil"}},
		{"https://preview.example.net:8443", "https://preview.example.net:8443",
			[]string{"preview.example.net", "preview.example.net:8443"},
			[]string{testID + ".preview.example.net", "example.net"}},
		{"http://[::2]:9000", "http://[::2]:9000", []string{"[::2]:9000", "[::2]"}, []string{"[::1]:9000", "[::22]"}},
	} {
		s, err := parsePreviewSite(tc.base)
		if err != nil {
			t.Fatalf("%s: %v", tc.base, err)
		}
		if got := s.origin(testID); got != tc.origin {
			t.Errorf("%s: origin %q, want %q", tc.base, got, tc.origin)
		}
		for _, h := range tc.accept {
			id, ok := s.hostFor(h)
			if !ok || (s.wildcard && id != testID) {
				t.Errorf("%s: Host %q refused (%q)", tc.base, h, id)
			}
		}
		for _, h := range tc.refuse {
			if _, ok := s.hostFor(h); ok {
				t.Errorf("%s: Host %q accepted", tc.base, h)
			}
		}
	}
	for _, bad := range []string{"", "ftp://x", "http://", "localhost:8081"} {
		if _, err := parsePreviewSite(bad); err == nil {
			t.Errorf("parsePreviewSite(%q) accepted", bad)
		}
	}
}

// FuzzPreviewHost: a Host header a wildcard site accepts names a valid
// sandbox ID, and that sandbox's origin is that very host; a single-origin
// site accepts nothing but its host.
func FuzzPreviewHost(f *testing.F) {
	for _, s := range []string{testID + ".localhost:8081", "localhost", testID + ".localhost.", "X.localhost", "[::1]:80", testID + "..localhost", ":8081"} {
		f.Add(s)
	}
	wild, _ := parsePreviewSite("http://*.localhost:8081")
	single, _ := parsePreviewSite("http://preview.test:8081")
	f.Fuzz(func(t *testing.T, host string) {
		if id, ok := wild.hostFor(host); ok {
			if !files.ValidWorkspaceID(id) {
				t.Fatalf("accepted %q with id %q", host, id)
			}
			u, err := url.Parse(wild.origin(id))
			h := host
			if hh, _, err := net.SplitHostPort(host); err == nil {
				h = hh
			}
			if err != nil || !strings.EqualFold(u.Hostname(), strings.Trim(h, "[]")) {
				t.Fatalf("accepted %q, but the sandbox's origin is %q", host, wild.origin(id))
			}
		}
		if _, ok := single.hostFor(host); ok {
			h := host
			if hh, _, err := net.SplitHostPort(host); err == nil {
				h = hh
			}
			if !strings.EqualFold(strings.Trim(h, "[]"), "preview.test") {
				t.Fatalf("single site accepted %q", host)
			}
		}
	})
}

// TestPreviewCookieAttributes: partitioned SameSite=None where browsers
// take Secure cookies (https, localhost names), so the console's preview
// frame gets its cookie under the console's site only; Strict elsewhere.
func TestPreviewCookieAttributes(t *testing.T) {
	exp := time.Now().Add(time.Hour)
	for _, tc := range []struct {
		base        string
		tls         bool
		partitioned bool
	}{
		{"http://*.localhost:8081", false, true},
		{"http://localhost:8081", false, true},
		{"https://*.preview.example.net", false, true},
		{"http://preview.internal:8081", true, true}, // TLS terminated here
		{"http://preview.internal:8081", false, false},
	} {
		site, err := parsePreviewSite(tc.base)
		if err != nil {
			t.Fatal(err)
		}
		c := site.cookie("exp=1&sig=x", "/preview/abc/", exp, tc.tls)
		if !c.HttpOnly || c.Path != "/preview/abc/" || c.Domain != "" {
			t.Errorf("%s: %+v", tc.base, c)
		}
		if tc.partitioned && (!c.Partitioned || !c.Secure || c.SameSite != http.SameSiteNoneMode) ||
			!tc.partitioned && (c.Partitioned || c.Secure || c.SameSite != http.SameSiteStrictMode) {
			t.Errorf("%s (tls %v): secure %v partitioned %v samesite %v", tc.base, tc.tls, c.Secure, c.Partitioned, c.SameSite)
		}
	}
}
