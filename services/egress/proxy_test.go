package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// recorded is what a test upstream saw of one request.
type recorded struct {
	host, uri, body string
	header          http.Header
}

func newHTTPUpstream(t *testing.T) (*httptest.Server, <-chan recorded) {
	t.Helper()
	ch := make(chan recorded, 16)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		ch <- recorded{host: r.Host, uri: r.RequestURI, body: string(b), header: r.Header.Clone()}
		w.Header().Set("X-Upstream", "yes")
		_, _ = io.WriteString(w, "hello from upstream")
	}))
	t.Cleanup(srv.Close)
	return srv, ch
}

func hostOf(srv *httptest.Server) string {
	return strings.TrimPrefix(strings.TrimPrefix(srv.URL, "http://"), "https://")
}

func TestHTTPAllowListForwardsRebuiltRequest(t *testing.T) {
	srv, got := newHTTPUpstream(t)
	h := newHarness(t, allowPolicy(t, []string{"example.com"}), nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", hostOf(srv))

	req, _ := http.NewRequest(http.MethodPost, "http://EXAMPLE.com./p/a%2Fb?q=1&r=2", strings.NewReader("body-bytes"))
	req.Header.Set("Proxy-Authorization", "Basic c2VjcmV0")
	req.Header.Set("Connection", "X-Drop-Me")
	req.Header.Set("X-Drop-Me", "1")
	req.Header.Set("X-Keep", "2")
	resp, err := h.client(nil).Do(req)
	if err != nil {
		t.Fatalf("request: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "hello from upstream" || resp.Header.Get("X-Upstream") != "yes" {
		t.Fatalf("response %d %q %v", resp.StatusCode, body, resp.Header)
	}
	r := <-got
	if r.host != "example.com" {
		t.Errorf("upstream Host = %q, want example.com", r.host)
	}
	if r.uri != "/p/a%2Fb?q=1&r=2" {
		t.Errorf("upstream request-target = %q", r.uri)
	}
	if r.body != "body-bytes" {
		t.Errorf("upstream body = %q", r.body)
	}
	if r.header.Get("Proxy-Authorization") != "" || r.header.Get("X-Drop-Me") != "" || r.header.Get("X-Keep") != "2" {
		t.Errorf("upstream headers %v", r.header)
	}
	if d := h.dial.dialed(); len(d) != 1 || d[0] != pubA+":80" {
		t.Errorf("dials %v, want only the checked IP %s:80", d, pubA)
	}
	ds := h.waitDecisions(t, 1)
	if want := (Decision{Kind: "http", Host: "example.com", Port: 80, Allowed: true, Reason: ReasonAllowed}); ds[0] != want {
		t.Errorf("decision %+v, want %+v", ds[0], want)
	}
	if !strings.Contains(h.logs.String(), `"message":"egress_allowed"`) {
		t.Errorf("no egress_allowed log event: %s", h.logs.String())
	}
	if h.p.Stats().Allowed != 1 || h.p.Stats().Bytes == 0 {
		t.Errorf("stats %+v", h.p.Stats())
	}
}

// TestHTTPHostHeaderCannotFront: the request line names an allowed host,
// the Host header another; upstream must see the allowed one only.
func TestHTTPHostHeaderCannotFront(t *testing.T) {
	srv, got := newHTTPUpstream(t)
	h := newHarness(t, allowPolicy(t, []string{"example.com"}), nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", hostOf(srv))
	resp, body, _, _ := h.raw(t, "GET http://example.com/x HTTP/1.1\r\nHost: evil.example\r\n\r\n")
	if resp.StatusCode != 200 || body != "hello from upstream" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	if r := <-got; r.host != "example.com" || r.uri != "/x" {
		t.Errorf("upstream saw Host %q target %q", r.host, r.uri)
	}
	// And the other way round: an allowed Host header does not help a
	// request line naming a host outside the list.
	resp, body, _, _ = h.raw(t, "GET http://evil.example/x HTTP/1.1\r\nHost: example.com\r\n\r\n")
	if resp.StatusCode != 403 || !strings.Contains(body, "evil.example is not in allowed_domains") {
		t.Errorf("%d %q", resp.StatusCode, body)
	}
}

// TestHTTPResponseHopHeadersStripped uses a raw upstream (net/http would
// rewrite Connection itself) that sends hop-by-hop headers and a chunked
// body with an interim 103 response first.
func TestHTTPResponseHopHeadersStripped(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = http.ReadRequest(bufio.NewReader(c))
		_, _ = io.WriteString(c, "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"+
			"HTTP/1.1 200 OK\r\nConnection: X-Secret-Hop, keep-alive\r\nKeep-Alive: timeout=5\r\nX-Secret-Hop: dropped\r\n"+
			"Proxy-Authenticate: Basic\r\nX-End: kept\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
	}()
	h := newHarness(t, Policy{Mode: ModePublic}, nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", ln.Addr().String())
	resp, body, _, _ := h.raw(t, "GET http://example.com/ HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 || body != "hello" || resp.Header.Get("X-End") != "kept" {
		t.Fatalf("%d %q %v", resp.StatusCode, body, resp.Header)
	}
	for _, k := range []string{"X-Secret-Hop", "Keep-Alive", "Proxy-Authenticate"} {
		if resp.Header.Get(k) != "" {
			t.Errorf("hop-by-hop header %s forwarded", k)
		}
	}
	if !resp.Close {
		t.Error("proxy response does not close the connection")
	}
}

func tlsUpstream(t *testing.T) (*httptest.Server, *x509.CertPool) {
	t.Helper()
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = fmt.Fprintf(w, "tls ok %s %s", r.Host, r.TLS.ServerName)
	}))
	t.Cleanup(srv.Close)
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	return srv, pool
}

func TestConnectTLSAllowListAndPublic(t *testing.T) {
	srv, pool := tlsUpstream(t)
	for _, pol := range []Policy{allowPolicy(t, []string{"*.example.com", "example.com"}), {Mode: ModePublic}} {
		t.Run(pol.String(), func(t *testing.T) {
			h := newHarness(t, pol, nil)
			h.res.set("example.com", []string{pubB, pubA})
			h.dial.route(net.JoinHostPort(pubB, "443"), hostOf(srv))
			h.dial.route(net.JoinHostPort(pubA, "443"), hostOf(srv))
			resp, err := h.client(pool).Get("https://example.com/x")
			if err != nil {
				t.Fatalf("GET via CONNECT: %v", err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(body) != "tls ok example.com example.com" {
				t.Fatalf("body %q", body)
			}
			if d := h.dial.dialed(); len(d) != 1 || d[0] != "["+pubB+"]:443" {
				t.Errorf("dials %v, want the first checked IP", d)
			}
			ds := h.waitDecisions(t, 1)
			if want := (Decision{Kind: "connect", Host: "example.com", Port: 443, Allowed: true, Reason: ReasonAllowed}); ds[0] != want {
				t.Errorf("decision %+v", ds[0])
			}
		})
	}
}

// connectThenTLS opens a tunnel and runs a real TLS client through it.
func connectThenTLS(t *testing.T, h *harness, authority string, cfg *tls.Config) error {
	t.Helper()
	resp, _, c, br := h.raw(t, "CONNECT "+authority+" HTTP/1.1\r\nHost: "+authority+"\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT %s: %d", authority, resp.StatusCode)
	}
	tc := tls.Client(&bufConn{Conn: c, r: br}, cfg)
	return tc.Handshake()
}

type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (b *bufConn) Read(p []byte) (int, error) { return b.r.Read(p) }

func TestConnectSNIChecks(t *testing.T) {
	_, pool := tlsUpstream(t)
	cases := []struct {
		name, sni, reason string
		skipVerify        bool
	}{
		{"mismatch", "other.example.org", ReasonSNIMismatch, false},
		{"lookalike", "example.com.evil.io", ReasonSNIMismatch, false},
		{"ip in sni", "", ReasonSNIMissing, true}, // Go omits SNI when ServerName is empty
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			up := newSink(t)
			h := newHarness(t, allowPolicy(t, []string{"example.com"}), nil)
			h.res.set("example.com", []string{pubA})
			h.dial.route(pubA+":443", up.addr())
			err := connectThenTLS(t, h, "example.com:443", &tls.Config{ServerName: c.sni, RootCAs: pool, InsecureSkipVerify: c.skipVerify}) //nolint:gosec // the handshake must fail anyway
			if err == nil {
				t.Fatal("TLS handshake through a mismatched tunnel succeeded")
			}
			if !strings.Contains(err.Error(), "access denied") {
				t.Errorf("client error %q, want the proxy's access_denied alert", err)
			}
			ds := h.waitDecisions(t, 1)
			if ds[0].Allowed || ds[0].Reason != c.reason || ds[0].Host != "example.com" {
				t.Errorf("decision %+v, want reason %s", ds[0], c.reason)
			}
			select {
			case n := <-up.got:
				if n != 0 {
					t.Errorf("upstream received %d bytes of a refused tunnel", n)
				}
			case <-time.After(10 * time.Second):
				t.Error("upstream connection was not closed")
			}
		})
	}
}

func TestConnectSNIMatchesCaseInsensitively(t *testing.T) {
	srv, pool := tlsUpstream(t)
	h := newHarness(t, allowPolicy(t, []string{"example.com"}), nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":443", hostOf(srv))
	if err := connectThenTLS(t, h, "Example.COM.:443", &tls.Config{ServerName: "EXAMPLE.com", RootCAs: pool}); err != nil {
		t.Fatalf("handshake: %v", err)
	}
	if ds := h.waitDecisions(t, 1); !ds[0].Allowed {
		t.Errorf("decision %+v", ds[0])
	}
}

func TestConnectNonTLSTo443Refused(t *testing.T) {
	up := newSink(t)
	h := newHarness(t, allowPolicy(t, []string{"example.com"}), nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":443", up.addr())
	resp, _, c, br := h.raw(t, "CONNECT example.com:443 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n")
	inner, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no readable refusal inside the tunnel: %v", err)
	}
	body, _ := io.ReadAll(inner.Body)
	if inner.StatusCode != 403 || !strings.Contains(string(body), "must start with a TLS ClientHello") {
		t.Errorf("%d %q", inner.StatusCode, body)
	}
	expectClosed(t, c, br)
	if ds := h.waitDecisions(t, 1); ds[0].Allowed || ds[0].Reason != ReasonNotTLS {
		t.Errorf("decision %+v", ds[0])
	}
	if n := <-up.got; n != 0 {
		t.Errorf("upstream got %d bytes", n)
	}
}

func TestConnectPlainOnPort80Tunnels(t *testing.T) {
	echo := newEcho(t)
	h := newHarness(t, allowPolicy(t, []string{"example.com"}), nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", echo)
	resp, _, c, br := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	_, _ = io.WriteString(c, "ping")
	buf := make([]byte, 4)
	if _, err := io.ReadFull(br, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo: %q %v", buf, err)
	}
}

// TestDeniedTargets covers catalogue cases 27, 28 and 30: every refusal is
// a 403 with a readable reason, and nothing is dialled.
func TestDeniedTargets(t *testing.T) {
	pub := Policy{Mode: ModePublic}
	allow := allowPolicy(t, []string{"example.com", "*.github.com"})
	cases := []struct {
		pol       Policy
		authority string
		reason    string
		msg       string
	}{
		{pub, "169.254.169.254:80", ReasonBlockedAddress, "169.254.169.254 is not a public address"},
		{pub, "[fd00:ec2::254]:443", ReasonBlockedAddress, "not a public address"},
		{pub, "100.100.100.200:443", ReasonBlockedAddress, "not a public address"},
		{pub, "[::ffff:169.254.169.254]:443", ReasonInvalidHost, "IPv4-mapped"},
		{pub, "[::ffff:a9fe:a9fe]:443", ReasonInvalidHost, "IPv4-mapped"},
		{pub, "[64:ff9b::a9fe:a9fe]:443", ReasonBlockedAddress, "not a public address"},
		{pub, "[2002:a9fe:a9fe::1]:443", ReasonBlockedAddress, "not a public address"},
		{pub, "[2001:0:4136:e378:8000:63bf:3fff:fdd2]:443", ReasonBlockedAddress, "not a public address"},
		{pub, "127.0.0.1:443", ReasonBlockedAddress, "not a public address"},
		{pub, "127.0.0.1:8080", ReasonPort, "port 8080 is not allowed"}, // the MCP port
		{pub, "[::ffff:127.0.0.1]:443", ReasonInvalidHost, "IPv4-mapped"},
		{pub, "255.255.255.255:443", ReasonBlockedAddress, "not a public address"},
		{pub, "224.0.0.1:443", ReasonBlockedAddress, "not a public address"},
		{pub, "[ff02::1]:443", ReasonBlockedAddress, "not a public address"},
		{pub, "192.0.2.1:443", ReasonBlockedAddress, "not a public address"},
		{pub, "[::]:443", ReasonBlockedAddress, "not a public address"},
		{pub, "localhost:443", ReasonInvalidHost, "two labels"},
		{pub, "[::1]:443", ReasonBlockedAddress, "not a public address"},
		{pub, "[0:0:0:0:0:0:0:1]:443", ReasonInvalidHost, "canonical"},
		{pub, "0.0.0.0:443", ReasonBlockedAddress, "not a public address"},
		{pub, "2130706433:443", ReasonInvalidHost, "number"},
		{pub, "0x7f000001:443", ReasonInvalidHost, "number"},
		{pub, "017700000001:443", ReasonInvalidHost, "number"},
		{pub, "0x7f.1:443", ReasonInvalidHost, "number"},
		{pub, "127.1:443", ReasonInvalidHost, "number"},
		{pub, "[fe80::1%25eth0]:443", ReasonInvalidHost, "canonical"},
		{pub, "example.com:22", ReasonPort, "example.com: port 22 is not allowed (rule: allowed ports: 80, 443)"},
		{allow, "evilgithub.com:443", ReasonNotAllowed, "evilgithub.com is not in allowed_domains (rule: allowed_domains [example.com, *.github.com])"},
		{allowPolicy(t, []string{"*.example.com"}, "*.bad.example.com"), "x.bad.example.com:443", ReasonDenied,
			`x.bad.example.com is in denied_domains (rule: denied_domains entry "*.bad.example.com")`},
		{allow, "github.com.evil.io:443", ReasonNotAllowed, "not in allowed_domains"},
		{allow, "github.com:443", ReasonNotAllowed, "not in allowed_domains"},
		{allow, "evil-example.com:443", ReasonNotAllowed, "not in allowed_domains"},
		{allow, "example.com.evil.com:443", ReasonNotAllowed, "not in allowed_domains"},
		{allow, "xn--xample-2of.com:443", ReasonNotAllowed, "not in allowed_domains"},
		{allow, "93.184.215.14:443", ReasonIPLiteral, "IP addresses are not allowed"},
		{allow, "example.com:22", ReasonPort, "port 22"},
		{allow, "example.com:8443", ReasonPort, "port 8443"},
		{Policy{Mode: ModeNone}, "example.com:443", ReasonNetworkNone, `example.com: network access is disabled for this sandbox (rule: network: "none")`},
	}
	for _, c := range cases {
		t.Run(c.authority, func(t *testing.T) {
			h := newHarness(t, c.pol, nil)
			h.res.set("example.com", []string{pubA})
			h.res.set("localhost", []string{"127.0.0.1"})
			for _, req := range []string{
				"CONNECT " + c.authority + " HTTP/1.1\r\nHost: " + c.authority + "\r\n\r\n",
				"GET http://" + c.authority + "/ HTTP/1.1\r\nHost: " + c.authority + "\r\n\r\n",
			} {
				resp, body, _, _ := h.raw(t, req)
				if resp.StatusCode != http.StatusForbidden {
					t.Errorf("%s: status %d, want 403 (%q)", firstLine(req), resp.StatusCode, body)
				}
				if !strings.HasPrefix(body, "egress denied: ") || !strings.Contains(body, c.msg) {
					t.Errorf("%s: body %q, want it to contain %q", firstLine(req), body, c.msg)
				}
				if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
					t.Errorf("content type %q", ct)
				}
			}
			for _, d := range h.waitDecisions(t, 2) {
				// The decision names the rule the body names.
				if d.Allowed || d.Reason != c.reason || d.Rule == "" ||
					strings.Contains(c.msg, "(rule: ") && !strings.Contains(c.msg, "(rule: "+d.Rule+")") {
					t.Errorf("decision %+v, want reason %s and the rule in %q", d, c.reason, c.msg)
				}
			}
			if d := h.dial.dialed(); len(d) != 0 {
				t.Errorf("dialer was called: %v", d)
			}
			if c.pol.Mode == ModeNone && h.res.total() != 0 {
				t.Error("network none still resolved a name")
			}
		})
	}
}

// TestResolvedAddressChecks covers catalogue case 29: names that resolve to
// blocked space, a mixed answer and a rebinding resolver.
func TestResolvedAddressChecks(t *testing.T) {
	srv, _ := newHTTPUpstream(t)
	h := newHarness(t, allowPolicy(t, []string{"*.example.com"}), nil)
	h.dial.route(pubA+":80", hostOf(srv))
	h.res.set("meta.example.com", []string{"169.254.169.254"})
	h.res.set("nat64.example.com", []string{"64:ff9b::a9fe:a9fe"})
	h.res.set("mapped.example.com", []string{"::ffff:10.1.2.3"})
	h.res.set("mixed.example.com", []string{pubA, "10.0.0.7"})
	h.res.set("mixed6.example.com", []string{pubA, "fd00:ec2::254"})
	h.res.set("rebind.example.com", []string{pubA}, []string{"127.0.0.1"})
	get := func(host string) (int, string) {
		resp, body, _, _ := h.raw(t, "GET http://"+host+"/ HTTP/1.1\r\nHost: "+host+"\r\n\r\n")
		return resp.StatusCode, body
	}
	for _, host := range []string{"meta.example.com", "nat64.example.com", "mapped.example.com", "mixed.example.com", "mixed6.example.com"} {
		status, body := get(host)
		if status != 403 || body != "egress denied: "+host+" resolves to a non-public address (rule: non-public addresses are always refused)\n" {
			t.Errorf("%s: %d %q", host, status, body)
		}
	}
	if d := h.dial.dialed(); len(d) != 0 {
		t.Fatalf("dialer called for blocked answers: %v", d)
	}
	if status, _ := get("rebind.example.com"); status != 200 {
		t.Fatalf("rebind first answer (public): %d", status)
	}
	if status, body := get("rebind.example.com"); status != 403 || strings.Contains(body, "127.0.0.1") {
		t.Fatalf("rebind second answer (loopback): %d %q", status, body)
	}
	if d := h.dial.dialed(); len(d) != 1 || d[0] != pubA+":80" {
		t.Errorf("dials %v: only the first, checked, answer may be dialled", d)
	}
	if status, body := get("nxdomain.example.com"); status != 502 || body != "egress failed: could not resolve nxdomain.example.com\n" {
		t.Errorf("unresolvable: %d %q", status, body)
	}
	logs := h.logs.String()
	for _, leak := range []string{"169.254.169.254", "10.0.0.7", "fd00:ec2", "127.0.0.1", "a9fe"} {
		if strings.Contains(logs, leak) {
			t.Errorf("log leaks resolved address %s", leak)
		}
	}
	if !strings.Contains(logs, `"message":"egress_denied"`) || !strings.Contains(logs, `"reason":"blocked_address"`) {
		t.Errorf("missing egress_denied events: %s", logs)
	}
}

func TestDialFailureIs502(t *testing.T) {
	h := newHarness(t, Policy{Mode: ModePublic}, nil)
	h.res.set("example.com", []string{pubA, pubB}) // no routes: both dials fail
	resp, body, _, _ := h.raw(t, "CONNECT example.com:443 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 502 || !strings.Contains(body, "could not connect to example.com:443") {
		t.Errorf("%d %q", resp.StatusCode, body)
	}
	if strings.Contains(body, pubA) {
		t.Error("502 body names the resolved address")
	}
	if d := h.dial.dialed(); len(d) != 2 {
		t.Errorf("dials %v, want both checked addresses tried", d)
	}
	if ds := h.waitDecisions(t, 1); ds[0].Reason != ReasonDialFailed {
		t.Errorf("decision %+v", ds[0])
	}
}

func TestMalformedRequests(t *testing.T) {
	h := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.MaxHeaderBytes = 4096 })
	cases := []struct {
		req    string
		status int
		reason string
	}{
		{"garbage\r\n\r\n", 400, ReasonMalformed},
		{"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n", 400, ReasonScheme},
		{"GET https://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n", 400, ReasonScheme},
		{"GET ftp://example.com/ HTTP/1.1\r\n\r\n", 400, ReasonScheme},
		{"GET http://user:pw@example.com/ HTTP/1.1\r\n\r\n", 400, ReasonScheme},
		{"CONNECT example.com HTTP/1.1\r\n\r\n", 400, ReasonMalformed},
		{"CONNECT example.com:0443 HTTP/1.1\r\n\r\n", 400, ReasonMalformed},
		{"CONNECT example.com:99999 HTTP/1.1\r\n\r\n", 400, ReasonMalformed},
		{"CONNECT /path HTTP/1.1\r\n\r\n", 400, ReasonMalformed},
		{"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, ReasonMalformed},
		{"POST http://example.com/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400, ReasonMalformed},
		{"POST http://example.com/ HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400, ReasonMalformed},
		{"GET http://example.com/ HTTP/1.1\r\nHost example.com\r\n\r\n", 400, ReasonMalformed},
		{"GET http://example.com/ HTTP/1.1\r\nX-Big: " + strings.Repeat("a", 5000) + "\r\n\r\n", 431, ReasonHeaderTooLarge},
		{"GET http://example.com/ HTTP/1.1\r\n" + strings.Repeat("X-A: b\r\n", 1000) + "\r\n", 431, ReasonHeaderTooLarge},
	}
	for i, c := range cases {
		resp, body, _, _ := h.raw(t, c.req)
		if resp.StatusCode != c.status || !strings.HasPrefix(body, "egress denied: ") {
			t.Errorf("%.50q: %d %q, want %d", c.req, resp.StatusCode, body, c.status)
		}
		ds := h.waitDecisions(t, i+1)
		if d := ds[i]; d.Allowed || d.Reason != c.reason {
			t.Errorf("%.50q: decision %+v, want %s", c.req, d, c.reason)
		}
	}
	if d := h.dial.dialed(); len(d) != 0 {
		t.Errorf("dialer called: %v", d)
	}
}

func TestConnLimit(t *testing.T) {
	echo := newEcho(t)
	h := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.MaxConns = 2 })
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", echo)
	open := func() (net.Conn, *bufio.Reader, int) {
		resp, _, c, br := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
		return c, br, resp.StatusCode
	}
	c1, br1, s1 := open()
	_, _, s2 := open()
	if s1 != 200 || s2 != 200 {
		t.Fatalf("first two tunnels: %d %d", s1, s2)
	}
	resp, body, _, _ := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(body, "too many concurrent connections (limit 2)") {
		t.Fatalf("third: %d %q", resp.StatusCode, body)
	}
	if st := h.p.Stats(); st.Active != 2 {
		t.Errorf("active %d, want 2", st.Active)
	}
	// Tunnels stay usable, and closing one frees a slot.
	_, _ = io.WriteString(c1, "x")
	if b, err := br1.ReadByte(); err != nil || b != 'x' {
		t.Fatalf("tunnel 1 echo: %v", err)
	}
	_ = c1.Close()
	h.waitFreed(t, 1)
	if st := h.p.Stats(); st.Active != 1 {
		t.Fatalf("active %d after closing a tunnel, want 1", st.Active)
	}
	if _, _, s := open(); s != 200 {
		t.Errorf("after freeing a slot: %d", s)
	}
	var limited int
	for _, d := range h.decisions() {
		if d.Reason == ReasonConnLimit {
			limited++
			if d.Host != "example.com" || d.Port != 80 {
				t.Errorf("conn-limit decision %+v lacks the target", d)
			}
		}
	}
	if limited != 1 {
		t.Errorf("%d conn_limit decisions, want 1", limited)
	}
}

func TestByteLimit(t *testing.T) {
	const max = 64 << 10
	big := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := strings.Repeat("z", 32<<10)
		for i := 0; i < 32; i++ { // 1 MiB
			if _, err := io.WriteString(w, chunk); err != nil {
				return
			}
		}
	}))
	t.Cleanup(big.Close)
	h := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.MaxBytes = max })
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", hostOf(big))
	c := h.conn(t)
	_, _ = io.WriteString(c, "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("response: %v", err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	if err == nil && n >= 1<<20 {
		t.Fatalf("read the whole %d-byte body through a %d-byte cap", n, max)
	}
	if n > max {
		t.Errorf("client received %d body bytes, cap %d", n, max)
	}
	if st := h.p.Stats(); st.Bytes != max {
		t.Errorf("stats bytes %d, want exactly %d", st.Bytes, max)
	}
	// The budget is spent: later requests are refused before any dial.
	dials := len(h.dial.dialed())
	r2, body, _, _ := h.raw(t, "CONNECT example.com:443 HTTP/1.1\r\n\r\n")
	if r2.StatusCode != 403 || !strings.Contains(body, "byte limit") {
		t.Errorf("after cap: %d %q", r2.StatusCode, body)
	}
	if len(h.dial.dialed()) != dials {
		t.Error("dialled after the byte cap was reached")
	}
}

func TestIdleTimeoutClosesTunnel(t *testing.T) {
	echo := newEcho(t)
	h := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.IdleTimeout = 300 * time.Millisecond })
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", echo)
	resp, _, c, br := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	_, _ = io.WriteString(c, "x")
	if b, err := br.ReadByte(); err != nil || b != 'x' {
		t.Fatal("echo failed")
	}
	start := time.Now()
	expectClosed(t, c, br)
	if time.Since(start) < 250*time.Millisecond {
		t.Errorf("closed after %v, before the idle timeout", time.Since(start))
	}
}

func TestHandshakeTimeoutClosesSilentClient(t *testing.T) {
	h := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.HandshakeTimeout = 200 * time.Millisecond })
	c := h.conn(t)
	_, _ = io.WriteString(c, "GET http://exa") // never finishes the header
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer to a stalled request: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(body), "no complete request header within 200ms") {
		t.Errorf("%d %q", resp.StatusCode, body)
	}
	expectClosed(t, c, br)
	if ds := h.waitDecisions(t, 1); ds[0].Allowed || ds[0].Reason != ReasonTimeout {
		t.Errorf("decision %+v", ds[0])
	}
}

func TestServeClosesConnectionsWhenListenerCloses(t *testing.T) {
	echo := newEcho(t)
	h := newHarness(t, Policy{Mode: ModePublic}, nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", echo)
	var conns []net.Conn
	var readers []*bufio.Reader
	for i := 0; i < 3; i++ {
		resp, _, c, br := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
		if resp.StatusCode != 200 {
			t.Fatal(resp.StatusCode)
		}
		_, _ = io.WriteString(c, "x")
		if _, err := br.ReadByte(); err != nil {
			t.Fatal(err)
		}
		conns, readers = append(conns, c), append(readers, br)
	}
	h.stop(t)()
	var wg sync.WaitGroup
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			expectClosed(t, conns[i], readers[i])
		}()
	}
	wg.Wait()
	if st := h.p.Stats(); st.Active != 0 {
		t.Errorf("active %d after Serve returned", st.Active)
	}
}

func TestNewValidates(t *testing.T) {
	if _, err := New(Options{Policy: Policy{Mode: "open"}}); err == nil {
		t.Error("New accepted an unknown mode")
	}
	if _, err := New(Options{Ports: []int{0}}); err == nil {
		t.Error("New accepted port 0")
	}
	p, err := New(Options{Policy: Policy{Mode: ModeAllow, Allowed: []string{"A.com."}}})
	if err != nil || p.Policy().Allowed[0] != "a.com" {
		t.Errorf("New did not normalise the policy: %v", err)
	}
}

// TestEveryBlockedRangeViaResolver: a name on the allow list that resolves
// into any blocked range is refused with 403 and never dialled (cases 27
// to 29, through DNS rather than as a literal).
func TestEveryBlockedRangeViaResolver(t *testing.T) {
	h := newHarness(t, allowPolicy(t, []string{"*.example.com"}), nil)
	for i, a := range blockedAddrs {
		name := fmt.Sprintf("b%d.example.com", i)
		h.res.set(name, []string{a})
		resp, body, c, _ := h.raw(t, "CONNECT "+name+":443 HTTP/1.1\r\n\r\n")
		_ = c.Close() // a refused connection holds its slot until the client leaves
		if resp.StatusCode != 403 || body != "egress denied: "+name+" resolves to a non-public address (rule: non-public addresses are always refused)\n" {
			t.Errorf("%s -> %s: %d %q", name, a, resp.StatusCode, body)
		}
	}
	ds := h.waitDecisions(t, len(blockedAddrs))
	for _, d := range ds {
		if d.Allowed || d.Reason != ReasonBlockedAddress {
			t.Errorf("decision %+v", d)
		}
	}
	if d := h.dial.dialed(); len(d) != 0 {
		t.Errorf("dialer called: %v", d)
	}
}

// TestRebindingResolvesOnceAndDialsTheCheckedIP: the name is looked up
// once per request, and the dialer gets that checked IP, never the name,
// so a second (rebinding) answer can never be the one connected to.
func TestRebindingResolvesOnceAndDialsTheCheckedIP(t *testing.T) {
	echo := newEcho(t)
	h := newHarness(t, allowPolicy(t, []string{"rebind.example.com"}), nil)
	h.res.set("rebind.example.com", []string{pubA}, []string{"127.0.0.1"})
	h.dial.route(pubA+":80", echo)
	resp, _, c, br := h.raw(t, "CONNECT rebind.example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	_, _ = io.WriteString(c, "z")
	if b, err := br.ReadByte(); err != nil || b != 'z' {
		t.Fatalf("echo: %v", err)
	}
	if n := h.res.count("rebind.example.com"); n != 1 {
		t.Errorf("resolved %d times for one request, want 1", n)
	}
	if d := h.dial.dialed(); len(d) != 1 || d[0] != pubA+":80" {
		t.Errorf("dials %v, want only %s:80", d, pubA)
	}
}

// TestMappedPublicAnswerDialledAsIPv4: resolvers may return IPv4 in its
// 16-byte mapped form; the proxy checks and dials the plain IPv4.
func TestMappedPublicAnswerDialledAsIPv4(t *testing.T) {
	echo := newEcho(t)
	h := newHarness(t, Policy{Mode: ModePublic}, nil)
	h.res.set("example.com", []string{"::ffff:" + pubA})
	h.dial.route(pubA+":80", echo)
	if resp, _, _, _ := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n"); resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if d := h.dial.dialed(); len(d) != 1 || d[0] != pubA+":80" {
		t.Errorf("dials %v", d)
	}
}

// TestDefaultDialerRechecksAtConnect: with no Dialer given, the proxy's
// own dialer refuses a non-public socket address before connect(2), so
// even a bug upstream of it could not reach loopback.
func TestDefaultDialerRechecksAtConnect(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	p, err := New(Options{Policy: Policy{Mode: ModePublic}})
	if err != nil {
		t.Fatal(err)
	}
	nd, ok := p.o.Dialer.(*net.Dialer)
	if !ok || nd.Control == nil {
		t.Fatalf("default dialer %T has no Control re-check", p.o.Dialer)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := p.o.Dialer.DialContext(ctx, "tcp", ln.Addr().String())
	if err == nil {
		c.Close()
		t.Fatal("default dialer connected to loopback")
	}
	if !strings.Contains(err.Error(), "refusing non-public address") {
		t.Errorf("dial error %v, want the re-check's refusal", err)
	}
}

// slowDialer models an upstream that takes a while to answer SYN.
type slowDialer struct {
	*fakeDialer
	delay time.Duration
}

func (s slowDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	select {
	case <-time.After(s.delay):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return s.fakeDialer.DialContext(ctx, network, addr)
}

// TestSlowDialStillAnswered: resolving and dialling may outlast the
// deadline that bounded the request header; the 200 and the ClientHello
// phase get fresh deadlines, and the decision is reported.
func TestSlowDialStillAnswered(t *testing.T) {
	echo := newEcho(t)
	fd := newDialer()
	h := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) {
		o.HandshakeTimeout = 100 * time.Millisecond
		o.Dialer = slowDialer{fd, 300 * time.Millisecond}
	})
	h.res.set("example.com", []string{pubA})
	fd.route(pubA+":80", echo)
	resp, _, c, br := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	_, _ = io.WriteString(c, "q")
	if b, err := br.ReadByte(); err != nil || b != 'q' {
		t.Fatalf("echo: %v", err)
	}
	if ds := h.waitDecisions(t, 1); !ds[0].Allowed {
		t.Errorf("decision %+v", ds[0])
	}
}

// TestServeStopsWaitingUpstream: closing the listener (the job ended)
// ends a request still waiting for its upstream's answer at once, not
// after the idle timeout.
func TestServeStopsWaitingUpstream(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c // read the request, never answer
		}
	}()
	h := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.IdleTimeout = time.Hour })
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", ln.Addr().String())
	c := h.conn(t)
	_, _ = io.WriteString(c, "GET http://example.com/ HTTP/1.1\r\n\r\n")
	up := <-accepted
	defer up.Close()
	if _, err := http.ReadRequest(bufio.NewReader(up)); err != nil {
		t.Fatalf("upstream: %v", err)
	}
	_ = h.ln.Close()
	select {
	case err := <-h.done:
		h.done <- err // for the cleanup's stop
	case <-time.After(10 * time.Second):
		t.Fatal("Serve still waits for an upstream after its listener closed")
	}
	_ = up.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := up.Read(make([]byte, 1)); err == nil {
		t.Error("upstream connection still open after Serve returned")
	}
}

// TestSharedQuotaCapsASession: two proxies (two executions of one
// session) sharing a Quota share its connection and byte caps.
func TestSharedQuotaCapsASession(t *testing.T) {
	echo := newEcho(t)
	q := NewQuota(1, 1<<20)
	h1 := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.Quota = q; o.MaxConns = 50 })
	h2 := newHarness(t, allowPolicy(t, []string{"example.com"}), func(o *Options) { o.Quota = q })
	for _, h := range []*harness{h1, h2} {
		h.res.set("example.com", []string{pubA})
		h.dial.route(pubA+":80", echo)
	}
	resp, _, c, br := h1.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("first tunnel: %d", resp.StatusCode)
	}
	resp2, body, _, _ := h2.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp2.StatusCode != http.StatusTooManyRequests || !strings.Contains(body, "(limit 1)") {
		t.Fatalf("second proxy of the session: %d %q", resp2.StatusCode, body)
	}
	_, _ = io.WriteString(c, "abc")
	buf := make([]byte, 3)
	if _, err := io.ReadFull(br, buf); err != nil {
		t.Fatal(err)
	}
	// Used also holds reservations of reads in flight, so it is at least
	// what the two proxies counted.
	b1, b2 := h1.p.Stats().Bytes, h2.p.Stats().Bytes
	if b1 < 6 || b2 == 0 || q.Used() < b1+b2 {
		t.Errorf("quota used %d, proxies %d + %d", q.Used(), b1, b2)
	}
	_ = c.Close()
	h1.waitFreed(t, 1)
	if resp3, _, _, _ := h2.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n"); resp3.StatusCode != 200 {
		t.Errorf("after the first tunnel closed: %d", resp3.StatusCode)
	}
}

// TestSharedQuotaBytes: bytes spent through one proxy of a session are
// gone for the others.
func TestSharedQuotaBytes(t *testing.T) {
	echo := newEcho(t)
	q := NewQuota(4, 2048)
	h1 := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.Quota = q })
	h2 := newHarness(t, Policy{Mode: ModePublic}, func(o *Options) { o.Quota = q; o.MaxBytes = 1 << 30 })
	for _, h := range []*harness{h1, h2} {
		h.res.set("example.com", []string{pubA})
		h.dial.route(pubA+":80", echo)
	}
	resp, _, c, br := h1.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("tunnel: %d", resp.StatusCode)
	}
	go func() { _, _ = io.WriteString(c, strings.Repeat("x", 4096)) }()
	n, _ := io.Copy(io.Discard, br)
	if n >= 4096 {
		t.Errorf("echoed %d bytes through a 2048-byte quota", n)
	}
	if q.Used() != 2048 {
		t.Errorf("quota used %d, want 2048", q.Used())
	}
	resp2, body, _, _ := h2.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp2.StatusCode != 403 || !strings.Contains(body, "byte limit (2048 bytes) is used up") {
		t.Errorf("other proxy of the session: %d %q", resp2.StatusCode, body)
	}
}

// TestClosedTunnelLogsBytes: the audit-facing log line for an allowed
// connection carries host, port and the bytes moved each way.
func TestClosedTunnelLogsBytes(t *testing.T) {
	echo := newEcho(t)
	h := newHarness(t, Policy{Mode: ModePublic}, nil)
	h.res.set("example.com", []string{pubA})
	h.dial.route(pubA+":80", echo)
	resp, _, c, br := h.raw(t, "CONNECT example.com:80 HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	_, _ = io.WriteString(c, "12345")
	if _, err := io.ReadFull(br, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	h.waitFreed(t, 1)
	if l := h.logs.String(); !strings.Contains(l, `"host":"example.com","port":80,"bytes_sent":5,"bytes_received":5,"message":"egress_closed"`) {
		t.Errorf("no egress_closed line with byte counts: %s", l)
	}
}
