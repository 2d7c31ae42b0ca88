package agent

import (
	"bufio"
	"errors"
	"net"
	"sync"
	"time"
)

// Egress tunnels (pod mode). A pod may not open any connection (its
// network policy refuses all egress), so a job's proxy traffic rides on
// connections the broker opens to the agent: the broker keeps a few
// OpEgress connections parked for the job's tunnel token; when the job
// connects to its loopback proxy port, the agent takes one, writes a single
// newline to tell the broker it is in use, and from then on copies bytes
// both ways, exactly as it does to the broker's egress socket under Docker.

// tunnelTable holds the parked tunnels of each job by token. The zero
// value is ready.
type tunnelTable struct {
	mu sync.Mutex
	m  map[string]*tunnelQueue
}

type tunnelQueue struct {
	ch   chan *parkedTunnel
	done chan struct{} // closed when the job's forwarder closes
}

// parkedTunnel is one broker connection waiting to be used; done is
// closed once the forwarder is finished with it.
type parkedTunnel struct {
	c    net.Conn
	done chan struct{}
	once sync.Once
}

func (p *parkedTunnel) finish() { p.once.Do(func() { close(p.done) }) }

// open registers token's queue and returns the forwarder's dial function
// and the function that unregisters it, ending every parked tunnel.
func (t *tunnelTable) open(token string) (dial func() (net.Conn, error), closeFn func(), ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string]*tunnelQueue{}
	}
	if _, dup := t.m[token]; dup {
		return nil, nil, false
	}
	q := &tunnelQueue{ch: make(chan *parkedTunnel, MaxEgressConns), done: make(chan struct{})}
	t.m[token] = q
	var once sync.Once
	closeFn = func() {
		once.Do(func() {
			// Under t.mu: park queues nothing once the token is gone.
			t.mu.Lock()
			delete(t.m, token)
			t.mu.Unlock()
			close(q.done)
		})
		for {
			select {
			case p := <-q.ch:
				p.finish()
			default:
				return
			}
		}
	}
	return q.dial, closeFn, true
}

// dial waits for a parked tunnel and claims it.
func (q *tunnelQueue) dial() (net.Conn, error) {
	t := time.NewTimer(egressDialTimeout)
	defer t.Stop()
	for {
		select {
		case p := <-q.ch:
			_ = p.c.SetWriteDeadline(time.Now().Add(egressDialTimeout))
			if _, err := p.c.Write([]byte{'\n'}); err != nil {
				p.finish()
				continue // the broker gave this one up; try the next
			}
			_ = p.c.SetWriteDeadline(time.Time{})
			return &claimedTunnel{Conn: p.c, p: p}, nil
		case <-q.done:
			return nil, net.ErrClosed
		case <-t.C:
			return nil, errors.New("agent: no egress tunnel from the broker")
		}
	}
}

// park queues c (whose first line named token) and waits until the
// forwarder is done with it; false when token is unknown or full.
func (t *tunnelTable) park(token string, c net.Conn) bool {
	p := &parkedTunnel{c: c, done: make(chan struct{})}
	t.mu.Lock()
	q := t.m[token]
	queued := false
	if q != nil {
		select {
		case q.ch <- p:
			queued = true
		default:
		}
	}
	t.mu.Unlock()
	if !queued {
		return false
	}
	// Finished when the forwarder closes it, or when the job ends with it
	// still parked.
	<-p.done
	return true
}

// claimedTunnel is a tunnel handed to the forwarder: closing it releases
// the broker's connection.
type claimedTunnel struct {
	net.Conn
	p *parkedTunnel
}

func (c *claimedTunnel) Close() error {
	err := c.Conn.Close()
	c.p.finish()
	return err
}

func (c *claimedTunnel) CloseWrite() error { return closeWrite(c.Conn) }

// bufferedConn reads first what a bufio.Reader already took from the
// connection.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(b []byte) (int, error) { return c.r.Read(b) }

func (c *bufferedConn) CloseWrite() error { return closeWrite(c.Conn) }

func closeWrite(c net.Conn) error {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.New("close write not supported")
}
