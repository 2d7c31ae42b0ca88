// Package connguard caps the HTTP server's open connections and keeps room
// for authenticated clients: connections that have not yet authenticated
// are capped per client address and are the first to be closed when the
// server is full.
package connguard

import (
	"container/list"
	"context"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"syscall"
)

// Limits bound a Listener.
type Limits struct {
	// MaxConns caps all open connections. At the cap a new connection
	// closes the oldest one not trusted yet, else the longest-idle trusted
	// one; if every connection is busy and trusted, the new one is closed.
	MaxConns int
	// MaxUntrustedPerAddr caps the connections not trusted yet from one
	// client address (an IPv4 address, an IPv6 /64); past it the address's
	// oldest such connection is closed.
	MaxUntrustedPerAddr int
}

// Listener wraps a net.Listener with Limits. Give Listener.ConnContext and
// Listener.ConnState to the http.Server, and call Trust from the handler
// once a request has authenticated.
type Listener struct {
	net.Listener
	limits Limits
	// OnClose, if set, is told why the guard closed a connection:
	// "address_limit", "evicted" or "full". It is called without locks held.
	OnClose func(reason string)

	mu        sync.Mutex
	open      int
	untrusted *list.List            // *conn, oldest first
	byAddr    map[string]*list.List // untrusted *conn per address, oldest first
	trusted   *list.List            // *conn, oldest first
}

// New wraps ln.
func New(ln net.Listener, l Limits) *Listener {
	return &Listener{Listener: ln, limits: l, untrusted: list.New(), byAddr: map[string]*list.List{}, trusted: list.New()}
}

type conn struct {
	net.Conn
	l       *Listener
	addr    string
	trusted bool
	idle    bool
	closed  bool
	elem    *list.Element // in l.untrusted or l.trusted
	addrEl  *list.Element // in l.byAddr[addr] while untrusted
}

// Accept returns the next connection, having made room for it.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		nc, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		c := &conn{Conn: nc, l: l, addr: AddrKey(nc.RemoteAddr().String())}
		victims, reasons, ok := l.admit(c)
		for i, v := range victims {
			_ = v.Conn.Close()
			l.report(reasons[i])
		}
		if ok {
			return c, nil
		}
		_ = nc.Close()
		l.report("full")
	}
}

// admit registers c, choosing the connections to close for it; ok is false
// when there is no room and c must be closed instead.
func (l *Listener) admit(c *conn) (victims []*conn, reasons []string, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if q := l.byAddr[c.addr]; q != nil && l.limits.MaxUntrustedPerAddr > 0 && q.Len() >= l.limits.MaxUntrustedPerAddr {
		v := q.Front().Value.(*conn)
		l.removeLocked(v)
		victims, reasons = append(victims, v), append(reasons, "address_limit")
	}
	if l.limits.MaxConns > 0 && l.open >= l.limits.MaxConns {
		v := l.victimLocked()
		if v == nil {
			return victims, reasons, false
		}
		l.removeLocked(v)
		victims, reasons = append(victims, v), append(reasons, "evicted")
	}
	l.open++
	c.elem = l.untrusted.PushBack(c)
	q := l.byAddr[c.addr]
	if q == nil {
		q = list.New()
		l.byAddr[c.addr] = q
	}
	c.addrEl = q.PushBack(c)
	return victims, reasons, true
}

// victimLocked picks the oldest untrusted connection, else the oldest idle
// trusted one.
func (l *Listener) victimLocked() *conn {
	if e := l.untrusted.Front(); e != nil {
		return e.Value.(*conn)
	}
	for e := l.trusted.Front(); e != nil; e = e.Next() {
		if c := e.Value.(*conn); c.idle {
			return c
		}
	}
	return nil
}

// removeLocked forgets c, once.
func (l *Listener) removeLocked(c *conn) {
	if c.closed {
		return
	}
	c.closed = true
	l.open--
	l.unlinkLocked(c)
}

// unlinkLocked takes c off the lists it is on.
func (l *Listener) unlinkLocked(c *conn) {
	if c.trusted {
		l.trusted.Remove(c.elem)
		return
	}
	l.untrusted.Remove(c.elem)
	q := l.byAddr[c.addr]
	q.Remove(c.addrEl)
	if q.Len() == 0 {
		delete(l.byAddr, c.addr)
	}
}

func (l *Listener) report(reason string) {
	if l.OnClose != nil {
		l.OnClose(reason)
	}
}

// Close forgets the connection and closes it.
func (c *conn) Close() error {
	c.l.mu.Lock()
	c.l.removeLocked(c)
	c.l.mu.Unlock()
	return c.Conn.Close()
}

// Stats reports the open connections and how many are not trusted yet.
func (l *Listener) Stats() (open, untrusted int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open, l.untrusted.Len()
}

type connKey struct{}

// ConnContext is for http.Server.ConnContext: it lets Trust find the
// request's connection.
func (l *Listener) ConnContext(ctx context.Context, c net.Conn) context.Context {
	if gc, ok := c.(*conn); ok && gc.l == l {
		return context.WithValue(ctx, connKey{}, gc)
	}
	return ctx
}

// ConnState is for http.Server.ConnState: it tracks which trusted
// connections sit idle between requests.
func (l *Listener) ConnState(c net.Conn, s http.ConnState) {
	gc, ok := c.(*conn)
	if !ok || gc.l != l {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	switch s {
	case http.StateIdle:
		gc.idle = true
	case http.StateActive:
		gc.idle = false
	case http.StateHijacked, http.StateClosed:
		l.removeLocked(gc)
	}
}

// Trust marks the connection that carries ctx's request as authenticated:
// it no longer counts against its address and is closed for room only when
// idle. A context from elsewhere is ignored.
func Trust(ctx context.Context) {
	c, ok := ctx.Value(connKey{}).(*conn)
	if !ok {
		return
	}
	l := c.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if c.trusted || c.closed {
		return
	}
	l.unlinkLocked(c)
	c.trusted, c.addrEl = true, nil
	c.elem = l.trusted.PushBack(c)
}

// AddrKey groups clients by the remote address "ip:port" (as in
// http.Request.RemoteAddr): one IPv4 address, or one IPv6 /64 (what a
// single host is usually given). Anything else is its own key.
func AddrKey(remote string) string {
	ap, err := netip.ParseAddrPort(remote)
	if err != nil {
		return remote
	}
	ip := ap.Addr().Unmap()
	if ip.Is4() {
		return ip.String()
	}
	p, _ := ip.Prefix(64)
	return p.String()
}

// FitToFileLimit returns max, or less when the process's RLIMIT_NOFILE
// leaves too little room: HTTP connections get at most half the
// descriptors, the rest stays for the stores, sandboxes and egress.
func FitToFileLimit(max int) int {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return max
	}
	if half := rl.Cur / 2; max > 0 && half < uint64(max) {
		return int(half)
	}
	return max
}
