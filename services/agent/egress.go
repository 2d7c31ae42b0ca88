package agent

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// egressDialTimeout bounds the connect to the broker's egress socket, or
// the wait for one of its tunnels.
const egressDialTimeout = 10 * time.Second

// egressForwarder gives a job its network path: a loopback TCP listener
// whose connections are copied byte for byte to and from the broker: its
// Unix socket, or in pod mode a tunnel the broker opened (tunnel.go). The
// sandbox has no other interface than lo (in pod mode, none other it may
// use: the network policy refuses the pod all egress).
type egressForwarder struct {
	ln      net.Listener
	dial    func() (net.Conn, error) // the broker's end
	onClose func()                   // after close, if set

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

func startEgress(sock string) (*egressForwarder, error) {
	return startForwarder(func() (net.Conn, error) { return net.DialTimeout("unix", sock, egressDialTimeout) })
}

func startForwarder(dial func() (net.Conn, error)) (*egressForwarder, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, &jobErr{JobErrInternal, "egress listener: " + err.Error()}
	}
	f := &egressForwarder{ln: ln, dial: dial, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.serve()
	return f, nil
}

func (f *egressForwarder) port() int { return f.ln.Addr().(*net.TCPAddr).Port }

func (f *egressForwarder) serve() {
	defer f.wg.Done()
	backoff := time.Millisecond
	for {
		c, err := f.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(backoff) // EMFILE: let connections drain
			backoff = min(backoff*2, time.Second)
			continue
		}
		backoff = time.Millisecond
		if !f.track(c) {
			c.Close()
			continue
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer f.untrack(c)
			f.forward(c)
		}()
	}
}

// track registers c unless the forwarder is closed or full.
func (f *egressForwarder) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed || len(f.conns) >= MaxEgressConns {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *egressForwarder) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

func (f *egressForwarder) forward(c net.Conn) {
	up, err := f.dial()
	if err != nil {
		return
	}
	if !f.track(up) {
		up.Close()
		return
	}
	defer f.untrack(up)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); copyHalf(up, c) }()
	go func() { defer wg.Done(); copyHalf(c, up) }()
	wg.Wait()
}

// copyHalf copies src to dst, then half-closes dst so that the other side
// sees EOF while the reverse direction keeps going.
func copyHalf(dst, src net.Conn) {
	_, err := io.Copy(dst, src)
	if cw, ok := dst.(interface{ CloseWrite() error }); ok && err == nil {
		_ = cw.CloseWrite()
		return
	}
	// An error on one side ends both directions.
	dst.Close()
	src.Close()
}

// close stops accepting, ends every forwarded connection and waits.
func (f *egressForwarder) close() {
	f.mu.Lock()
	f.closed = true
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.ln.Close()
	if f.onClose != nil {
		f.onClose()
	}
	f.wg.Wait()
}
