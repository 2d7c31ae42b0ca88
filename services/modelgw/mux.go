package modelgw

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Host is the gateway's name inside a sandbox. Names under .invalid never
// resolve (RFC 6761), so the only way to it is the job's proxy, which the
// in-sandbox forwarder connects to the job's egress socket.
const Host = "model-gateway.invalid"

// BaseURL is what an agent's ANTHROPIC_BASE_URL is set to.
const BaseURL = "http://" + Host

// IsGatewayHost reports whether a request's host names the gateway.
func IsGatewayHost(h string) bool {
	h = strings.ToLower(h)
	return h == Host || h == Host+":80"
}

// Bounds on reading a connection's first request line.
const (
	maxRequestLine = 8 << 10
	sniffTimeout   = 10 * time.Second
)

// Serve splits the connections of one job's egress socket by their first
// request: requests for the gateway (absolute-form for Host, as a proxy
// client sends them, or origin-form, as a client that talks to the
// forwarder directly does) go to gw; everything else (CONNECT tunnels,
// requests for other hosts) goes to egress, the session's egress proxy,
// which answers what the policy does not allow with 403. It returns once
// ln is closed (the backend closes it when the job ends) and both servers
// have stopped, every connection closed.
func Serve(ln net.Listener, gw http.Handler, egress func(net.Listener)) {
	gwL, egL := newConnListener(ln.Addr()), newConnListener(ln.Addr())
	srv := &http.Server{Handler: gw, ReadHeaderTimeout: sniffTimeout, IdleTimeout: 2 * time.Minute,
		MaxHeaderBytes: 64 << 10, ErrorLog: log.New(io.Discard, "", 0)}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = srv.Serve(gwL) }()
	go func() { defer wg.Done(); egress(egL) }()
	var sniffing sync.WaitGroup
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				break
			}
			time.Sleep(5 * time.Millisecond) // EMFILE and the like: let connections drain
			continue
		}
		sniffing.Add(1)
		go func() {
			defer sniffing.Done()
			route(c, gwL, egL)
		}()
	}
	sniffing.Wait()
	gwL.Close()
	egL.Close()
	_ = srv.Close()
	wg.Wait()
}

// route reads c's request line and hands c, unread, to the server it is for.
func route(c net.Conn, gwL, egL *connListener) {
	_ = c.SetReadDeadline(time.Now().Add(sniffTimeout))
	br := bufio.NewReaderSize(c, maxRequestLine)
	line, ok := peekLine(br)
	if !ok {
		c.Close()
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	to := egL
	if forGateway(string(bytes.TrimSuffix(line, []byte("\r")))) {
		to = gwL
	}
	if !to.push(&peekedConn{Conn: c, r: br}) {
		c.Close()
	}
}

// peekLine returns the first line buffered in br, reading no further than
// its end (or the buffer's size); ok is false when the client sent none.
func peekLine(br *bufio.Reader) ([]byte, bool) {
	for {
		buf, _ := br.Peek(br.Buffered())
		if i := bytes.IndexByte(buf, '\n'); i >= 0 {
			return buf[:i], true
		}
		if len(buf) >= maxRequestLine {
			return buf, true
		}
		if _, err := br.Peek(len(buf) + 1); err != nil {
			buf, _ = br.Peek(br.Buffered())
			return buf, len(buf) > 0
		}
	}
}

// forGateway decides from a request line "METHOD TARGET HTTP/1.x".
// Anything unparsable goes to the egress proxy, which refuses it.
func forGateway(line string) bool {
	method, rest, ok := strings.Cut(line, " ")
	if !ok || method == http.MethodConnect {
		return false
	}
	target, _, _ := strings.Cut(rest, " ")
	if strings.HasPrefix(target, "/") {
		return true
	}
	after, ok := strings.CutPrefix(strings.ToLower(target), "http://")
	if !ok {
		return false
	}
	host, _, _ := strings.Cut(after, "/")
	return IsGatewayHost(host)
}

// peekedConn is a connection whose first bytes were read into r.
type peekedConn struct {
	net.Conn
	r *bufio.Reader
}

func (p *peekedConn) Read(b []byte) (int, error) { return p.r.Read(b) }

// CloseWrite half-closes when the connection can (the proxy's tunnels).
func (p *peekedConn) CloseWrite() error {
	if cw, ok := p.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return p.Conn.Close()
}

// connListener hands routed connections to a server's Accept.
type connListener struct {
	addr   net.Addr
	ch     chan net.Conn
	done   chan struct{}
	closer sync.Once
}

func newConnListener(addr net.Addr) *connListener {
	return &connListener{addr: addr, ch: make(chan net.Conn), done: make(chan struct{})}
}

func (l *connListener) push(c net.Conn) bool {
	select {
	case l.ch <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *connListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *connListener) Close() error {
	l.closer.Do(func() { close(l.done) })
	return nil
}

func (l *connListener) Addr() net.Addr { return l.addr }
