package egress

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"
)

// Resolver looks names up; net.DefaultResolver satisfies it.
type Resolver interface {
	LookupIPAddr(ctx context.Context, host string) ([]net.IPAddr, error)
}

// Dialer opens upstream connections; *net.Dialer satisfies it. The proxy
// only ever passes it an already-checked "ip:port".
type Dialer interface {
	DialContext(ctx context.Context, network, addr string) (net.Conn, error)
}

// Decision is one request's verdict, for audit and metrics.
type Decision struct {
	Kind    string // "connect" or "http"
	Host    string // normalised host; "" when the host was invalid or unknown
	Port    int
	Allowed bool
	Reason  string // a Reason* constant
	// Rule names what refused the request, for the model: the policy entry
	// (`denied_domains entry "*.evil.com"`), the port list, a limit.
	Rule string
}

// Rules that are not policy entries.
const (
	ruleHost      = "host names must be valid DNS names or IP addresses"
	rulePublic    = "non-public addresses are always refused"
	ruleByteLimit = "the session's network byte limit"
	ruleSNI       = "a tunnel's TLS server name must be its CONNECT host"
	ruleTLS       = "a tunnel to port 443 must carry TLS"
	ruleConns     = "the session's concurrent connection limit"
)

// Options configures a Proxy. Zero values take the defaults noted.
type Options struct {
	Policy   Policy
	Resolver Resolver // default net.DefaultResolver
	Dialer   Dialer   // default a net.Dialer that re-checks the socket address
	Ports    []int    // default 80 and 443
	MaxConns int      // concurrent client connections; default 32
	MaxBytes int64    // total bytes both ways over the proxy's life; default 1 GiB
	// Quota, when set, replaces MaxConns and MaxBytes with an allowance
	// shared with other proxies (one per session, across its executions).
	Quota *Quota
	// MaxHeaderBytes bounds a request's header; default 16 KiB. (An
	// upstream response's header is bounded at 64 KiB.)
	MaxHeaderBytes int
	DialTimeout    time.Duration // resolve and dial, each; default 10s
	// IdleTimeout ends a connection with no bytes either way; default 60s.
	// No connection outlives Serve: closing the listener (the backends do
	// when the job ends) closes every connection at once.
	IdleTimeout time.Duration
	// HandshakeTimeout bounds reading the request header and, afresh once
	// the upstream is dialled, the tunnel's 200 reply and the TLS
	// ClientHello; default 10s.
	HandshakeTimeout time.Duration
	Log              zerolog.Logger
	OnDecision       func(Decision) // called once per request, never concurrently with itself
}

// Stats are a proxy's counters.
type Stats struct {
	Active   int    // client connections this proxy is serving
	Accepted uint64 // client connections accepted
	Allowed  uint64 // requests allowed
	Denied   uint64 // requests denied (including SNI and limit failures)
	// Bytes read from clients and upstreams by this proxy. Relayed bytes
	// stop at the byte limit; request headers read after that (to answer
	// 403) are counted too, so Bytes may exceed MaxBytes by those.
	Bytes int64
}

// Proxy is one session's egress proxy.
type Proxy struct {
	o Options
	q *Quota

	active   atomic.Int64 // this proxy's share of q.active
	bytes    atomic.Int64
	accepted atomic.Uint64
	allowed  atomic.Uint64
	denied   atomic.Uint64

	decMu sync.Mutex

	afterRelease func() // test hook: a connection's slot was given back
}

const (
	defaultMaxConns = 32
	defaultMaxBytes = 1 << 30
	defaultHeader   = 16 << 10
	maxRespHeader   = 64 << 10
	maxAddrs        = 16
)

// New validates o and returns a proxy ready to Serve.
func New(o Options) (*Proxy, error) {
	pol, err := o.Policy.Normalize()
	if err != nil {
		return nil, err
	}
	o.Policy = pol
	if o.Resolver == nil {
		o.Resolver = net.DefaultResolver
	}
	if o.Dialer == nil {
		o.Dialer = &net.Dialer{Control: recheckControl}
	}
	if len(o.Ports) == 0 {
		o.Ports = []int{80, 443}
	}
	for _, p := range o.Ports {
		if p < 1 || p > 65535 {
			return nil, fmt.Errorf("egress: invalid port %d", p)
		}
	}
	o.Ports = slices.Clone(o.Ports)
	slices.Sort(o.Ports)
	q := o.Quota
	if q == nil {
		q = NewQuota(o.MaxConns, o.MaxBytes)
	}
	o.MaxConns, o.MaxBytes = q.MaxConns(), q.MaxBytes()
	if o.MaxHeaderBytes <= 0 {
		o.MaxHeaderBytes = defaultHeader
	}
	if o.DialTimeout <= 0 {
		o.DialTimeout = 10 * time.Second
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = 60 * time.Second
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = 10 * time.Second
	}
	return &Proxy{o: o, q: q}, nil
}

// recheckControl refuses, at connect(2) time, any socket address that is
// not public: a second line behind the resolver check.
func recheckControl(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("egress: unparsable dial address")
	}
	if BlockedReason(ap.Addr()) != "" {
		return fmt.Errorf("egress: refusing non-public address")
	}
	return nil
}

// Policy returns the normalised policy the proxy enforces.
func (p *Proxy) Policy() Policy { return p.o.Policy }

// Stats returns the current counters.
func (p *Proxy) Stats() Stats {
	return Stats{
		Active:   int(p.active.Load()),
		Accepted: p.accepted.Load(),
		Allowed:  p.allowed.Load(),
		Denied:   p.denied.Load(),
		Bytes:    p.bytes.Load(),
	}
}

// Serve accepts connections on ln until it is closed, then closes every
// connection it accepted, waits for their handlers and returns nil. Other
// accept errors are returned after the same cleanup.
func (p *Proxy) Serve(ln net.Listener) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var (
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
		wg    sync.WaitGroup
	)
	track := func(c net.Conn, on bool) {
		mu.Lock()
		defer mu.Unlock()
		if on {
			conns[c] = struct{}{}
		} else {
			delete(conns, c)
		}
	}
	var retErr error
	backoff := 5 * time.Millisecond
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				break
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				p.o.Log.Warn().Str("cause", err.Error()).Msg("egress_accept_retry")
				t := time.NewTimer(backoff)
				<-t.C
				backoff = min(backoff*2, time.Second)
				continue
			}
			retErr = err
			break
		}
		backoff = 5 * time.Millisecond
		p.accepted.Add(1)
		track(c, true)
		wg.Add(1)
		if p.q.acquire() {
			p.active.Add(1)
			go func() {
				defer wg.Done()
				defer track(c, false)
				defer p.release()
				p.handle(ctx, c)
			}()
			continue
		}
		go func() {
			defer wg.Done()
			defer track(c, false)
			p.refuseBusy(c)
		}()
	}
	cancel()
	mu.Lock()
	for c := range conns {
		_ = c.Close()
	}
	mu.Unlock()
	wg.Wait()
	return retErr
}

func (p *Proxy) release() {
	p.active.Add(-1)
	p.q.release()
	if p.afterRelease != nil {
		p.afterRelease()
	}
}

// meter wraps c so its bytes count against the quota and this proxy.
func (p *Proxy) meter(c net.Conn, enforce bool) *meter {
	return &meter{Conn: c, b: &p.q.budget, total: &p.bytes, enforce: enforce}
}

// refuseBusy answers a connection over MaxConns with 429. Refusals are
// themselves capped so a flood cannot pile up goroutines.
func (p *Proxy) refuseBusy(c net.Conn) {
	defer c.Close()
	if p.q.overflow.Add(1) > p.q.maxConns {
		p.q.overflow.Add(-1)
		p.report(Decision{Reason: ReasonConnLimit, Rule: ruleConns}, "")
		return
	}
	defer p.q.overflow.Add(-1)
	_ = c.SetDeadline(time.Now().Add(p.o.HandshakeTimeout))
	lr := &limitReader{r: p.meter(c, false), n: int64(p.o.MaxHeaderBytes)}
	br := bufio.NewReader(lr)
	d := Decision{Reason: ReasonConnLimit, Rule: ruleConns}
	if req, err := http.ReadRequest(br); err == nil {
		d.Kind, d.Host, d.Port = requestTarget(req)
		if req.Body != nil {
			_ = req.Body.Close()
		}
	}
	p.deny(c, br, d, http.StatusTooManyRequests, fmt.Sprintf("too many concurrent connections (limit %d)", p.o.MaxConns))
}

// requestTarget extracts what a request aimed at, for the audit only.
func requestTarget(req *http.Request) (kind, host string, port int) {
	kind, auth, def := "http", "", 80
	if req.Method == http.MethodConnect {
		kind, auth, def = "connect", req.RequestURI, 0
	} else if req.URL != nil {
		auth = req.URL.Host
	}
	h, pt, err := splitHostPort(auth, def)
	if err != nil {
		return kind, "", 0
	}
	if name, _, err := NormalizeHost(h); err == nil {
		return kind, name, pt
	}
	return kind, "", pt
}

// handle serves one client connection: one CONNECT tunnel or one plain
// HTTP request, then close.
func (p *Proxy) handle(ctx context.Context, c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(p.o.HandshakeTimeout))
	cm := p.meter(c, false)
	lr := &limitReader{r: cm, n: int64(p.o.MaxHeaderBytes)}
	br := bufio.NewReader(lr)
	req, err := http.ReadRequest(br)
	if err != nil {
		var ne net.Error
		switch {
		case lr.hit:
			p.deny(c, br, Decision{Reason: ReasonHeaderTooLarge}, http.StatusRequestHeaderFieldsTooLarge,
				fmt.Sprintf("request header larger than %d bytes", p.o.MaxHeaderBytes))
		case err == io.EOF:
			// The client connected and left without a request.
		case errors.As(err, &ne) && ne.Timeout() || errors.As(cm.err, &ne) && ne.Timeout():
			p.deny(c, br, Decision{Reason: ReasonTimeout}, http.StatusRequestTimeout,
				fmt.Sprintf("no complete request header within %s", p.o.HandshakeTimeout))
		default:
			p.deny(c, br, Decision{Reason: ReasonMalformed}, http.StatusBadRequest, "malformed proxy request")
		}
		return
	}
	lr.n = -1
	if req.ProtoMajor != 1 { // e.g. the HTTP/2 preface "PRI * HTTP/2.0"
		p.deny(c, br, Decision{Reason: ReasonMalformed}, http.StatusBadRequest, "only HTTP/1.x proxy requests are supported")
		return
	}
	if req.Method == http.MethodConnect {
		p.connect(ctx, c, cm, br, req)
		return
	}
	p.forward(ctx, c, cm, br, req)
}

// target is a request's checked destination.
type target struct {
	name  string
	ip    netip.Addr // set for IP-literal hosts
	port  int
	addrs []netip.Addr
}

// check runs every gate before any upstream byte is sent: host syntax,
// port, policy, byte budget, resolution and the address table. On refusal
// it returns the HTTP status and the model-readable message, which says
// which rule refused which host.
func (p *Proxy) check(ctx context.Context, d *Decision, host string, port int) (target, int, string) {
	d.Port = port
	t := target{port: port}
	refuse := func(reason, rule, detail string) (target, int, string) {
		d.Reason, d.Rule = reason, rule
		return t, http.StatusForbidden, detail + " (rule: " + rule + ")"
	}
	name, ip, err := NormalizeHost(host)
	if err != nil {
		return refuse(ReasonInvalidHost, ruleHost, "invalid host: "+err.Error())
	}
	d.Host = name
	t.name, t.ip = name, ip
	if ok, reason, rule := p.o.Policy.match(name, ip); !ok {
		return refuse(reason, rule, policyMsg(reason, name))
	}
	if _, ok := slices.BinarySearch(p.o.Ports, port); !ok {
		return refuse(ReasonPort, "allowed ports: "+joinInts(p.o.Ports), fmt.Sprintf("%s: port %d is not allowed", name, port))
	}
	if p.q.budget.exhausted() {
		return refuse(ReasonByteLimit, ruleByteLimit, p.byteLimitMsg())
	}
	if ip.IsValid() {
		if why := BlockedReason(ip); why != "" {
			p.o.Log.Info().Str("host", name).Str("range", why).Msg("egress_blocked_address")
			return refuse(ReasonBlockedAddress, rulePublic, name+" is not a public address")
		}
		t.addrs = []netip.Addr{ip}
		return t, 0, ""
	}
	rctx, cancel := context.WithTimeout(ctx, p.o.DialTimeout)
	defer cancel()
	// The name is rooted so no resolv.conf search domain is appended.
	ias, err := p.o.Resolver.LookupIPAddr(rctx, name+".")
	if err != nil || len(ias) == 0 {
		d.Reason = ReasonResolveFailed
		return t, http.StatusBadGateway, "could not resolve " + name
	}
	// Every answer must pass: one private answer poisons the whole set,
	// so a rebinding resolver cannot win a race between answers.
	for _, ia := range ias {
		a, ok := netip.AddrFromSlice(ia.IP)
		why := "invalid"
		if ok {
			a = a.WithZone(ia.Zone)
			why = BlockedReason(a)
		}
		if why != "" {
			p.o.Log.Info().Str("host", name).Str("range", why).Msg("egress_blocked_address")
			return refuse(ReasonBlockedAddress, rulePublic, name+" resolves to a non-public address")
		}
		a = a.Unmap()
		if !slices.Contains(t.addrs, a) && len(t.addrs) < maxAddrs {
			t.addrs = append(t.addrs, a)
		}
	}
	return t, 0, ""
}

// dial connects to the checked addresses in order: never to the name.
func (p *Proxy) dial(ctx context.Context, t target) (net.Conn, error) {
	dctx, cancel := context.WithTimeout(ctx, p.o.DialTimeout)
	defer cancel()
	var last error
	for _, a := range t.addrs {
		c, err := p.o.Dialer.DialContext(dctx, "tcp", netip.AddrPortFrom(a, uint16(t.port)).String())
		if err == nil {
			return c, nil
		}
		last = err
		if dctx.Err() != nil {
			break
		}
	}
	return nil, last
}

// open checks host:port against the policy and dials the checked address,
// answering the client itself when either fails (ok is then false).
func (p *Proxy) open(ctx context.Context, c net.Conn, br *bufio.Reader, d *Decision, host string, port int) (target, net.Conn, bool) {
	t, status, msg := p.check(ctx, d, host, port)
	if status != 0 {
		p.deny(c, br, *d, status, msg)
		return t, nil, false
	}
	up, err := p.dial(ctx, t)
	if err != nil {
		d.Reason = ReasonDialFailed
		p.deny(c, br, *d, http.StatusBadGateway, fmt.Sprintf("could not connect to %s", hostPort(t)))
		return t, nil, false
	}
	return t, up, true
}

func (p *Proxy) connect(ctx context.Context, c net.Conn, cm *meter, br *bufio.Reader, req *http.Request) {
	d := Decision{Kind: "connect"}
	host, port, err := splitHostPort(req.RequestURI, 0)
	if err != nil {
		d.Reason = ReasonMalformed
		p.deny(c, br, d, http.StatusBadRequest, "CONNECT needs host:port")
		return
	}
	t, up, ok := p.open(ctx, c, br, &d, host, port)
	if !ok {
		return
	}
	defer up.Close()
	// Closing the listener (the job ended) ends the tunnel at once.
	defer context.AfterFunc(ctx, func() { _ = up.Close() })()
	cm.enforce, cm.n = true, 0 // from here on, client bytes may reach upstream
	// Each phase gets its own deadline: resolving and dialling may have
	// used up the one that bounded the request header.
	_ = c.SetDeadline(time.Now().Add(p.o.HandshakeTimeout))
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection Established\r\n\r\n"); err != nil {
		d.Reason = ReasonClientGone
		p.report(d, "")
		return
	}
	// The client speaks first. Nothing it sends reaches upstream until its
	// ClientHello has been read and the SNI matches the CONNECT host.
	first, err := br.Peek(1)
	if err != nil {
		d.Reason = tunnelReadReason(err)
		p.report(d, "no data from client")
		return
	}
	var hello []byte
	if first[0] == 0x16 {
		raw, sni, err := readClientHello(br)
		if err != nil {
			d.Reason = ReasonNotTLS
			if r := tunnelReadReason(err); r != ReasonClientGone {
				d.Reason = r
			}
			p.report(d, "bad ClientHello")
			sendTLSAlert(c)
			return
		}
		if reason := sniVerdict(sni, t); reason != "" {
			d.Reason, d.Rule = reason, ruleSNI
			p.report(d, "")
			sendTLSAlert(c) // the client reports "access denied"
			return
		}
		hello = raw
	} else if port == 443 {
		// A plain-text client (e.g. http:// forced through CONNECT) can
		// read an HTTP answer.
		d.Reason, d.Rule = ReasonNotTLS, ruleTLS
		p.report(d, "")
		writeReply(c, http.StatusForbidden, "egress denied: "+t.name+": a tunnel to port 443 must start with a TLS ClientHello (rule: "+ruleTLS+")")
		lingerClose(c)
		return
	}
	d.Allowed, d.Reason = true, ReasonAllowed
	p.report(d, "")
	um := p.meter(up, true)
	id := &idler{conns: []net.Conn{c, up}, idle: p.o.IdleTimeout}
	id.touch()
	cm.activity, um.activity = id.touch, id.touch
	if _, err = up.Write(hello); err == nil {
		err = pipe(c, br, up, um)
	}
	p.finish(d, cm, um, err)
}

// tunnelReadReason classifies a failure to read the tunnel's first bytes.
func tunnelReadReason(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, errByteLimit):
		return ReasonByteLimit
	case errors.As(err, &ne) && ne.Timeout():
		return ReasonTimeout
	case errors.Is(err, errNotTLS), errors.Is(err, errBadHello), errors.Is(err, errHelloTooLarge):
		return ReasonNotTLS
	}
	return ReasonClientGone
}

// sniVerdict: the SNI must name the CONNECT host. A missing SNI is only
// normal for IP-literal hosts (RFC 6066 forbids IPs in SNI).
func sniVerdict(sni string, t target) string {
	if sni == "" {
		if t.ip.IsValid() {
			return ""
		}
		return ReasonSNIMissing
	}
	name, ip, err := NormalizeHost(sni)
	if err != nil || ip.IsValid() || name != t.name {
		return ReasonSNIMismatch
	}
	return ""
}

// hopHeaders are never forwarded in either direction (RFC 9110 §7.6.1),
// plus the proxy's own and Expect, which the proxy answers itself.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Expect",
}

func stripHop(h http.Header) {
	for _, v := range h.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			if f = strings.TrimSpace(f); f != "" {
				h.Del(f)
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
}

// forward serves one absolute-form plain HTTP request. The upstream request
// is rebuilt from the parsed URL (origin-form, Host from the URL), so no
// Host-header or request-line differential reaches the server.
func (p *Proxy) forward(ctx context.Context, c net.Conn, cm *meter, br *bufio.Reader, req *http.Request) {
	d := Decision{Kind: "http"}
	u := req.URL
	if u == nil || u.Scheme != "http" || u.Host == "" || u.Opaque != "" || u.User != nil {
		d.Reason = ReasonScheme
		p.deny(c, br, d, http.StatusBadRequest, "only absolute http:// URLs and CONNECT are supported (https goes through CONNECT)")
		return
	}
	host, port, err := splitHostPort(u.Host, 80)
	if err != nil {
		d.Reason = ReasonMalformed
		p.deny(c, br, d, http.StatusBadRequest, "malformed URL host")
		return
	}
	t, up, ok := p.open(ctx, c, br, &d, host, port)
	if !ok {
		return
	}
	defer up.Close()
	defer context.AfterFunc(ctx, func() { _ = up.Close() })()
	d.Allowed, d.Reason = true, ReasonAllowed
	p.report(d, "")

	cm.enforce, cm.n = true, 0 // n counts relayed bytes, not the header
	um := p.meter(up, true)
	id := &idler{conns: []net.Conn{c, up}, idle: p.o.IdleTimeout}
	id.touch()
	cm.activity, um.activity = id.touch, id.touch

	if strings.EqualFold(req.Header.Get("Expect"), "100-continue") {
		if _, err := io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n"); err != nil {
			return
		}
	}
	hdr := req.Header.Clone()
	stripHop(hdr)
	if _, ok := hdr["User-Agent"]; !ok {
		hdr["User-Agent"] = []string{""} // keep Go's default agent out
	}
	out := &http.Request{
		Method:           req.Method,
		URL:              &url.URL{Scheme: "http", Host: hostPort(t), Path: u.Path, RawPath: u.RawPath, RawQuery: u.RawQuery},
		Proto:            "HTTP/1.1",
		ProtoMajor:       1,
		ProtoMinor:       1,
		Header:           hdr,
		Body:             req.Body,
		ContentLength:    req.ContentLength,
		TransferEncoding: req.TransferEncoding,
		Host:             hostHeader(t),
		Close:            true,
	}
	uw := bufio.NewWriter(up)
	if err := out.Write(uw); err != nil || uw.Flush() != nil {
		p.finish(d, cm, um, p.upstreamFailed(c, br, err))
		return
	}
	ulr := &limitReader{r: um, n: maxRespHeader}
	ubr := bufio.NewReader(ulr)
	var resp *http.Response
	for {
		resp, err = http.ReadResponse(ubr, out)
		if err != nil {
			p.finish(d, cm, um, p.upstreamFailed(c, br, err))
			return
		}
		// Interim responses (103 Early Hints) are dropped; 101 cannot
		// happen because Upgrade was stripped.
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
	}
	ulr.n = -1
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusSwitchingProtocols {
		p.finish(d, cm, um, p.upstreamFailed(c, br, errors.New("unexpected 101")))
		return
	}
	stripHop(resp.Header)
	resp.Close = true
	cw := bufio.NewWriter(c)
	err = resp.Write(cw)
	if ferr := cw.Flush(); err == nil {
		err = ferr
	}
	p.finish(d, cm, um, err)
}

// upstreamFailed answers 502 when nothing of the response was sent yet.
func (p *Proxy) upstreamFailed(c net.Conn, br *bufio.Reader, err error) error {
	if errors.Is(err, errByteLimit) {
		writeReply(c, http.StatusForbidden, "egress denied: "+p.byteLimitMsg())
	} else {
		writeReply(c, http.StatusBadGateway, "egress failed: the upstream connection failed")
	}
	lingerClose(c)
	return err
}

// finish logs how an allowed connection ended and the bytes it moved
// (sent: read from the client; received: read from upstream); byte-limit
// endings are called out because the model may want to know why a
// download stopped.
func (p *Proxy) finish(d Decision, cm, um *meter, err error) {
	ev := p.o.Log.Info()
	if errors.Is(err, errByteLimit) {
		ev = p.o.Log.Warn().Str("reason", ReasonByteLimit)
	}
	ev.Str("kind", d.Kind).Str("host", d.Host).Int("port", d.Port).
		Int64("bytes_sent", cm.n).Int64("bytes_received", um.n).Msg("egress_closed")
}

// deny reports d, writes a short plain-text refusal and closes c.
func (p *Proxy) deny(c net.Conn, br *bufio.Reader, d Decision, status int, msg string) {
	d.Allowed = false
	p.report(d, "")
	prefix := "egress denied: "
	if status >= 500 {
		prefix = "egress failed: " // the policy allowed it; the network did not
	}
	writeReply(c, status, prefix+msg)
	lingerClose(c)
}

func writeReply(c net.Conn, status int, body string) {
	body += "\n"
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _ = fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		status, http.StatusText(status), len(body), body)
}

// report logs the decision and hands it to OnDecision.
func (p *Proxy) report(d Decision, detail string) {
	if d.Allowed {
		p.allowed.Add(1)
		p.o.Log.Info().Str("kind", d.Kind).Str("host", d.Host).Int("port", d.Port).Msg("egress_allowed")
	} else {
		p.denied.Add(1)
		ev := p.o.Log.Info().Str("kind", d.Kind).Str("host", d.Host).Int("port", d.Port).Str("reason", d.Reason)
		if detail != "" {
			ev = ev.Str("detail", detail)
		}
		ev.Msg("egress_denied")
	}
	if p.o.OnDecision != nil {
		p.decMu.Lock()
		defer p.decMu.Unlock()
		p.o.OnDecision(d)
	}
}

func (p *Proxy) byteLimitMsg() string {
	return fmt.Sprintf("the sandbox's network byte limit (%d bytes) is used up", p.q.MaxBytes())
}

func policyMsg(reason, name string) string {
	switch reason {
	case ReasonNetworkNone:
		return name + ": network access is disabled for this sandbox"
	case ReasonIPLiteral:
		return name + ": IP addresses are not allowed; use a domain name from allowed_domains"
	case ReasonDenied:
		return name + " is in denied_domains"
	default:
		return name + " is not in allowed_domains"
	}
}

// hostPort is the checked host and port as an authority.
func hostPort(t target) string {
	return net.JoinHostPort(t.name, strconv.Itoa(t.port))
}

// hostHeader omits the default port, as clients do.
func hostHeader(t target) string {
	if t.port == 80 {
		if t.ip.Is6() {
			return "[" + t.name + "]"
		}
		return t.name
	}
	return hostPort(t)
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ", ")
}
