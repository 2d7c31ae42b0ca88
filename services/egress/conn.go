package egress

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

var (
	errByteLimit      = errors.New("egress byte limit reached")
	errHeaderTooLarge = errors.New("header too large")
)

// Quota is a connection and byte allowance. By default each Proxy makes
// its own from Options.MaxConns and Options.MaxBytes; give several proxies
// the same Quota (Options.Quota) to cap a whole session across all of its
// executions, whatever policy each one has.
type Quota struct {
	maxConns int64
	active   atomic.Int64 // connections being served, all sharing proxies
	overflow atomic.Int64 // connections being refused with 429
	budget   budget
}

// NewQuota returns an allowance of maxConns concurrent connections and
// maxBytes bytes (both directions, over its life); values <= 0 take the
// defaults (32 connections, 1 GiB).
func NewQuota(maxConns int, maxBytes int64) *Quota {
	if maxConns <= 0 {
		maxConns = defaultMaxConns
	}
	if maxBytes <= 0 {
		maxBytes = defaultMaxBytes
	}
	q := &Quota{maxConns: int64(maxConns)}
	q.budget.max = maxBytes
	return q
}

// MaxConns and MaxBytes are the quota's limits; Used is the bytes spent.
func (q *Quota) MaxConns() int   { return int(q.maxConns) }
func (q *Quota) MaxBytes() int64 { return q.budget.max }
func (q *Quota) Used() int64     { return q.budget.used.Load() }

func (q *Quota) acquire() bool {
	for {
		n := q.active.Load()
		if n >= q.maxConns {
			return false
		}
		if q.active.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

func (q *Quota) release() { q.active.Add(-1) }

// budget is a byte allowance, shared by all the connections of the
// proxies using it and both directions. Reads reserve before they read so
// the cap is exact.
type budget struct {
	max  int64
	used atomic.Int64
}

func (b *budget) reserve(n int) int {
	for {
		u := b.used.Load()
		rem := b.max - u
		if rem <= 0 {
			return 0
		}
		k := int64(n)
		if k > rem {
			k = rem
		}
		if b.used.CompareAndSwap(u, u+k) {
			return int(k)
		}
	}
}

func (b *budget) refund(k int) { b.used.Add(-int64(k)) }

func (b *budget) exhausted() bool { return b.used.Load() >= b.max }

// meter counts every byte read from a conn and, once a tunnel is up,
// reports activity so idleness means "no bytes either way". With enforce
// set, reads stop at the budget; before that (the request header, already
// bounded by MaxHeaderBytes) bytes are only counted, so a refusal can
// still be read and answered once the budget is spent.
// n counts this conn's bytes (read by one goroutine at a time), total the
// proxy's (for Stats when the budget is shared).
type meter struct {
	net.Conn
	b        *budget
	total    *atomic.Int64
	enforce  bool
	activity func()
	n        int64
	err      error // the last read error (bufio may hide it behind a partial line)
}

func (m *meter) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if !m.enforce {
		n, err := m.Conn.Read(p)
		m.count(n)
		m.b.used.Add(int64(n))
		if err != nil {
			m.err = err
		}
		return n, err
	}
	k := m.b.reserve(len(p))
	if k == 0 {
		return 0, errByteLimit
	}
	n, err := m.Conn.Read(p[:k])
	if n < k {
		m.b.refund(k - n)
	}
	m.count(n)
	if err != nil {
		m.err = err
	}
	if n > 0 && m.activity != nil {
		m.activity()
	}
	return n, err
}

func (m *meter) count(n int) {
	m.n += int64(n)
	if m.total != nil {
		m.total.Add(int64(n))
	}
}

// limitReader fails with errHeaderTooLarge after n bytes until lifted
// (n < 0): it bounds header parsing, then lets the body through.
type limitReader struct {
	r   io.Reader
	n   int64
	hit bool
}

func (l *limitReader) Read(p []byte) (int, error) {
	if l.n < 0 {
		return l.r.Read(p)
	}
	if l.n == 0 {
		l.hit = true
		return 0, errHeaderTooLarge
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	return n, err
}

// idler pushes both ends' deadlines forward on activity. SetDeadline is
// cheap and safe to call concurrently with I/O.
type idler struct {
	conns []net.Conn
	idle  time.Duration
}

func (i *idler) touch() {
	dl := time.Now().Add(i.idle)
	for _, c := range i.conns {
		_ = c.SetDeadline(dl)
	}
}

// pipe copies both ways until both directions end. A clean EOF half-closes
// the other side; any error (idle timeout, byte limit) ends both.
// It returns the first error that was not a clean EOF.
func pipe(client net.Conn, fromClient io.Reader, up net.Conn, fromUp io.Reader) error {
	var (
		wg       sync.WaitGroup
		once     sync.Once
		firstErr error
	)
	fail := func(err error) {
		once.Do(func() {
			firstErr = err
			_ = client.Close()
			_ = up.Close()
		})
	}
	one := func(dst net.Conn, src io.Reader) {
		defer wg.Done()
		if _, err := io.Copy(dst, src); err != nil {
			fail(err)
			return
		}
		closeWrite(dst)
	}
	wg.Add(2)
	go one(up, fromClient)
	go one(client, fromUp)
	wg.Wait()
	return firstErr
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		return
	}
	_ = c.Close()
}

// lingerClose half-closes c and drains what the client still sends, for a
// bounded time, so an error reply is not lost to a TCP reset.
// The drain reads c itself: nothing of it is relayed, so it is not metered.
func lingerClose(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, _ = io.Copy(io.Discard, io.LimitReader(c, 256<<10))
	}
	_ = c.Close()
}

// tlsAlertAccessDenied is a fatal TLS access_denied(49) alert record. Sent
// in place of a ServerHello, it makes the client report "access denied"
// instead of a bare EOF when the proxy refuses a tunnel.
var tlsAlertAccessDenied = []byte{0x15, 3, 3, 0, 2, 2, 49}

func sendTLSAlert(c net.Conn) {
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _ = c.Write(tlsAlertAccessDenied)
}
