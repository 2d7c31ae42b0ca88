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
	// zygoteReplyTimeout bounds the zygote's answer to a fork request.
	zygoteReplyTimeout = 2 * time.Second
)

type zygote struct {
	ch   *child
	conn *net.UnixConn
	pid  int
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
	ch, err := s.startInfra(&exec.Cmd{
		Path:       bin,
		Args:       []string{"python3", "-s", "-c", zygoteScript}, // -s: no user site (runs write it)
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
	return &zygote{ch: ch, conn: conn, pid: ch.pid}, nil
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
	}
	if err := readMsg(z.conn, &hello); err != nil {
		return fmt.Errorf("waiting for ready: %w", err)
	}
	if !hello.Ready || hello.PID != z.pid {
		return fmt.Errorf("bad ready message (pid %d, want %d)", hello.PID, z.pid)
	}
	_ = z.conn.SetReadDeadline(time.Time{})
	m.s.logf("zygote %d preloaded %v", z.pid, hello.Preloaded)
	return nil
}

// discardTainted discards a zygote that failed after it may have received
// a request: it may have forked a child running the code already, so the
// zygote is killed and a sweep runs before the caller falls back to a
// direct spawn (the code must not run twice).
func (m *zygoteManager) discardTainted(z *zygote, why error) {
	m.discard(z, why)
	select {
	case <-z.exited():
	case <-time.After(killGraceWait):
	}
	sweep(m.s.mode, m.s.opts.ProcRoot)
}

// spawn asks the zygote to fork a child running path with the given stdio.
// Any failure discards the zygote (a replacement starts in the background)
// and is returned so that the caller falls back to a direct spawn.
func (m *zygoteManager) spawn(ctx context.Context, path, cwd string, env map[string]string, stdin, stdout, stderr *os.File) (*proc, error) {
	z, err := m.get(ctx, 0, false)
	if err != nil {
		return nil, err
	}
	select {
	case <-z.exited():
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
