package agent

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// zygoteScript is the Python zygote. It is passed with `python3 -c`, so no
// file a run could overwrite is involved in (re)starting it.
//
//go:embed zygote.py
var zygoteScript string

const (
	// zygoteReadyTimeout bounds the zygote's start-up (the heavy imports).
	zygoteReadyTimeout = 2 * time.Minute
	// zygoteWaitForReady is how long a run waits for a zygote that is
	// still starting before it falls back to python3.
	zygoteWaitForReady = 10 * time.Second
	// zygoteReplyTimeout bounds the zygote's answer to a fork request.
	zygoteReplyTimeout = 2 * time.Second
	// zygoteMaxBackoff caps the delay between restarts of a failing zygote.
	zygoteMaxBackoff = 30 * time.Second
)

type zygote struct {
	cmd  *exec.Cmd
	conn *net.UnixConn
	pid  int
	dead chan struct{} // closed once the process has been waited for
}

func (z *zygote) kill() { _ = z.cmd.Process.Kill() }

// zygoteManager keeps one Python zygote alive, restarting it in the
// background with backoff when it dies or misbehaves.
type zygoteManager struct {
	s *Server

	mu       sync.Mutex
	ctx      context.Context
	cur      *zygote       // ready zygote, nil if none
	starting bool          // a boot is in progress or scheduled
	settled  chan struct{} // closed when the current boot attempt ends
	failures int
	closed   bool
	all      map[*zygote]bool // every live zygote process, for shutdown
}

func newZygoteManager(s *Server) *zygoteManager {
	return &zygoteManager{s: s, all: map[*zygote]bool{}}
}

func (m *zygoteManager) start(ctx context.Context) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.ctx = ctx
	m.launchLocked()
}

func (m *zygoteManager) ready() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cur != nil
}

// launchLocked schedules a boot unless one is under way.
func (m *zygoteManager) launchLocked() {
	if m.starting || m.closed || m.cur != nil || m.ctx == nil || m.ctx.Err() != nil {
		return
	}
	m.starting = true
	m.settled = make(chan struct{})
	delay := time.Duration(0)
	if m.failures > 0 {
		delay = 100 * time.Millisecond << min(m.failures-1, 10)
		delay = min(delay, zygoteMaxBackoff)
	}
	go m.boot(m.ctx, delay, m.settled)
}

func (m *zygoteManager) boot(ctx context.Context, delay time.Duration, settled chan struct{}) {
	z, err := m.bootOnce(ctx, delay)
	m.mu.Lock()
	m.starting = false
	if err == nil && m.closed {
		err = errors.New("agent shutting down")
	}
	if err == nil {
		select {
		case <-z.dead: // died before it could be used; died() saw starting
			err = errors.New("exited right after start")
		default:
		}
	}
	if err == nil {
		m.cur = z
		m.failures = 0
	} else {
		m.failures++
	}
	close(settled)
	hook := m.s.opts.zygoteReady
	m.mu.Unlock()
	if err != nil {
		if z != nil {
			z.kill()
		}
		if ctx.Err() == nil {
			m.s.logf("zygote: %v", err)
		}
		m.mu.Lock()
		m.launchLocked() // retry with backoff (no-op when shutting down)
		m.mu.Unlock()
		return
	}
	if hook != nil {
		hook(z.pid)
	}
}

// bootOnce starts a zygote and waits for its ready message.
func (m *zygoteManager) bootOnce(ctx context.Context, delay time.Duration) (*zygote, error) {
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	s := m.s
	bin, err := lookPath("python3", envValue(s.opts.Env, "PATH"))
	if err != nil {
		return nil, errors.New("python3 not found on PATH")
	}
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_SEQPACKET|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	ours := os.NewFile(uintptr(fds[0]), "zygote-ctrl")
	theirs := os.NewFile(uintptr(fds[1]), "zygote-ctrl-child")
	defer theirs.Close()
	fc, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		return nil, fmt.Errorf("zygote conn: %w", err)
	}
	conn := fc.(*net.UnixConn)
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		conn.Close()
		return nil, err
	}
	defer devnull.Close()
	c := &exec.Cmd{
		Path:        bin,
		Args:        []string{"python3", "-c", zygoteScript},
		Env:         s.opts.Env,
		Dir:         "/",
		Stdin:       devnull,
		Stdout:      devnull,
		Stderr:      s.log,
		ExtraFiles:  []*os.File{theirs}, // fd 3
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
		WaitDelay:   time.Second,
	}
	spawnMu.Lock()
	err = c.Start()
	if err == nil {
		protected[c.Process.Pid] = true
		managed[c.Process.Pid] = true
	}
	spawnMu.Unlock()
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("start: %w", err)
	}
	z := &zygote{cmd: c, conn: conn, pid: c.Process.Pid, dead: make(chan struct{})}
	m.mu.Lock()
	m.all[z] = true
	m.mu.Unlock()
	go func() {
		err := c.Wait()
		spawnMu.Lock()
		delete(protected, z.pid)
		delete(managed, z.pid)
		spawnMu.Unlock()
		conn.Close()
		close(z.dead)
		m.died(z, err)
	}()

	_ = conn.SetReadDeadline(time.Now().Add(zygoteReadyTimeout))
	stop := context.AfterFunc(ctx, func() { _ = conn.SetReadDeadline(time.Now()) })
	defer stop()
	var hello struct {
		Ready     bool     `json:"ready"`
		PID       int      `json:"pid"`
		Preloaded []string `json:"preloaded"`
	}
	if err := readMsg(conn, &hello); err != nil {
		return z, fmt.Errorf("waiting for ready: %w", err)
	}
	if !hello.Ready || hello.PID != z.pid {
		return z, fmt.Errorf("bad ready message (pid %d, want %d)", hello.PID, z.pid)
	}
	_ = conn.SetReadDeadline(time.Time{})
	s.logf("zygote %d ready, preloaded %v", z.pid, hello.Preloaded)
	return z, nil
}

// died is called once a zygote process has exited.
func (m *zygoteManager) died(z *zygote, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.all, z)
	if m.cur == z {
		m.cur = nil
		m.failures++
		if !m.closed {
			m.s.logf("zygote %d exited (%v); restarting", z.pid, err)
		}
	}
	m.launchLocked()
}

// discard kills a misbehaving zygote; died schedules its replacement.
func (m *zygoteManager) discard(z *zygote, why error) {
	m.s.logf("zygote %d discarded: %v", z.pid, why)
	m.mu.Lock()
	if m.cur == z {
		m.cur = nil
	}
	m.launchLocked()
	m.mu.Unlock()
	z.kill()
}

// discardTainted discards a zygote that failed after it may have received
// a request: it may have forked a child running the code already, so the
// zygote is killed and a sweep runs before the caller falls back to a
// direct spawn (the code must not run twice).
func (m *zygoteManager) discardTainted(z *zygote, why error) {
	m.discard(z, why)
	select {
	case <-z.dead:
	case <-time.After(killGraceWait):
	}
	sweep(m.s.mode, m.s.opts.ProcRoot)
}

// get returns the ready zygote, waiting a bounded time for one that is
// starting.
func (m *zygoteManager) get(ctx context.Context) (*zygote, error) {
	m.mu.Lock()
	z, settled := m.cur, m.settled
	starting := m.starting
	if z == nil && !starting {
		m.launchLocked()
	}
	m.mu.Unlock()
	if z != nil {
		return z, nil
	}
	if !starting {
		return nil, errors.New("no zygote running")
	}
	t := time.NewTimer(zygoteWaitForReady)
	defer t.Stop()
	select {
	case <-settled:
	case <-t.C:
		return nil, errors.New("zygote still starting")
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	m.mu.Lock()
	z = m.cur
	m.mu.Unlock()
	if z == nil {
		return nil, errors.New("zygote failed to start")
	}
	return z, nil
}

// spawn asks the zygote to fork a child running path with the given stdio.
// Any failure discards the zygote (a replacement starts in the background)
// and is returned so that the caller falls back to a direct spawn.
func (m *zygoteManager) spawn(ctx context.Context, path, cwd string, env map[string]string, stdin, stdout, stderr *os.File) (*proc, error) {
	z, err := m.get(ctx)
	if err != nil {
		return nil, err
	}
	select {
	case <-z.dead:
		m.discard(z, errors.New("exited"))
		return nil, errors.New("zygote exited")
	default:
	}
	msg, _ := json.Marshal(map[string]any{"path": path, "cwd": cwd, "env": env})
	rights := syscall.UnixRights(int(stdin.Fd()), int(stdout.Fd()), int(stderr.Fd()))
	_ = z.conn.SetDeadline(time.Now().Add(zygoteReplyTimeout))
	if _, _, err := z.conn.WriteMsgUnix(msg, rights, nil); err != nil {
		m.discardTainted(z, fmt.Errorf("send: %w", err))
		return nil, err
	}
	var reply struct {
		PID   int    `json:"pid"`
		Error string `json:"error"`
	}
	if err := readMsg(z.conn, &reply); err != nil {
		m.discardTainted(z, fmt.Errorf("fork reply: %w", err))
		return nil, err
	}
	if reply.Error != "" || reply.PID <= 1 {
		err := fmt.Errorf("zygote: %s (pid %d)", reply.Error, reply.PID)
		// A fork failure (e.g. the pids limit) is not the zygote's fault.
		return nil, err
	}
	_ = z.conn.SetDeadline(time.Time{})
	pid := reply.PID
	// The child is not ours, but if the zygote dies it is re-parented to
	// the agent (subreaper): mark it managed so that the sweep leaves its
	// zombie for waitOrphan.
	spawnMu.Lock()
	managed[pid] = true
	spawnMu.Unlock()
	done := make(chan outcome, 1)
	go func() {
		o := m.awaitStatus(ctx, z, pid)
		spawnMu.Lock()
		delete(managed, pid)
		spawnMu.Unlock()
		done <- o
	}()
	return &proc{pid: pid, done: done, abandon: func() {
		m.discard(z, errors.New("no exit status after SIGKILL"))
	}}, nil
}

// awaitStatus reads the child's exit status from the zygote; if the zygote
// dies first, it waits for the orphaned child itself.
func (m *zygoteManager) awaitStatus(ctx context.Context, z *zygote, pid int) outcome {
	for {
		var st struct {
			PID    int  `json:"pid"`
			Exit   *int `json:"exit"`
			Signal *int `json:"signal"`
		}
		err := readMsg(z.conn, &st)
		if err != nil {
			m.discard(z, fmt.Errorf("exit status: %w", err))
			return waitOrphan(ctx, pid)
		}
		if st.PID != pid {
			continue
		}
		switch {
		case st.Signal != nil:
			return outcome{exitCode: -1, signal: signalName(syscall.Signal(*st.Signal))}
		case st.Exit != nil:
			if *st.Exit < 0 { // waitstatus_to_exitcode gives -sig
				return outcome{exitCode: -1, signal: signalName(syscall.Signal(-*st.Exit))}
			}
			return outcome{exitCode: *st.Exit}
		}
		return outcome{exitCode: -1}
	}
}

// waitOrphan waits for a run child whose zygote died. The child is then the
// agent's (subreaper) child, so wait4 yields its status; if it is not (no
// subreaper), poll until it is gone and report exit code -1.
func waitOrphan(ctx context.Context, pid int) outcome {
	for {
		var ws syscall.WaitStatus
		wpid, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		if wpid == pid {
			return outcomeOfStatus(ws)
		}
		if errors.Is(err, syscall.ECHILD) {
			if syscall.Kill(pid, 0) != nil {
				return outcome{exitCode: -1}
			}
		}
		select {
		case <-ctx.Done():
			_ = syscall.Kill(pid, syscall.SIGKILL)
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// shutdown kills every zygote and waits for them.
func (m *zygoteManager) shutdown() {
	m.mu.Lock()
	m.closed = true
	m.cur = nil
	zs := make([]*zygote, 0, len(m.all))
	for z := range m.all {
		zs = append(zs, z)
	}
	settled := m.settled
	m.mu.Unlock()
	if settled != nil {
		<-settled // ctx is done, so a boot in progress returns promptly
	}
	m.mu.Lock()
	for z := range m.all {
		if !containsZygote(zs, z) {
			zs = append(zs, z)
		}
	}
	m.mu.Unlock()
	for _, z := range zs {
		z.conn.Close() // the zygote exits on EOF
		select {
		case <-z.dead:
		case <-time.After(time.Second):
			z.kill()
			<-z.dead
		}
	}
}

func containsZygote(zs []*zygote, z *zygote) bool {
	for _, x := range zs {
		if x == z {
			return true
		}
	}
	return false
}

// readMsg reads one packet and decodes it as JSON.
func readMsg(c *net.UnixConn, v any) error {
	buf := make([]byte, 64<<10)
	oob := make([]byte, 256)
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return err
	}
	if oobn > 0 {
		// The zygote never sends descriptors; close any it did.
		if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, msg := range msgs {
				if fds, err := syscall.ParseUnixRights(&msg); err == nil {
					for _, fd := range fds {
						syscall.Close(fd)
					}
				}
			}
		}
	}
	if n == 0 {
		return errors.New("zygote closed the connection")
	}
	return json.Unmarshal(buf[:n], v)
}
