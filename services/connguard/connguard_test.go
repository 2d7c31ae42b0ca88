package connguard

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"sync"
	"testing"
	"time"
)

type fixture struct {
	t       *testing.T
	l       *Listener
	mu      sync.Mutex
	reasons []string
}

func newFixture(t *testing.T, lim Limits) *fixture {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{t: t, l: New(ln, lim)}
	f.l.OnClose = func(r string) { f.mu.Lock(); f.reasons = append(f.reasons, r); f.mu.Unlock() }
	t.Cleanup(func() { ln.Close() })
	return f
}

// dial connects from src and returns the client end with the server end
// the listener accepted for it.
func (f *fixture) dial(src string) (client net.Conn, server net.Conn) {
	f.t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	client, err := d.Dial("tcp", f.l.Addr().String())
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { client.Close() })
	server, err = f.l.Accept()
	if err != nil {
		f.t.Fatal(err)
	}
	return client, server
}

func (f *fixture) trust(server net.Conn) {
	Trust(f.l.ConnContext(context.Background(), server))
}

// closedByServer reports whether the server closed the client's connection.
func closedByServer(t *testing.T, c net.Conn) bool {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return false
	}
	return err != nil
}

// stillOpen checks that the server has not closed c, without waiting long.
func stillOpen(t *testing.T, c net.Conn) bool {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func (f *fixture) wantStats(open, untrusted int) {
	f.t.Helper()
	if o, u := f.l.Stats(); o != open || u != untrusted {
		f.t.Fatalf("Stats = %d open, %d untrusted; want %d, %d", o, u, open, untrusted)
	}
}

func TestPerAddressCapClosesThatAddressesOldest(t *testing.T) {
	f := newFixture(t, Limits{MaxConns: 100, MaxUntrustedPerAddr: 2})
	a1, _ := f.dial("127.0.0.2")
	a2, _ := f.dial("127.0.0.2")
	b1, _ := f.dial("127.0.0.3")
	a3, _ := f.dial("127.0.0.2") // closes a1, not b1
	if !closedByServer(t, a1) {
		t.Fatal("the address's oldest untrusted connection stayed open")
	}
	for _, c := range []net.Conn{a2, a3, b1} {
		if !stillOpen(t, c) {
			t.Fatal("a connection within its address's cap was closed")
		}
	}
	f.wantStats(3, 3)
	if !slices.Equal(f.reasons, []string{"address_limit"}) {
		t.Fatalf("reasons %q", f.reasons)
	}
}

func TestTrustedConnectionsDoNotCountPerAddress(t *testing.T) {
	f := newFixture(t, Limits{MaxConns: 100, MaxUntrustedPerAddr: 1})
	a1, s1 := f.dial("127.0.0.2")
	f.trust(s1)
	a2, _ := f.dial("127.0.0.2")
	f.wantStats(2, 1)
	a3, _ := f.dial("127.0.0.2") // closes a2, the untrusted one
	if !closedByServer(t, a2) || !stillOpen(t, a1) || !stillOpen(t, a3) {
		t.Fatal("the wrong connection was closed")
	}
}

func TestAtCapUntrustedGoFirstThenIdleTrusted(t *testing.T) {
	f := newFixture(t, Limits{MaxConns: 3, MaxUntrustedPerAddr: 100})
	t1, s1 := f.dial("127.0.0.2")
	f.trust(s1)
	u1, _ := f.dial("127.0.0.3")
	u2, _ := f.dial("127.0.0.4")
	n1, sn1 := f.dial("127.0.0.5") // full: closes u1, the oldest untrusted
	if !closedByServer(t, u1) || !stillOpen(t, t1) || !stillOpen(t, u2) || !stillOpen(t, n1) {
		t.Fatal("at the cap the oldest untrusted connection must go")
	}
	f.trust(sn1)
	n2, sn2 := f.dial("127.0.0.5") // closes u2
	if !closedByServer(t, u2) {
		t.Fatal("u2 stayed open")
	}
	f.trust(sn2)
	f.wantStats(3, 0)

	// All trusted and busy: the newcomer is refused.
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := f.l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.6")}}
	x, err := d.Dial("tcp", f.l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	if !closedByServer(t, x) {
		t.Fatal("a connection beyond the cap was kept while every slot was busy")
	}
	// One trusted connection goes idle: the next newcomer takes its place.
	f.l.ConnState(s1, http.StateIdle)
	y, err := d.Dial("tcp", f.l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer y.Close()
	select {
	case <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("no room was made by closing the idle trusted connection")
	}
	if !closedByServer(t, t1) || !stillOpen(t, n1) || !stillOpen(t, n2) {
		t.Fatal("the idle trusted connection should have been the one closed")
	}
	if want := []string{"evicted", "evicted", "full", "evicted"}; !slices.Equal(f.reasons, want) {
		t.Fatalf("reasons %q, want %q", f.reasons, want)
	}
}

func TestClosingForgetsTheConnection(t *testing.T) {
	f := newFixture(t, Limits{MaxConns: 2, MaxUntrustedPerAddr: 2})
	_, s1 := f.dial("127.0.0.2")
	_, s2 := f.dial("127.0.0.2")
	f.trust(s2)
	s1.Close()
	s1.Close() // twice: counted once
	f.l.ConnState(s2, http.StateClosed)
	s2.Close()
	f.wantStats(0, 0)
	// Both slots are free again: no closing needed.
	c3, _ := f.dial("127.0.0.2")
	c4, _ := f.dial("127.0.0.2")
	if !stillOpen(t, c3) || !stillOpen(t, c4) || len(f.reasons) != 0 {
		t.Fatalf("slots not freed: %q", f.reasons)
	}
	// A context from another server is ignored.
	Trust(context.Background())
}

// TestWithHTTPServer: wired into an http.Server, a request that calls
// Trust keeps its keep-alive connection when untrusted ones crowd in.
func TestWithHTTPServer(t *testing.T) {
	f := newFixture(t, Limits{MaxConns: 4, MaxUntrustedPerAddr: 100})
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-Auth") == "ok" {
				Trust(r.Context())
			}
			_, _ = io.WriteString(w, "ok")
		}),
		ConnContext: f.l.ConnContext,
		ConnState:   f.l.ConnState,
	}
	go func() { _ = srv.Serve(f.l) }()
	t.Cleanup(func() { srv.Close() })
	hc := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
	defer hc.CloseIdleConnections()
	get := func() (reused bool) {
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused = i.Reused }}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace),
			http.MethodGet, "http://"+f.l.Addr().String()+"/", nil)
		req.Header.Set("X-Auth", "ok")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return reused
	}
	get()
	for i := 0; i < 10; i++ { // silent untrusted connections, more than the cap
		c, err := net.Dial("tcp", f.l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if open, untrusted := f.l.Stats(); open == 4 && untrusted == 3 {
			break
		}
		if time.Now().After(deadline) {
			o, u := f.l.Stats()
			t.Fatalf("Stats = %d, %d; want 4 open with 3 untrusted", o, u)
		}
	}
	if !get() {
		t.Fatal("the trusted keep-alive connection was closed for untrusted ones")
	}
}

func TestAddrKey(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1:80":               "127.0.0.1",
		"[::ffff:10.0.0.1]:80":       "10.0.0.1",
		"[2001:db8:1:2:3:4:5:6]:443": "2001:db8:1:2::/64",
		"[2001:db8:1:2:ffff::1]:1":   "2001:db8:1:2::/64",
		"[fe80::1%eth0]:1":           "fe80::/64",
		"@unix":                      "@unix",
	} {
		if got := AddrKey(in); got != want {
			t.Errorf("AddrKey(%q) = %q, want %q", in, got, want)
		}
	}
}
