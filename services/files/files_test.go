package files

import (
	"bufio"
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

const (
	idA = "0123456789abcdef0123456789abcdef"
	idB = "fedcba9876543210fedcba9876543210"
)

var t0 = time.Unix(1_800_000_000, 0)

type env struct {
	root    string
	signer  *Signer
	handler *Handler
	srv     *httptest.Server
	now     time.Time
	mu      sync.Mutex
	logs    []string
}

func master(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{root: t.TempDir(), now: t0}
	keys, err := NewKeyring(master(1))
	if err != nil {
		t.Fatal(err)
	}
	e.signer = &Signer{Keys: keys, BaseURL: "https://files.example.com", Now: e.clock}
	e.handler = &Handler{Signer: e.signer, Root: e.root, Log: func(ev string, kv ...any) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.logs = append(e.logs, fmt.Sprint(append([]any{ev}, kv...)...))
	}}
	e.srv = httptest.NewServer(e.handler)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *env) clock() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.now
}

func (e *env) setNow(t time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.now = t
}

// ws creates workspace id and returns its directory.
func (e *env) ws(t *testing.T, id string) string {
	t.Helper()
	dir := filepath.Join(e.root, "workspaces", id)
	w, err := workspace.Create(dir)
	if err != nil {
		t.Fatal(err)
	}
	_ = w.Close()
	return dir
}

func writeFile(t *testing.T, name, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(name, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// target signs path in id and returns the request target (path?query).
func (e *env) target(t *testing.T, id, path string) string {
	t.Helper()
	u, exp, err := e.signer.URL(id, path)
	if err != nil {
		t.Fatal(err)
	}
	if !exp.Equal(e.clock().Add(DefaultTTL)) {
		t.Fatalf("exp %v", exp)
	}
	return strings.TrimPrefix(u, "https://files.example.com")
}

// raw sends target byte for byte (no client-side cleaning or escaping).
func raw(t *testing.T, srvURL, method, target string) (*http.Response, string) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(srvURL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: files.example.com\r\nConnection: close\r\n\r\n", method, target)
	req := &http.Request{Method: method}
	resp, err := http.ReadResponse(bufio.NewReader(c), req)
	if err != nil {
		t.Fatalf("%s %q: %v", method, target, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp, string(body)
}

func status(t *testing.T, srvURL, target string) int {
	t.Helper()
	resp, _ := raw(t, srvURL, "GET", target)
	return resp.StatusCode
}

func TestRoundTrip(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	writeFile(t, filepath.Join(dir, "out/data.csv"), "a,b\n1,2\n")
	writeFile(t, filepath.Join(dir, "résumé 1;x.html"), "<script>alert(1)</script>")

	tg := e.target(t, idA, "out/data.csv")
	resp, body := raw(t, e.srv.URL, "GET", tg)
	if resp.StatusCode != 200 || body != "a,b\n1,2\n" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	for k, v := range map[string]string{
		"Content-Type":            "text/csv; charset=utf-8",
		"Content-Disposition":     "attachment; filename*=UTF-8''data.csv",
		"X-Content-Type-Options":  "nosniff",
		"Content-Security-Policy": "sandbox",
		"Referrer-Policy":         "no-referrer",
		"Cache-Control":           "private, no-store",
		"Content-Length":          "8",
	} {
		if got := resp.Header.Get(k); got != v {
			t.Errorf("%s = %q, want %q", k, got, v)
		}
	}

	// HEAD is verified as GET and has no body.
	resp, body = raw(t, e.srv.URL, "HEAD", tg)
	if resp.StatusCode != 200 || body != "" || resp.Header.Get("Content-Length") != "8" {
		t.Fatalf("HEAD %d %q %v", resp.StatusCode, body, resp.Header)
	}

	// A non-ASCII name with characters that need escaping, via a normal client.
	u, _, err := e.signer.URL(idA, "résumé 1;x.html")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(u, "/r%C3%A9sum%C3%A9%201%3Bx.html?") {
		t.Fatalf("escaping: %s", u)
	}
	r2, err := http.Get(e.srv.URL + strings.TrimPrefix(u, "https://files.example.com"))
	if err != nil {
		t.Fatal(err)
	}
	b2, _ := io.ReadAll(r2.Body)
	r2.Body.Close()
	if r2.StatusCode != 200 || string(b2) != "<script>alert(1)</script>" {
		t.Fatalf("%d %q", r2.StatusCode, b2)
	}
	if cd := r2.Header.Get("Content-Disposition"); cd != "attachment; filename*=UTF-8''r%C3%A9sum%C3%A9%201%3Bx.html" {
		t.Errorf("Content-Disposition %q", cd)
	}
	if ct := r2.Header.Get("Content-Type"); ct != "text/html; charset=utf-8" {
		t.Errorf("Content-Type %q", ct)
	}

	// Range requests work (ServeContent).
	req, _ := http.NewRequest("GET", e.srv.URL+tg, nil)
	req.Header.Set("Range", "bytes=4-6")
	r3, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b3, _ := io.ReadAll(r3.Body)
	r3.Body.Close()
	if r3.StatusCode != 206 || string(b3) != "1,2" {
		t.Fatalf("range %d %q", r3.StatusCode, b3)
	}

	// Expiry: valid until exp inclusive, then 403.
	e.setNow(t0.Add(DefaultTTL))
	if s := status(t, e.srv.URL, tg); s != 200 {
		t.Fatalf("at exp: %d", s)
	}
	e.setNow(t0.Add(DefaultTTL + time.Second))
	if s := status(t, e.srv.URL, tg); s != 403 {
		t.Fatalf("after exp: %d", s)
	}
}

// splitTarget returns the escaped path and the three query values.
func splitTarget(t *testing.T, tg string) (p, exp, kid, sig string) {
	t.Helper()
	p, q, _ := strings.Cut(tg, "?")
	v, err := url.ParseQuery(q)
	if err != nil {
		t.Fatal(err)
	}
	return p, v.Get("exp"), v.Get("kid"), v.Get("sig")
}

func TestTampering(t *testing.T) {
	e := newEnv(t)
	dirA := e.ws(t, idA)
	dirB := e.ws(t, idB)
	writeFile(t, filepath.Join(dirA, "out/data.csv"), "A")
	writeFile(t, filepath.Join(dirA, "other.txt"), "A2")
	writeFile(t, filepath.Join(dirB, "out/data.csv"), "B")
	writeFile(t, filepath.Join(dirA, "a/b"), "AB")

	tg := e.target(t, idA, "out/data.csv")
	p, exp, kid, sig := splitTarget(t, tg)
	q := func(exp, kid, sig string) string { return "exp=" + exp + "&kid=" + kid + "&sig=" + sig }
	flip := func(s string) string {
		b := []byte(s)
		if b[5] == 'A' {
			b[5] = 'B'
		} else {
			b[5] = 'A'
		}
		return string(b)
	}
	caseSwap := func(s string) string {
		for i, c := range s {
			if c >= 'a' && c <= 'z' {
				return s[:i] + strings.ToUpper(string(c)) + s[i+1:]
			}
			if c >= 'A' && c <= 'Z' {
				return s[:i] + strings.ToLower(string(c)) + s[i+1:]
			}
		}
		t.Fatal("no letter in sig")
		return ""
	}
	expPlus := func(d int64) string {
		var n int64
		fmt.Sscan(exp, &n)
		return fmt.Sprint(n + d)
	}
	keys2, _ := NewKeyring(master(9))
	other := &Signer{Keys: keys2, BaseURL: "https://x.example", Now: e.clock}
	otherURL, _, _ := other.URL(idA, "out/data.csv")
	_, _, kid2, sig2 := splitTarget(t, strings.TrimPrefix(otherURL, "https://x.example"))
	// A signature the real key made for exp in a year (MaxTTL exceeded).
	farSig := signRaw(e.signer, kid, idA, "out/data.csv", expPlus(365*24*3600))
	beyondMax := signRaw(e.signer, kid, idA, "out/data.csv", expPlus(int64((DefaultMaxTTL-DefaultTTL+ClockSkew)/time.Second)+1))
	withinSkew := signRaw(e.signer, kid, idA, "out/data.csv", expPlus(int64((DefaultMaxTTL-DefaultTTL+ClockSkew)/time.Second)))
	pastSig := signRaw(e.signer, kid, idA, "out/data.csv", expPlus(-int64(DefaultTTL/time.Second)-1))

	if s := status(t, e.srv.URL, tg); s != 200 {
		t.Fatalf("baseline %d", s)
	}
	if s := status(t, e.srv.URL, p+"?"+q(expPlus(int64((DefaultMaxTTL-DefaultTTL+ClockSkew)/time.Second)), kid, withinSkew)); s != 200 {
		t.Fatalf("max TTL + skew should pass: %d", s)
	}
	if s := status(t, e.srv.URL, p+"?kid="+kid+"&sig="+sig+"&exp="+exp); s != 200 {
		t.Fatalf("reordered params should pass: %d", s)
	}

	pathB := strings.Replace(p, idA, idB, 1)
	cases := map[string]string{
		"changed exp":              p + "?" + q(expPlus(1), kid, sig),
		"exp leading zero":         p + "?" + q("0"+exp, kid, sig),
		"exp plus sign":            p + "?" + q("+"+exp, kid, sig),
		"exp in the past":          p + "?" + q(expPlus(-int64(DefaultTTL/time.Second)-1), kid, pastSig),
		"exp in a year":            p + "?" + q(expPlus(365*24*3600), kid, farSig),
		"exp beyond MaxTTL":        p + "?" + q(expPlus(int64((DefaultMaxTTL-DefaultTTL+ClockSkew)/time.Second)+1), kid, beyondMax),
		"changed path":             strings.Replace(p, "data.csv", "data.csz", 1) + "?" + q(exp, kid, sig),
		"other file in A":          "/files/" + idA + "/other.txt?" + q(exp, kid, sig),
		"workspace B, sig for A":   pathB + "?" + q(exp, kid, sig),
		"truncated sig":            p + "?" + q(exp, kid, sig[:len(sig)-1]),
		"sig one char short+pad":   p + "?" + q(exp, kid, sig[:len(sig)-1]+"="),
		"flipped sig":              p + "?" + q(exp, kid, flip(sig)),
		"case-changed sig":         p + "?" + q(exp, kid, caseSwap(sig)),
		"sig percent-encoded":      p + "?" + q(exp, kid, strings.Replace(sig, sig[:1], "%"+fmt.Sprintf("%02X", sig[0]), 1)),
		"unknown kid":              p + "?" + q(exp, "deadbeef", sig),
		"other key's kid+sig":      p + "?" + q(exp, kid2, sig2),
		"duplicated sig":           p + "?" + q(exp, kid, sig) + "&sig=" + sig,
		"duplicated exp":           p + "?" + q(exp, kid, sig) + "&exp=" + exp,
		"dup exp, 2 params":        p + "?exp=" + exp + "&exp=" + exp + "&sig=" + sig,
		"extra param":              p + "?" + q(exp, kid, sig) + "&x=1",
		"empty extra":              p + "?" + q(exp, kid, sig) + "&",
		"v param":                  p + "?v=1&" + q(exp, kid, sig),
		"semicolon":                p + "?exp=" + exp + ";kid=" + kid + "&sig=" + sig,
		"no query":                 p,
		"missing sig":              p + "?exp=" + exp + "&kid=" + kid,
		"uppercase ID":             strings.ToUpper(p[:39]) + p[39:] + "?" + q(exp, kid, sig),
		"short ID":                 "/files/" + idA[:31] + "/out/data.csv?" + q(exp, kid, sig),
		"no path":                  "/files/" + idA + "?" + q(exp, kid, sig),
		"empty path":               "/files/" + idA + "/?" + q(exp, kid, sig),
		"wrong prefix":             "/file/" + idA + "/out/data.csv?" + q(exp, kid, sig),
		"%2F":                      "/files/" + idA + "/out%2Fdata.csv?" + q(exp, kid, sig),
		"%2f":                      "/files/" + idA + "/out%2fdata.csv?" + q(exp, kid, sig),
		"%2e%2e":                   "/files/" + idA + "/%2e%2e/" + idA + "/out/data.csv?" + q(exp, kid, sig),
		"..":                       "/files/" + idA + "/x/../out/data.csv?" + q(exp, kid, sig),
		".":                        "/files/" + idA + "/./out/data.csv?" + q(exp, kid, sig),
		"double slash":             "/files/" + idA + "/out//data.csv?" + q(exp, kid, sig),
		"leading double slash":     "//files/" + idA + "/out/data.csv?" + q(exp, kid, sig),
		"backslash":                "/files/" + idA + "/out\\data.csv?" + q(exp, kid, sig),
		"%5C":                      "/files/" + idA + "/out%5Cdata.csv?" + q(exp, kid, sig),
		"%00":                      "/files/" + idA + "/out/data.csv%00?" + q(exp, kid, sig),
		"%25":                      "/files/" + idA + "/out%252Fdata.csv?" + q(exp, kid, sig),
		"lowercase escape":         "/files/" + idA + "/out/d%61ta.csv?" + q(exp, kid, sig),
		"trailing slash":           p + "/?" + q(exp, kid, sig),
		"path a/b signed as a%2Fb": "/files/" + idA + "/a%2Fb?" + q(exp, kid, signRawEsc(e.signer, kid, idA, "a%2Fb", exp)),
	}
	for name, target := range cases {
		resp, body := raw(t, e.srv.URL, "GET", target)
		if resp.StatusCode != 403 || body != "forbidden\n" {
			t.Errorf("%s (%q): %d %q", name, target, resp.StatusCode, body)
		}
	}
	// net/http itself answers 400 to an invalid escape before any handler.
	if resp, _ := raw(t, e.srv.URL, "GET", "/files/"+idA+"/out/data.csv%zz?"+q(exp, kid, sig)); resp.StatusCode != 400 {
		t.Errorf("bad escape: %d", resp.StatusCode)
	}
	// net/http itself answers 400 to an invalid escape before any handler.
	if resp, _ := raw(t, e.srv.URL, "GET", "/files/"+idA+"/out/data.csv%zz?"+q(exp, kid, sig)); resp.StatusCode != 400 {
		t.Errorf("bad escape: %d", resp.StatusCode)
	}
	for _, m := range []string{"POST", "PUT", "DELETE", "OPTIONS", "PATCH"} {
		if resp, _ := raw(t, e.srv.URL, m, tg); resp.StatusCode != 403 {
			t.Errorf("%s: %d", m, resp.StatusCode)
		}
	}
	// The denial response still carries the safety headers.
	resp, _ := raw(t, e.srv.URL, "GET", p)
	if resp.Header.Get("X-Content-Type-Options") != "nosniff" || resp.Header.Get("Cache-Control") != "private, no-store" {
		t.Errorf("403 headers %v", resp.Header)
	}
}

// signRaw signs an unescaped path with the signer's key for kid.
func signRaw(s *Signer, kid, id, rel, exp string) string {
	esc, _ := escapePath(rel)
	return signRawEsc(s, kid, id, esc, exp)
}

// signRawEsc computes the signature from the documented string-to-sign,
// independently of mac: links signed before upload links existed still
// verify.
func signRawEsc(s *Signer, kid, id, esc, exp string) string {
	key, _ := s.Keys.key(kid)
	m := hmac.New(sha256.New, key)
	m.Write([]byte("v1\n" + kid + "\nGET\n" + id + "\n" + esc + "\n" + exp))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// TestPrefixConfusion: workspace ids are whole path components.
func TestPrefixConfusion(t *testing.T) {
	e := newEnv(t)
	dirA := e.ws(t, idA)
	writeFile(t, filepath.Join(dirA, "f.txt"), "A")
	// A sibling whose name extends A's id, holding a secret.
	writeFile(t, filepath.Join(e.root, "workspaces", idA+"0", "secret"), "S")
	writeFile(t, filepath.Join(e.root, "workspaces", idA+"0", "f.txt"), "S")
	// A second valid workspace sharing a 31-char prefix with A.
	idA2 := idA[:31] + "0"
	dirA2 := e.ws(t, idA2)
	writeFile(t, filepath.Join(dirA2, "f.txt"), "A2")

	tg := e.target(t, idA, "f.txt")
	_, exp, kid, sig := splitTarget(t, tg)
	qs := "?exp=" + exp + "&kid=" + kid + "&sig=" + sig
	for _, target := range []string{
		"/files/" + idA + "0/f.txt" + qs,
		"/files/" + idA + "0/secret" + qs,
		"/files/" + idA2 + "/f.txt" + qs,
		"/files/" + idA + "/../" + idA + "0/secret" + qs,
		"/files/" + idA + "/%2e%2e/" + idA + "0/secret" + qs,
		"/files/" + idA + "/..%2F" + idA + "0%2Fsecret" + qs,
	} {
		if s := status(t, e.srv.URL, target); s != 403 {
			t.Errorf("%q: %d", target, s)
		}
	}
	// The signer refuses non-IDs outright.
	if _, _, err := e.signer.URL(idA+"0", "secret"); brokererr.CodeOf(err) != brokererr.InvalidInput {
		t.Errorf("URL(idA0) err %v", err)
	}
	if resp, body := raw(t, e.srv.URL, "GET", tg); resp.StatusCode != 200 || body != "A" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
}

func TestNotFound(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	outside := t.TempDir()
	writeFile(t, filepath.Join(outside, "secret"), "S")
	writeFile(t, filepath.Join(dir, "real/in.txt"), "in")
	for name, target := range map[string]string{
		"passwd":     "/etc/passwd",
		"relpasswd":  "../../../../../../../../etc/passwd",
		"secretlink": filepath.Join(outside, "secret"),
		"rootdir":    "/",
		"outdir":     outside,
		"inlink":     "real/in.txt", // in-root, but the final component is a symlink
		"indir":      "real",
	} {
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := syscall.Mkfifo(filepath.Join(dir, "out.txt"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "adir"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{
		"passwd", "relpasswd", "secretlink", "rootdir/etc/passwd", "outdir/secret", "inlink",
		"out.txt", "adir", "real", "missing.txt",
	} {
		done := make(chan int, 1)
		go func() { done <- status(t, e.srv.URL, e.target(t, idA, p)) }()
		select {
		case s := <-done:
			if s != 404 {
				t.Errorf("%s: %d, want 404", p, s)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: request blocked", p)
		}
	}
	// A directory link that stays inside resolves as an intermediate.
	if s := status(t, e.srv.URL, e.target(t, idA, "indir/in.txt")); s != 200 {
		t.Errorf("indir/in.txt: %d", s)
	}
	// A validly signed URL for a workspace that does not exist.
	if s := status(t, e.srv.URL, e.target(t, idB, "x")); s != 404 {
		t.Errorf("missing workspace: %d", s)
	}
	// The workspace directory itself replaced by a symlink: refused.
	idC := strings.Repeat("c", 32)
	if err := os.Symlink(dir, filepath.Join(e.root, "workspaces", idC)); err != nil {
		t.Fatal(err)
	}
	if s := status(t, e.srv.URL, e.target(t, idC, "real/in.txt")); s != 404 {
		t.Errorf("symlinked workspace: %d", s)
	}
	// Size cap.
	writeFile(t, filepath.Join(dir, "big.bin"), strings.Repeat("x", 100))
	e.handler.MaxFileBytes = 99
	if s := status(t, e.srv.URL, e.target(t, idA, "big.bin")); s != 404 {
		t.Errorf("over cap: %d", s)
	}
	e.handler.MaxFileBytes = 100
	if s := status(t, e.srv.URL, e.target(t, idA, "big.bin")); s != 200 {
		t.Errorf("at cap: %d", s)
	}
}

func TestKeyRotation(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	writeFile(t, filepath.Join(dir, "f.txt"), "x")
	oldTarget := e.target(t, idA, "f.txt") // signed with master(1)

	// Rotate: new active key, old one still accepted.
	rotated, err := NewKeyring(master(2), master(1))
	if err != nil {
		t.Fatal(err)
	}
	if rotated.ActiveKID() == e.signer.Keys.ActiveKID() {
		t.Fatal("kid did not change")
	}
	e.signer.Keys = rotated
	newTarget := e.target(t, idA, "f.txt")
	if !strings.Contains(newTarget, "kid="+rotated.ActiveKID()+"&") {
		t.Fatalf("not signed with the new key: %s", newTarget)
	}
	for _, tg := range []string{oldTarget, newTarget} {
		if s := status(t, e.srv.URL, tg); s != 200 {
			t.Fatalf("%s: %d", tg, s)
		}
	}
	// Drop the old key.
	dropped, _ := NewKeyring(master(2))
	e.signer.Keys = dropped
	if s := status(t, e.srv.URL, oldTarget); s != 403 {
		t.Fatalf("old key after drop: %d", s)
	}
	if s := status(t, e.srv.URL, newTarget); s != 200 {
		t.Fatalf("new key after drop: %d", s)
	}
}

// TestServeMuxRedirects documents why the handler must not sit behind
// http.ServeMux: the mux answers 307 for uncleaned paths instead of letting
// the handler refuse them. Intercept (or a dedicated server) fixes it.
func TestServeMuxRedirects(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	writeFile(t, filepath.Join(dir, "out/data.csv"), "A")
	tg := e.target(t, idA, "out/data.csv")
	_, exp, kid, sig := splitTarget(t, tg)
	qs := "?exp=" + exp + "&kid=" + kid + "&sig=" + sig

	mux := http.NewServeMux()
	mux.Handle("/files/", e.handler)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "mcp", http.StatusTeapot) })
	muxSrv := httptest.NewServer(mux)
	defer muxSrv.Close()
	icSrv := httptest.NewServer(e.handler.Intercept(mux))
	defer icSrv.Close()

	cleaned := []string{
		"/files/" + idA + "/out//data.csv" + qs,
		"/files/" + idA + "/x/../out/data.csv" + qs,
		"/files/" + idA + "/./out/data.csv" + qs,
		"/files/" + idB + "/../" + idA + "/out/data.csv" + qs,
	}
	for _, target := range cleaned {
		resp, _ := raw(t, muxSrv.URL, "GET", target)
		if resp.StatusCode != http.StatusTemporaryRedirect && resp.StatusCode != http.StatusMovedPermanently {
			t.Errorf("ServeMux no longer redirects %q (got %d): revisit the Handler mounting doc", target, resp.StatusCode)
		}
		if resp, _ := raw(t, icSrv.URL, "GET", target); resp.StatusCode != 403 {
			t.Errorf("Intercept %q: %d, want 403", target, resp.StatusCode)
		}
	}
	// Encoded forms reach the handler either way and are refused.
	for _, target := range []string{
		"/files/" + idA + "/out%2Fdata.csv" + qs,
		"/files/" + idA + "/%2e%2e/" + idA + "/out/data.csv" + qs,
	} {
		for _, u := range []string{muxSrv.URL, icSrv.URL} {
			if resp, _ := raw(t, u, "GET", target); resp.StatusCode != 403 {
				t.Errorf("%s %q: %d", u, target, resp.StatusCode)
			}
		}
	}
	// The valid URL works through both; other paths still reach the mux.
	for _, u := range []string{muxSrv.URL, icSrv.URL} {
		if resp, body := raw(t, u, "GET", tg); resp.StatusCode != 200 || body != "A" {
			t.Errorf("%s valid: %d", u, resp.StatusCode)
		}
		if resp, _ := raw(t, u, "GET", "/mcp"); resp.StatusCode != 418 {
			t.Errorf("%s /mcp: %d", u, resp.StatusCode)
		}
	}
	if resp, _ := raw(t, icSrv.URL, "GET", "/files"); resp.StatusCode != 403 {
		t.Errorf("Intercept /files: %d", resp.StatusCode)
	}
}

func TestLogsNeverContainSig(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	writeFile(t, filepath.Join(dir, "f.txt"), "x")
	tg := e.target(t, idA, "f.txt")
	_, _, _, sig := splitTarget(t, tg)
	status(t, e.srv.URL, tg)
	status(t, e.srv.URL, tg+"&x=1")
	status(t, e.srv.URL, e.target(t, idA, "missing"))
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.logs) != 3 {
		t.Fatalf("logs: %q", e.logs)
	}
	for _, l := range e.logs {
		if strings.Contains(l, sig) || strings.Contains(l, sig[:16]) {
			t.Fatalf("signature logged: %s", l)
		}
	}
	if !strings.HasPrefix(e.logs[0], "files.served") || !strings.HasPrefix(e.logs[1], "files.denied") ||
		!strings.HasPrefix(e.logs[2], "files.not_found") {
		t.Fatalf("events: %q", e.logs)
	}
}

func TestSignerErrors(t *testing.T) {
	keys, _ := NewKeyring(master(1))
	s := &Signer{Keys: keys, BaseURL: "https://files.example.com/", Now: func() time.Time { return t0 }}
	u, exp, err := s.URL(idA, "a b/c.txt")
	if err != nil || !strings.HasPrefix(u, "https://files.example.com/files/"+idA+"/a%20b/c.txt?exp=") || !exp.Equal(t0.Add(time.Hour)) {
		t.Fatalf("%s %v %v", u, exp, err)
	}
	for _, c := range []struct {
		id, p string
		code  brokererr.Code
	}{
		{"", "x", brokererr.InvalidInput},
		{strings.ToUpper(idA), "x", brokererr.InvalidInput},
		{idA, "../x", brokererr.PathTraversal},
		{idA, "/etc/passwd", brokererr.PathTraversal},
		{idA, "a//b", brokererr.PathTraversal},
		{idA, "100%.txt", brokererr.InvalidInput},
		{idA, "", brokererr.InvalidInput},
	} {
		if _, _, err := s.URL(c.id, c.p); brokererr.CodeOf(err) != c.code {
			t.Errorf("URL(%q, %q): %v, want %s", c.id, c.p, err, c.code)
		}
		if _, _, err := s.UploadURL(c.id, c.p, 1, false); brokererr.CodeOf(err) != c.code {
			t.Errorf("UploadURL(%q, %q): %v, want %s", c.id, c.p, err, c.code)
		}
	}
	// An upload link takes at least one byte (0 would mean "no limit" to
	// the writer).
	if _, _, err := s.UploadURL(idA, "x", 0, false); brokererr.CodeOf(err) != brokererr.InvalidInput {
		t.Errorf("UploadURL with max 0: %v", err)
	}
	// Nor does a correctly signed link that says otherwise verify.
	for _, extra := range [][]param{{{"max", "0"}, {"ow", "0"}}, {{"max", "1"}, {"ow", "2"}}} {
		u, _, err := s.sign(http.MethodPut, idA, "x", time.Minute, extra)
		if err != nil {
			t.Fatal(err)
		}
		pu, _ := url.Parse(u)
		if _, err := s.VerifyUpload(pu.EscapedPath(), pu.RawQuery); err == nil {
			t.Errorf("VerifyUpload accepted %s", pu.RawQuery)
		}
	}
	for _, bad := range []*Signer{
		{Keys: keys, BaseURL: "files.example.com"},
		{Keys: keys, BaseURL: "ftp://x"},
		{Keys: keys, BaseURL: "https://x/?a=b"},
		{Keys: keys, BaseURL: "https://u:p@x"},
		{Keys: keys, BaseURL: "https://x", TTL: 2 * time.Hour, MaxTTL: time.Hour},
		{BaseURL: "https://x"},
	} {
		if _, _, err := bad.URL(idA, "x"); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
	// No base URL (stdio without PUBLIC_BASE_URL) is a typed, final answer
	// that callers can tell from a fault.
	for _, sign := range []func(s *Signer) error{
		func(s *Signer) error { _, _, err := s.URL(idA, "x"); return err },
		func(s *Signer) error { _, _, err := s.PreviewURL(idA); return err },
	} {
		e := brokererr.As(sign(&Signer{Keys: keys}))
		if e == nil || e.Code != brokererr.NotConfigured || e.Retryable || !strings.Contains(e.Message, "PUBLIC_BASE_URL") {
			t.Errorf("no BaseURL: %+v", e)
		}
	}
	// TTL is honoured and verified against MaxTTL.
	s2 := &Signer{Keys: keys, BaseURL: "https://x", TTL: 10 * time.Minute, MaxTTL: 15 * time.Minute, Now: func() time.Time { return t0 }}
	u, _, _ = s2.URL(idA, "f")
	pu, _ := url.Parse(u)
	if _, err := s2.Verify(pu.EscapedPath(), pu.RawQuery); err != nil {
		t.Fatal(err)
	}
	s3 := *s2
	s3.MaxTTL = 5 * time.Minute
	if _, err := s3.Verify(pu.EscapedPath(), pu.RawQuery); err == nil {
		t.Fatal("exp beyond a shorter MaxTTL accepted")
	}
}

func TestKeyring(t *testing.T) {
	if _, err := NewKeyring(make([]byte, 31)); err == nil {
		t.Fatal("short master accepted")
	}
	if _, err := NewKeyring(master(1), make([]byte, 8)); err == nil {
		t.Fatal("short previous master accepted")
	}
	k, err := NewKeyring(master(1), master(2), master(1))
	if err != nil {
		t.Fatal(err)
	}
	if len(k.ActiveKID()) != 8 || !k.Accepts(k.ActiveKID()) || len(k.keys) != 2 {
		t.Fatalf("%q %d", k.ActiveKID(), len(k.keys))
	}
	k2, _ := NewKeyring(master(1))
	if k2.ActiveKID() != k.ActiveKID() {
		t.Fatal("kid not deterministic")
	}
	// The derived key is not the master.
	if key, _ := k.key(k.ActiveKID()); bytes.Equal(key, master(1)) {
		t.Fatal("key not derived")
	}
	k3, err := NewKeyringKeys(Key{KID: "2026-01", Master: master(3)}, Key{KID: "2025-12", Master: master(4)})
	if err != nil || k3.ActiveKID() != "2026-01" || !k3.Accepts("2025-12") || k3.Accepts("2025-11") {
		t.Fatalf("%v", err)
	}
	if _, err := NewKeyringKeys(Key{KID: "a", Master: master(3)}, Key{KID: "a", Master: master(4)}); err == nil {
		t.Fatal("kid collision accepted")
	}
	if _, err := NewKeyringKeys(Key{KID: "a&sig=x", Master: master(3)}); err == nil {
		t.Fatal("bad kid accepted")
	}
}

func TestLoadOrCreateSecret(t *testing.T) {
	dir := t.TempDir()
	var wg sync.WaitGroup
	got := make([][]byte, 8)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, err := LoadOrCreateSecret(dir)
			if err != nil {
				t.Error(err)
			}
			got[i] = b
		}()
	}
	wg.Wait()
	for _, b := range got {
		if len(b) != 32 || !bytes.Equal(b, got[0]) {
			t.Fatalf("secrets differ: %x vs %x", b, got[0])
		}
	}
	name := filepath.Join(dir, "keys", "file_secret")
	fi, err := os.Stat(name)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("%v %v", fi.Mode(), err)
	}
	if di, _ := os.Stat(filepath.Join(dir, "keys")); di.Mode().Perm() != 0o700 {
		t.Fatalf("keys dir mode %v", di.Mode())
	}
	ents, _ := os.ReadDir(filepath.Join(dir, "keys"))
	if len(ents) != 1 {
		t.Fatalf("leftover temp files: %v", ents)
	}
	again, err := LoadOrCreateSecret(dir)
	if err != nil || !bytes.Equal(again, got[0]) {
		t.Fatal("not reloaded")
	}

	// Refusals: group-readable, too short, symlink.
	_ = os.Chmod(name, 0o640)
	if _, err := LoadOrCreateSecret(dir); err == nil {
		t.Fatal("group-readable secret accepted")
	}
	_ = os.Chmod(name, 0o600)
	_ = os.WriteFile(name, []byte("short"), 0o600)
	if _, err := LoadOrCreateSecret(dir); err == nil {
		t.Fatal("short secret accepted")
	}
	other := filepath.Join(t.TempDir(), "s")
	_ = os.WriteFile(other, master(7), 0o600)
	_ = os.Remove(name)
	_ = os.Symlink(other, name)
	if _, err := LoadOrCreateSecret(dir); err == nil {
		t.Fatal("symlinked secret accepted")
	}
}

func TestEscapeRFC5987(t *testing.T) {
	if got := escapeRFC5987("a b\"';\r\né.txt"); got != "a%20b%22%27%3B%0D%0A%C3%A9.txt" {
		t.Fatal(got)
	}
}

func TestUnescapePath(t *testing.T) {
	for esc, want := range map[string]string{
		"a.txt":               "a.txt",
		"out/a%20b/c.txt":     "out/a b/c.txt",
		"caf%C3%A9.txt":       "café.txt",
		"100%25.txt":          "100%.txt",
		"a+b=c@d:e$f&g.txt":   "a+b=c@d:e$f&g.txt",
		"%252e%252e/x":        "%2e%2e/x",
		"q%3F.txt":            "q?.txt",
		"semi%3Bcolon%2C.txt": "semi;colon,.txt",
	} {
		got, err := UnescapePath(esc)
		if err != nil || got != want || EscapePath(got) != esc {
			t.Errorf("UnescapePath(%q) = %q, %v; want %q", esc, got, err, want)
		}
	}
	for _, esc := range []string{"", "%2e%2e/x", "..", "a/../b", "a%2Fb", "a%2fb", "/etc/passwd", "a//b", "a/",
		"x%00", "%0a", "a%5Cb", "caf%c3%a9", "%61", "a b", "%zz", "%", "%ff", "a;b"} {
		if got, err := UnescapePath(esc); err == nil || brokererr.As(err) == nil {
			t.Errorf("UnescapePath(%q) = %q, %v; want a typed refusal", esc, got, err)
		}
	}
}

// FuzzVerifyURL mutates signed URLs and random input: nothing panics, and
// nothing gets 200 except the exact URL the signer produced (its query
// parameters may only be reordered).
func FuzzVerifyURL(f *testing.F) {
	root := f.TempDir()
	dir := filepath.Join(root, "workspaces", idA)
	for name, data := range map[string]string{"out/data.csv": "A", "é x.txt": "B"} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			f.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			f.Fatal(err)
		}
	}
	keys, _ := NewKeyring(master(1), master(2))
	s := &Signer{Keys: keys, BaseURL: "https://f.example", Now: func() time.Time { return t0 }}
	h := &Handler{Signer: s, Root: root}
	type signed struct{ path, query string }
	var valid []signed
	for _, p := range []string{"out/data.csv", "é x.txt"} {
		u, _, err := s.URL(idA, p)
		if err != nil {
			f.Fatal(err)
		}
		pu, _ := url.Parse(u)
		valid = append(valid, signed{pu.EscapedPath(), pu.RawQuery})
		f.Add(pu.EscapedPath(), pu.RawQuery, "GET")
		f.Add(pu.EscapedPath()+"/", pu.RawQuery, "HEAD")
		f.Add(strings.ToUpper(pu.EscapedPath()), pu.RawQuery+"&x", "GET")
	}
	f.Add("/files/"+idA+"/%2e%2e/x", "exp=1&kid=a&sig=b", "GET")
	f.Add("/files//x", "", "POST")
	paramSet := func(q string) []string {
		ps := strings.Split(q, "&")
		slices.Sort(ps)
		return ps
	}
	f.Fuzz(func(t *testing.T, p, q, method string) {
		tg, err := s.Verify(p, q)
		isValid := false
		for _, v := range valid {
			if p == v.path && slices.Equal(paramSet(q), paramSet(v.query)) {
				isValid = true
			}
		}
		if err == nil && !isValid {
			t.Fatalf("Verify accepted unsigned %q ? %q -> %+v", p, q, tg)
		}
		u, perr := url.ParseRequestURI(p + "?" + q)
		if perr != nil || method == "" || strings.ContainsAny(method, " \r\n") {
			return
		}
		r := &http.Request{Method: method, URL: u, Header: http.Header{}, RequestURI: p + "?" + q}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		if rec.Code == 200 && !isValid {
			t.Fatalf("200 for unsigned %s %q", method, p+"?"+q)
		}
		if rec.Code == 200 && method != "GET" && method != "HEAD" {
			t.Fatalf("200 for method %q", method)
		}
	})
}

// TestSizeCapHoldsWhileTheFileFlips: a sandbox flips a file between under
// and over the cap while downloads run. The handler checks the size once
// and must serve at most that many bytes, whatever ServeContent would
// measure later (issue 15: a 250 MiB Content-Length got through the 64 MiB
// cap).
func TestSizeCapHoldsWhileTheFileFlips(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	const limit = 1 << 20
	e.handler.MaxFileBytes = limit
	name := filepath.Join(dir, "flip.bin")
	writeFile(t, name, "")
	stop := make(chan struct{})
	flipped := make(chan struct{})
	go func() { // sparse files: no disk is used
		defer close(flipped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = os.Truncate(name, limit/2)
			_ = os.Truncate(name, 250<<20)
		}
	}()
	defer func() { close(stop); <-flipped }()

	target := e.srv.URL + e.target(t, idA, "flip.bin")
	served := 0
	for i := 0; i < 400; i++ {
		resp, err := http.Get(target)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode == http.StatusOK {
			served++
			if resp.ContentLength > limit {
				t.Errorf("request %d: Content-Length %d is over the %d cap", i, resp.ContentLength, limit)
			}
		}
		n, _ := io.Copy(io.Discard, io.LimitReader(resp.Body, limit+1))
		resp.Body.Close()
		if n > limit {
			t.Fatalf("request %d: %d bytes served, over the %d cap", i, n, limit)
		}
	}
	if served == 0 {
		t.Fatal("no request was served: the flip loop never left the file under the cap")
	}
}

// TestClockSteppedBack: a link signed before the wall clock is stepped back
// is never valid for longer than MaxTTL (plus the skew allowance) as the
// clock then reads: a step past that refuses it until the clock catches
// up, and it expires at its own exp, so no link outlives a step by more
// than MaxTTL - TTL.
func TestClockSteppedBack(t *testing.T) {
	keys, _ := NewKeyring(master(1))
	now := t0
	s := &Signer{Keys: keys, BaseURL: "https://f.example", TTL: 10 * time.Minute, MaxTTL: time.Hour, Now: func() time.Time { return now }}
	u, exp, err := s.URL(idA, "f.txt")
	if err != nil {
		t.Fatal(err)
	}
	pu, _ := url.Parse(u)
	verify := func() error { _, err := s.Verify(pu.EscapedPath(), pu.RawQuery); return err }
	previewURL, _, err := s.PreviewURL(idA)
	if err != nil {
		t.Fatal(err)
	}
	pv, _ := url.Parse(previewURL)
	verifyPreview := func() error { _, err := s.VerifyPreview(idA, pv.RawQuery); return err }
	for _, c := range []struct {
		step time.Duration
		ok   bool
	}{
		{-30 * time.Minute, true},                                        // within MaxTTL of exp
		{-(time.Hour - 10*time.Minute + ClockSkew), true},                // exactly at the bound
		{-(time.Hour - 10*time.Minute + ClockSkew + time.Second), false}, // past it
		{-48 * time.Hour, false},
		{10*time.Minute - time.Second, true}, // forward, before exp
		{10 * time.Minute, true},             // exp itself
		{10*time.Minute + time.Second, false},
	} {
		now = t0.Add(c.step)
		if err := verify(); (err == nil) != c.ok {
			t.Errorf("step %v: Verify = %v, want ok=%v (exp %v)", c.step, err, c.ok, exp)
		}
		if err := verifyPreview(); (err == nil) != c.ok {
			t.Errorf("step %v: VerifyPreview = %v, want ok=%v", c.step, err, c.ok)
		}
	}
}

// TestNilSigner: a signer without keys refuses everything, without panics.
func TestNilSigner(t *testing.T) {
	for _, s := range []*Signer{nil, {}} {
		if _, _, err := s.URL(idA, "x"); err == nil {
			t.Error("URL signed without keys")
		}
		if _, _, err := s.UploadURL(idA, "x", 1, false); err == nil {
			t.Error("UploadURL signed without keys")
		}
		if _, err := s.Verify("/files/"+idA+"/x", "exp=1&kid=a&sig=b"); err == nil {
			t.Error("Verify without keys")
		}
		if _, err := s.VerifyUpload("/files/"+idA+"/x", "exp=1&kid=a&max=1&ow=0&sig=b"); err == nil {
			t.Error("VerifyUpload without keys")
		}
		if _, err := s.VerifyPreview(idA, "exp=1&kid=a&sig=b"); err == nil {
			t.Error("VerifyPreview without keys")
		}
	}
}
