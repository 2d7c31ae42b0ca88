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
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// zygoteScript is the Python zygote: zygote.py, then spare.py (its
// children's side), which ends by starting it. It is passed with `python3
// -c`, so no file a run could overwrite is involved in (re)starting it.
var zygoteScript = zygoteMain + "\n" + zygoteSpare

var (
	//go:embed zygote.py
	zygoteMain string
	//go:embed spare.py
	zygoteSpare string
)

const (
	// zygoteReadyTimeout bounds the zygote's start-up (the heavy imports).
	zygoteReadyTimeout = 2 * time.Minute
	// zygoteReplyTimeout bounds the zygote's answer to a fork request.
	zygoteReplyTimeout = 2 * time.Second
)

// zygote is one running zygote and the state of its spares (see
// zygote.py): its reader (serve) takes in the spares it forks and the exit
// statuses of its children.
type zygote struct {
	ch   *child
	conn *net.UnixConn
	pid  int
	dead chan struct{} // closed when serve stops: no more spares or statuses

	mu      sync.Mutex
	spare   *spare               // idle, not yet handed a job
	asked   bool                 // a fork request is outstanding
	forkErr string               // the zygote could not fork the spare asked for
	changed chan struct{}        // closed and replaced when the fields above change
	waits   map[int]chan outcome // runs waiting for the zygote's word on their end
}

// spare is an idle spare: its pid and the agent's end of its channel.
type spare struct {
	pid  int
	conn *net.UnixConn
}

func newZygote(ch *child, conn *net.UnixConn) *zygote {
	// asked: the first spare comes unasked.
	return &zygote{ch: ch, conn: conn, pid: ch.pid, dead: make(chan struct{}), asked: true,
		changed: make(chan struct{}), waits: map[int]chan outcome{}}
}

func (z *zygote) procID() int             { return z.pid }
func (z *zygote) kill()                   { _ = syscall.Kill(z.pid, syscall.SIGKILL) }
func (z *zygote) exited() <-chan struct{} { return z.ch.done }

// zygoteManager keeps one Python zygote alive once warm, restarting it in
// the background with backoff when it dies or misbehaves. A run never
// waits for it: until it is ready, python runs start python3 directly.
type zygoteManager struct {
	*keeper[*zygote]
}

func newZygoteManager(s *Server) *zygoteManager {
	m := &zygoteManager{}
	m.keeper = newKeeper(s, "zygote", m.startZygote, m.waitSealed, m.waitZygote)
	m.onReady = s.opts.zygoteReady
	return m
}

// startZygote starts a zygote in the agent's session, in a process group
// of its own (its spares, not group leaders, can then call setsid).
func (m *zygoteManager) startZygote() (*zygote, error) {
	s := m.s
	bin, err := lookPath("python3", envValue(s.opts.Env, "PATH"))
	if err != nil {
		return nil, errors.New("python3 not found on PATH")
	}
	conn, theirs, err := childSocket(syscall.SOCK_SEQPACKET)
	if err != nil {
		return nil, err
	}
	defer theirs.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		conn.Close()
		return nil, err
	}
	defer devnull.Close()
	ch, err := s.startInfra(&exec.Cmd{
		Path:       bin,
		Args:       []string{"python3", "-s", "-c", zygoteScript, figuresBackend}, // -s: no user site (runs write it)
		Env:        s.opts.Env,
		Dir:        "/",
		Stdin:      devnull,
		Stdout:     devnull,
		Stderr:     s.log,
		ExtraFiles: []*os.File{theirs}, // fd 3
	}, true)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("start: %w", err)
	}
	go func() {
		<-ch.done
		conn.Close()
	}()
	return newZygote(ch, conn), nil
}

// waitSealed waits for the zygote's first message: it is non-dumpable.
func (m *zygoteManager) waitSealed(ctx context.Context, z *zygote) error {
	_ = z.conn.SetReadDeadline(time.Now().Add(sealTimeout))
	stop := context.AfterFunc(ctx, func() { _ = z.conn.SetReadDeadline(time.Now()) })
	defer stop()
	var m1 struct {
		Sealed bool `json:"sealed"`
	}
	if err := readMsg(z.conn, &m1); err != nil {
		return err
	}
	if !m1.Sealed {
		return errors.New("bad first message")
	}
	return nil
}

// waitZygote waits for the zygote's ready message.
func (m *zygoteManager) waitZygote(ctx context.Context, z *zygote) error {
	_ = z.conn.SetReadDeadline(time.Now().Add(zygoteReadyTimeout))
	stop := context.AfterFunc(ctx, func() { _ = z.conn.SetReadDeadline(time.Now()) })
	defer stop()
	var hello struct {
		Ready     bool     `json:"ready"`
		PID       int      `json:"pid"`
		Preloaded []string `json:"preloaded"`
		HotPages  int      `json:"hot_pages"`
	}
	if err := readMsg(z.conn, &hello); err != nil {
		return fmt.Errorf("waiting for ready: %w", err)
	}
	if !hello.Ready || hello.PID != z.pid {
		return fmt.Errorf("bad ready message (pid %d, want %d)", hello.PID, z.pid)
	}
	_ = z.conn.SetReadDeadline(time.Time{})
	m.s.logf("zygote %d preloaded %v; its spares copy %d pages ahead", z.pid, hello.Preloaded, hello.HotPages)
	go m.serve(z)
	return nil
}

// serve reads what the zygote sends once ready: its spares and the ends
// of its children. When it stops (the zygote died, or sent something it
// must not), the zygote is discarded and every run waiting on it is told.
func (m *zygoteManager) serve(z *zygote) {
	err := z.serve()
	z.mu.Lock()
	close(z.dead)
	if z.spare != nil {
		z.spare.conn.Close()
		z.spare = nil
	}
	z.notifyLocked()
	z.mu.Unlock()
	// A zygote that closed its end is on its way out (the agent is
	// stopping, or it was killed); one that sent what it must not goes.
	t := time.NewTimer(killGraceWait)
	defer t.Stop()
	select {
	case <-z.exited():
	case <-t.C:
		m.discard(z, err)
	}
}

// zygoteMsg is one message of a ready zygote.
type zygoteMsg struct {
	Spare  int    `json:"spare"`
	PID    int    `json:"pid"`
	Exit   *int   `json:"exit"`
	Signal *int   `json:"signal"`
	Taken  *bool  `json:"taken"`
	Error  string `json:"error"`
}

func (z *zygote) serve() error {
	for {
		var m zygoteMsg
		fds, err := readMsgFDs(z.conn, &m)
		if err != nil {
			return err
		}
		switch {
		case m.Spare > 1 && len(fds) == 1:
			f := os.NewFile(uintptr(fds[0]), "spare")
			c, err := net.FileConn(f)
			f.Close()
			uc, ok := c.(*net.UnixConn)
			if err != nil || !ok {
				return fmt.Errorf("spare %d: bad channel", m.Spare)
			}
			z.mu.Lock()
			old := z.spare
			z.spare, z.asked = &spare{pid: m.Spare, conn: uc}, false
			z.notifyLocked()
			z.mu.Unlock()
			if old != nil { // never asked for: the zygote is not ours to trust
				old.conn.Close()
				return errors.New("a spare it was not asked for")
			}
		case m.PID > 1 && len(fds) == 0 && (m.Exit != nil || m.Signal != nil):
			o := outcome{exitCode: -1, notTaken: m.Taken != nil && !*m.Taken}
			if m.Signal != nil {
				o.signal = signalName(syscall.Signal(*m.Signal))
			} else {
				o.exitCode = *m.Exit
			}
			z.mu.Lock()
			if w := z.waits[m.PID]; w != nil {
				w <- o // buffered; one word per child
				delete(z.waits, m.PID)
			}
			if z.spare != nil && z.spare.pid == m.PID { // died idle
				z.spare.conn.Close()
				z.spare = nil
				z.notifyLocked()
			}
			z.mu.Unlock()
		case m.Error != "" && len(fds) == 0:
			z.mu.Lock()
			z.asked, z.forkErr = false, m.Error
			z.notifyLocked()
			z.mu.Unlock()
		default:
			for _, fd := range fds {
				syscall.Close(fd)
			}
			return errors.New("unexpected message")
		}
	}
}

// notifyLocked wakes everyone waiting on a change. Caller holds z.mu.
func (z *zygote) notifyLocked() {
	close(z.changed)
	z.changed = make(chan struct{})
}

// expect registers a wait for the zygote's word on pid's end.
func (z *zygote) expect(pid int) <-chan outcome {
	w := make(chan outcome, 1)
	z.mu.Lock()
	z.waits[pid] = w
	z.mu.Unlock()
	return w
}

func (z *zygote) forget(pid int) {
	z.mu.Lock()
	delete(z.waits, pid)
	z.mu.Unlock()
}

// errForkFailed: the zygote could not fork a spare (the pids limit, say).
var errForkFailed = errors.New("zygote: fork failed")

// takeSpare takes the idle spare, asking for one and waiting up to wait
// when there is none.
func (z *zygote) takeSpare(ctx context.Context, wait time.Duration) (*spare, error) {
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		z.mu.Lock()
		sp, ferr, changed := z.spare, z.forkErr, z.changed
		z.spare, z.forkErr = nil, ""
		z.mu.Unlock()
		select {
		case <-z.dead:
			return nil, errors.New("zygote gone")
		default:
		}
		switch {
		case sp != nil:
			return sp, nil
		case ferr != "":
			return nil, fmt.Errorf("%w: %s", errForkFailed, ferr)
		}
		if err := z.requestSpare(); err != nil {
			return nil, err
		}
		select {
		case <-changed:
		case <-z.dead:
		case <-t.C:
			return nil, errNoSpare
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// requestSpare asks the zygote to fork the next spare unless one is idle
// or asked for already.
func (z *zygote) requestSpare() error {
	z.mu.Lock()
	if z.spare != nil || z.asked {
		z.mu.Unlock()
		return nil
	}
	z.asked = true
	z.mu.Unlock()
	_ = z.conn.SetWriteDeadline(time.Now().Add(zygoteReplyTimeout))
	_, err := z.conn.Write([]byte(`{"fork": true}`))
	if err != nil {
		return fmt.Errorf("fork request: %w", err)
	}
	return nil
}

// errNoSpare: the zygote did not hand over a spare in time (wedged).
var errNoSpare = errors.New("no spare within the timeout")

// spareDelay is how long a run goes before the next spare is asked for
// while it still runs; a shorter run's successor is asked for answerGrace
// after its answer has been written, so that the fork and the new
// spare's preparation compete neither with the run nor with the broker
// finishing the call (on a 2-core machine that cost the call 2.7 ms at
// p50, between the agent writing its answer and the broker reading it).
// A run that comes first asks for its spare itself (takeSpare).
const (
	spareDelay  = 10 * time.Millisecond
	answerGrace = 5 * time.Millisecond
)

// spawn hands the run at path, with the given stdio, to the zygote's idle
// spare, waiting a bounded time for one. A zygote that hands none over in
// time is discarded (a replacement starts in the background); the error
// is returned so that the caller falls back to a direct spawn. The spare
// may still turn the job down (it was tampered with or killed while
// idle): the proc's outcome then says notTaken, and nothing of the run
// has happened.
func (m *zygoteManager) spawn(ctx context.Context, path, cwd string, env map[string]string, stdin, stdout, stderr *os.File) (*proc, error) {
	z, err := m.get(ctx, 0, false)
	if err != nil {
		return nil, err
	}
	msg, _ := json.Marshal(map[string]any{"path": path, "cwd": cwd, "env": env})
	rights := syscall.UnixRights(int(stdin.Fd()), int(stdout.Fd()), int(stderr.Fd()))
	for attempt := 0; ; attempt++ {
		sp, err := z.takeSpare(ctx, zygoteReplyTimeout)
		if err != nil {
			if !errors.Is(err, errForkFailed) {
				// A fork failure (e.g. the pids limit) is not the
				// zygote's fault; anything else is.
				m.discard(z, err)
			}
			return nil, err
		}
		// Registered before the job goes: the zygote's word on the
		// child's end cannot come first. Managed: if the zygote dies the
		// child is re-parented to the agent (subreaper), and the sweep
		// must leave its zombie to waitOrphan.
		w := z.expect(sp.pid)
		spawnMu.Lock()
		managed[sp.pid] = true
		spawnMu.Unlock()
		forget := func() {
			z.forget(sp.pid)
			spawnMu.Lock()
			delete(managed, sp.pid)
			spawnMu.Unlock()
			sp.conn.Close()
		}
		_ = syscall.Kill(sp.pid, syscall.SIGCONT) // code of an earlier run may have stopped it
		_ = sp.conn.SetWriteDeadline(time.Now().Add(zygoteReplyTimeout))
		if _, _, err := sp.conn.WriteMsgUnix(msg, rights, nil); err != nil {
			// It never got the job (it died idle): another one may.
			_ = syscall.Kill(sp.pid, syscall.SIGKILL)
			forget()
			if attempt == 1 {
				return nil, err
			}
			continue
		}
		done := make(chan outcome, 1)
		go func() {
			o := z.await(ctx, sp, w)
			forget()
			done <- o
		}()
		return &proc{pid: sp.pid, done: done, abandon: func() {
			m.discard(z, errors.New("no exit status after SIGKILL"))
		}, next: z}, nil
	}
}

// await waits for the end of the run handed to sp: its own report ("x"
// and the exit code, sent just before it exits), else the zygote's wait
// status, else (the zygote died) the status the agent collects as the
// orphan's subreaper.
func (z *zygote) await(ctx context.Context, sp *spare, w <-chan outcome) outcome {
	own := make(chan outcome, 1)
	go func() {
		var b [16]byte
		n, err := sp.conn.Read(b[:])
		if err == nil && n > 1 && b[0] == 'x' {
			if code, err := strconv.Atoi(string(b[1:n])); err == nil && code >= 0 && code <= 255 {
				own <- outcome{exitCode: code, reported: true}
				return
			}
		}
		close(own) // EOF or garbage: the zygote's status decides
	}()
	select {
	case o, ok := <-own:
		if ok {
			return o
		}
	case o := <-w:
		return o
	case <-z.dead:
	}
	select {
	case o := <-w:
		return o
	case <-z.dead:
	}
	select {
	case o := <-w: // the last word of the zygote's reader
		return o
	default:
	}
	return waitOrphan(ctx, sp.pid)
}

// waitOrphan waits for a spare, handed a job, whose zygote died. The child
// is then the agent's (subreaper) child, so wait4 yields its status, and
// whether it had taken its job (it led its own session) is read before it
// is reaped; if it is not (no subreaper), poll until it is gone and report
// exit code -1.
func waitOrphan(ctx context.Context, pid int) outcome {
	for {
		var info unix.Siginfo
		err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
		if err == nil && info.Signo == int32(unix.SIGCHLD) {
			sid, serr := unix.Getsid(pid)
			var ws syscall.WaitStatus
			if wpid, _ := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil); wpid == pid {
				o := outcomeOfStatus(ws)
				o.notTaken = serr == nil && sid != pid
				return o
			}
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

// readMsg reads one packet and decodes it as JSON; descriptors sent with
// it are closed.
func readMsg(c *net.UnixConn, v any) error {
	fds, err := readMsgFDs(c, v)
	for _, fd := range fds {
		syscall.Close(fd)
	}
	return err
}

// readMsgFDs reads one packet with the descriptors sent with it (the
// caller's to close) and decodes it as JSON.
func readMsgFDs(c *net.UnixConn, v any) ([]int, error) {
	buf := make([]byte, 64<<10)
	oob := make([]byte, 256)
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	if oobn > 0 {
		if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, msg := range msgs {
				if got, err := syscall.ParseUnixRights(&msg); err == nil {
					fds = append(fds, got...)
				}
			}
		}
	}
	if n == 0 {
		return fds, errors.New("zygote closed the connection")
	}
	return fds, json.Unmarshal(buf[:n], v)
}
