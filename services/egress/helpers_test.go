package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// Public-looking addresses the fake resolver hands out. No packet ever goes
// to them: fakeDialer routes each to a loopback test server.
const (
	pubA = "93.184.215.14"
	pubB = "2606:2800:21f:cb07:6820:80da:af6b:8b2c"
)

// fakeResolver answers from a table. A host with several answers returns
// them in turn (the last one repeats), which models DNS rebinding. The
// proxy must ask for rooted names ("example.com."), so that no search
// domain is appended; an unrooted query fails.
type fakeResolver struct {
	mu      sync.Mutex
	answers map[string][][]string
	calls   map[string]int
}

func newResolver() *fakeResolver {
	return &fakeResolver{answers: map[string][][]string{}, calls: map[string]int{}}
}

func (r *fakeResolver) set(host string, answers ...[]string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.answers[host] = answers
}

func (r *fakeResolver) LookupIPAddr(ctx context.Context, host string) ([]net.IPAddr, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !strings.HasSuffix(host, ".") {
		return nil, &net.DNSError{Err: "fake resolver: unrooted query", Name: host}
	}
	host = strings.TrimSuffix(host, ".")
	n := r.calls[host]
	r.calls[host] = n + 1
	seq := r.answers[host]
	if len(seq) == 0 {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	ans := seq[min(n, len(seq)-1)]
	out := make([]net.IPAddr, 0, len(ans))
	for _, a := range ans {
		out = append(out, net.IPAddr{IP: net.IP(netip.MustParseAddr(a).AsSlice())})
	}
	return out, nil
}

func (r *fakeResolver) count(host string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[host]
}

func (r *fakeResolver) total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, c := range r.calls {
		n += c
	}
	return n
}

// fakeDialer records every dial and redirects known "ip:port" addresses to
// loopback servers; anything else fails without touching the network.
type fakeDialer struct {
	mu     sync.Mutex
	routes map[string]string
	calls  []string
}

func newDialer() *fakeDialer { return &fakeDialer{routes: map[string]string{}} }

func (d *fakeDialer) route(from, to string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.routes[from] = to
}

func (d *fakeDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	d.mu.Lock()
	d.calls = append(d.calls, addr)
	to, ok := d.routes[addr]
	d.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("fake dialer: no route to %s", addr)
	}
	if ap := netip.MustParseAddrPort(to); !ap.Addr().IsLoopback() {
		panic("fake dialer route leaves loopback: " + to)
	}
	var nd net.Dialer
	return nd.DialContext(ctx, "tcp", to)
}

func (d *fakeDialer) dialed() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.calls...)
}

// syncBuf is a goroutine-safe log sink.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// harness is one proxy served on a real Unix socket, as in production.
type harness struct {
	p     *Proxy
	sock  string
	res   *fakeResolver
	dial  *fakeDialer
	logs  *syncBuf
	ln    net.Listener
	done  chan error
	decMu sync.Mutex
	decs  []Decision
	decCh chan struct{} // one token per decision
	freed chan struct{} // one token per connection slot given back
}

func newHarness(t *testing.T, pol Policy, mod func(*Options)) *harness {
	t.Helper()
	dir, err := os.MkdirTemp("", "egr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	h := &harness{sock: filepath.Join(dir, "p.sock"), res: newResolver(), dial: newDialer(), logs: &syncBuf{}, done: make(chan error, 1),
		decCh: make(chan struct{}, 1024), freed: make(chan struct{}, 1024)}
	o := Options{
		Policy:   pol,
		Resolver: h.res,
		Dialer:   h.dial,
		Log:      zerolog.New(h.logs),
		OnDecision: func(d Decision) {
			h.decMu.Lock()
			h.decs = append(h.decs, d)
			h.decMu.Unlock()
			h.decCh <- struct{}{}
		},
	}
	if mod != nil {
		mod(&o)
	}
	h.p, err = New(o)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	h.p.afterRelease = func() { h.freed <- struct{}{} }
	h.ln, err = net.Listen("unix", h.sock)
	if err != nil {
		t.Fatal(err)
	}
	go func() { h.done <- h.p.Serve(h.ln) }()
	t.Cleanup(h.stop(t))
	return h
}

func (h *harness) stop(t *testing.T) func() {
	return func() {
		_ = h.ln.Close()
		select {
		case err := <-h.done:
			if err != nil {
				t.Errorf("Serve returned %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("Serve did not return after its listener closed")
		}
		h.done <- nil // later stop calls see a return too
	}
}

func (h *harness) decisions() []Decision {
	h.decMu.Lock()
	defer h.decMu.Unlock()
	return append([]Decision(nil), h.decs...)
}

// waitDecisions waits until at least n decisions were reported.
func (h *harness) waitDecisions(t *testing.T, n int) []Decision {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		d := h.decisions()
		if len(d) >= n {
			return d
		}
		select {
		case <-h.decCh:
		case <-timeout:
			t.Fatalf("got %d decisions, want %d: %+v", len(d), n, d)
		}
	}
}

// waitFreed waits until n more connection slots were given back.
func (h *harness) waitFreed(t *testing.T, n int) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for i := 0; i < n; i++ {
		select {
		case <-h.freed:
		case <-timeout:
			t.Fatalf("%d of %d connection slots freed", i, n)
		}
	}
}

func (h *harness) conn(t *testing.T) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("unix", h.sock, 5*time.Second)
	if err != nil {
		t.Fatalf("dial proxy: %v", err)
	}
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// raw sends one raw request and reads the proxy's answer.
func (h *harness) raw(t *testing.T, req string) (*http.Response, string, net.Conn, *bufio.Reader) {
	t.Helper()
	c := h.conn(t)
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatalf("write: %v", err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("read response to %q: %v", firstLine(req), err)
	}
	var body string
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(req, "CONNECT") {
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
	}
	return resp, body, c, br
}

func firstLine(s string) string {
	if i := strings.Index(s, "\r\n"); i >= 0 {
		return s[:i]
	}
	return s
}

// client is an http.Client that reaches the proxy over its Unix socket,
// the way a sandboxed tool honouring HTTP(S)_PROXY would.
func (h *harness) client(roots *x509.CertPool) *http.Client {
	return &http.Client{
		Timeout: 20 * time.Second,
		Transport: &http.Transport{
			Proxy: http.ProxyURL(&url.URL{Scheme: "http", Host: "proxy.invalid:3128"}),
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", h.sock)
			},
			TLSClientConfig:   &tls.Config{RootCAs: roots},
			DisableKeepAlives: true,
		},
	}
}

// sink is an upstream that records how many bytes it ever received.
type sink struct {
	ln  net.Listener
	got chan int
}

func newSink(t *testing.T) *sink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &sink{ln: ln, got: make(chan int, 16)}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(30 * time.Second))
				n, _ := io.Copy(io.Discard, c)
				s.got <- int(n)
			}()
		}
	}()
	t.Cleanup(func() { _ = ln.Close() })
	return s
}

func (s *sink) addr() string { return s.ln.Addr().String() }

// echo is an upstream that echoes what it receives.
func newEcho(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	t.Cleanup(func() { _ = ln.Close() })
	return ln.Addr().String()
}

// expectClosed reads from c until the proxy closes it.
func expectClosed(t *testing.T, c net.Conn, r io.Reader) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := io.Copy(io.Discard, r)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("proxy did not close the connection")
	}
}

func allowPolicy(t *testing.T, allowed []string, denied ...string) Policy {
	t.Helper()
	p, err := Policy{Mode: ModeAllow, Allowed: allowed, Denied: denied}.Normalize()
	if err != nil {
		t.Fatalf("policy: %v", err)
	}
	return p
}
