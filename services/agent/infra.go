package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Infrastructure processes. The agent's resident helpers (the Python
// zygote and its idle spares, the Node resident that type-checks
// TypeScript, the idle Node spare) and the notebook kernel's client all
// live in the agent's own session. Nothing can join a session (setsid
// makes a new one, setpgid moves only within one), and every spare calls
// setsid before it runs any code of a run, so the agent's session holds
// infrastructure only, from the sandbox's start to its end. The host's
// stray check (Strays, by session) therefore counts it as existing before
// every run whatever starts or stops in it (warm-ups, idle releases,
// restarts), with no list of pids to take from the (untrusted) agent.
//
// The post-run sweep spares exactly: the protected pids (live zygotes, the
// Node resident, the idle Node spare), the notebook kernel and its client
// (notebookProcs), and a zygote's idle spares (its children still in the
// agent's session, see spareOfZygote).

// codeLock keeps the boot of an infrastructure process apart from the code
// of runs: a process is traceable by code of the same uid (and open to
// writes through /proc/<pid>/mem) until it has made itself non-dumpable,
// so it starts (exclusive lock) only while no run's code executes (read
// lock, from a run's start to the end of its sweep), and reports sealed
// before the lock is let go. A job's code, which lives beside runs for as
// long as its timeout allows, is not held back.
var codeLock sync.RWMutex

// sealTimeout bounds the wait for a starting process to seal itself.
const sealTimeout = 30 * time.Second

// infraSID is the agent's session ID (set by newServer).
var infraSID int

func initInfraSession() {
	if sid, err := unix.Getsid(0); err == nil {
		infraSID = sid
	}
}

// startInfra starts c in the agent's session (in a process group of its
// own when ownGroup) and registers it as protected.
func (s *Server) startInfra(c *exec.Cmd, ownGroup bool) (*child, error) {
	c.SysProcAttr = &syscall.SysProcAttr{Setpgid: ownGroup}
	if c.WaitDelay == 0 {
		c.WaitDelay = time.Second
	}
	return startRegistered(c, protected)
}

// unprotect makes pid an ordinary run for the sweep: a Node spare that
// took a job.
func unprotect(pid int) {
	spawnMu.Lock()
	delete(protected, pid)
	spawnMu.Unlock()
}

// infraProc is a process a keeper keeps.
type infraProc interface {
	comparable
	procID() int
	kill()
	exited() <-chan struct{}
}

// keeperMaxBackoff caps the delay between restarts of a failing process.
const keeperMaxBackoff = 30 * time.Second

// keeper keeps one infrastructure process of a kind ready once it is
// wanted (warm): it boots one in the background, restarts it with backoff
// when it dies, and stops both until wanted again on release.
type keeper[P infraProc] struct {
	s    *Server
	name string
	// start starts a process (registered as protected); sealed waits for
	// it to say it is non-dumpable, ready for it to say it is ready. A
	// started process is killed by the keeper when either fails.
	start  func() (P, error)
	sealed func(ctx context.Context, p P) error
	ready  func(ctx context.Context, p P) error
	// onReady, if set, is called with the pid of every process that
	// became ready (tests).
	onReady func(pid int)

	mu       sync.Mutex
	ctx      context.Context
	want     bool
	cur      P             // ready process, zero if none
	starting bool          // a boot is in progress or scheduled
	settled  chan struct{} // closed when the current boot attempt ends
	failures int
	closed   bool
	all      map[P]bool // every live process, for release and shutdown
}

func newKeeper[P infraProc](s *Server, name string, start func() (P, error), sealed, ready func(context.Context, P) error) *keeper[P] {
	return &keeper[P]{s: s, name: name, start: start, sealed: sealed, ready: ready, all: map[P]bool{}}
}

// begin gives the keeper the agent's lifetime; nothing boots before it.
func (k *keeper[P]) begin(ctx context.Context) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.ctx = ctx
	k.launchLocked()
}

// warm makes the process wanted and boots it unless one is ready or
// booting.
func (k *keeper[P]) warm() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.want = true
	k.launchLocked()
}

func (k *keeper[P]) wanted() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.want
}

func (k *keeper[P]) isReady() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	var zero P
	return k.cur != zero
}

// release kills every process of the kind and keeps it down until the
// next warm.
func (k *keeper[P]) release() {
	k.mu.Lock()
	k.want = false
	k.failures = 0
	var zero P
	k.cur = zero
	ps := make([]P, 0, len(k.all))
	for p := range k.all {
		ps = append(ps, p)
	}
	k.mu.Unlock()
	for _, p := range ps {
		p.kill()
	}
	for _, p := range ps {
		select {
		case <-p.exited():
		case <-time.After(killGraceWait):
		}
	}
}

// launchLocked schedules a boot unless one is under way or none is wanted.
func (k *keeper[P]) launchLocked() {
	var zero P
	if k.starting || k.closed || !k.want || k.cur != zero || k.ctx == nil || k.ctx.Err() != nil {
		return
	}
	k.starting = true
	k.settled = make(chan struct{})
	delay := time.Duration(0)
	if k.failures > 0 {
		delay = min(100*time.Millisecond<<min(k.failures-1, 10), keeperMaxBackoff)
	}
	go k.boot(k.ctx, delay, k.settled)
}

func (k *keeper[P]) boot(ctx context.Context, delay time.Duration, settled chan struct{}) {
	p, started, err := k.bootOnce(ctx, delay)
	k.mu.Lock()
	k.starting = false
	if err == nil && (k.closed || !k.want) {
		err = errors.New("no longer wanted")
	}
	if err == nil {
		select {
		case <-p.exited(): // died before it could be used
			err = errors.New("exited right after start")
		default:
		}
	}
	if err == nil {
		k.cur = p
		k.failures = 0
	} else if k.want {
		k.failures++
	}
	close(settled)
	hook := k.onReady
	k.mu.Unlock()
	if err != nil {
		if started {
			p.kill()
		}
		if ctx.Err() == nil && k.wanted() {
			k.s.logf("%s: %v", k.name, err)
		}
		k.mu.Lock()
		k.launchLocked() // retry with backoff (no-op when not wanted)
		k.mu.Unlock()
		return
	}
	k.s.logf("%s %d ready", k.name, p.procID())
	if hook != nil {
		hook(p.procID())
	}
}

func (k *keeper[P]) bootOnce(ctx context.Context, delay time.Duration) (p P, started bool, err error) {
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return p, false, ctx.Err()
		}
	}
	codeLock.Lock()
	p, err = k.start()
	if err != nil {
		codeLock.Unlock()
		return p, false, err
	}
	k.mu.Lock()
	k.all[p] = true
	k.mu.Unlock()
	go func() {
		<-p.exited()
		k.died(p)
	}()
	sctx, cancel := context.WithTimeout(ctx, sealTimeout)
	err = k.sealed(sctx, p)
	cancel()
	codeLock.Unlock()
	if err != nil {
		return p, true, fmt.Errorf("not sealed: %w", err)
	}
	return p, true, k.ready(ctx, p)
}

// died is called once a process has exited.
func (k *keeper[P]) died(p P) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.all, p)
	if k.cur == p {
		var zero P
		k.cur = zero
		k.failures++
		if !k.closed && k.want {
			k.s.logf("%s %d exited; restarting", k.name, p.procID())
		}
	}
	k.launchLocked()
}

// discard kills a misbehaving process; died schedules its replacement.
func (k *keeper[P]) discard(p P, why error) {
	k.s.logf("%s %d discarded: %v", k.name, p.procID(), why)
	k.mu.Lock()
	if k.cur == p {
		var zero P
		k.cur = zero
	}
	k.launchLocked()
	k.mu.Unlock()
	p.kill()
}

// get returns the ready process, waiting up to wait for one that is
// booting; with take, the process is the caller's from then on, and the
// caller boots the next one (warm) once its run holds codeLock: a boot
// started before would take codeLock first and hold the run back until
// the new process has sealed itself. A caller holding codeLock must not
// wait: the boot needs it.
func (k *keeper[P]) get(ctx context.Context, wait time.Duration, take bool) (P, error) {
	var zero P
	k.mu.Lock()
	p, settled, starting := k.cur, k.settled, k.starting
	if p != zero && take {
		k.cur = zero
	}
	k.mu.Unlock()
	if p != zero {
		return p, nil
	}
	if !starting {
		return zero, errors.New("not running")
	}
	if wait <= 0 {
		return zero, errors.New("still starting")
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-settled:
	case <-t.C:
		return zero, errors.New("still starting")
	case <-ctx.Done():
		return zero, ctx.Err()
	}
	return k.get(ctx, 0, take)
}

// shutdown kills every process and waits for them.
func (k *keeper[P]) shutdown() {
	k.mu.Lock()
	k.closed = true
	settled := k.settled
	k.mu.Unlock()
	if settled != nil {
		<-settled // ctx is done, so a boot in progress returns promptly
	}
	k.release()
}

// childSocket makes a socket pair of type typ (SOCK_STREAM or
// SOCK_SEQPACKET) for a child the agent starts: the agent's end as a
// connection, and the child's end to pass in ExtraFiles, which the caller
// closes once the child has started.
func childSocket(typ int) (*net.UnixConn, *os.File, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, typ|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	ours := os.NewFile(uintptr(fds[0]), "ctrl")
	theirs := os.NewFile(uintptr(fds[1]), "ctrl-child")
	c, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		theirs.Close()
		return nil, nil, fmt.Errorf("socket conn: %w", err)
	}
	return c.(*net.UnixConn), theirs, nil
}
