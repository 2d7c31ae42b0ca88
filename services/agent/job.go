package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// frameWriteTimeout bounds one frame write: a client that stops reading for
// this long is treated as gone, and its job is killed.
const frameWriteTimeout = 30 * time.Second

// jobErr is a refusal sent as a FrameError.
type jobErr struct{ kind, msg string }

func (e *jobErr) Error() string { return e.msg }

func invalidJob(format string, a ...any) *jobErr {
	return &jobErr{JobErrInvalid, fmt.Sprintf(format, a...)}
}

// jobConn is the agent's side of one job connection. Frame writes are
// serialised; the first failed write marks the connection broken.
type jobConn struct {
	c      net.Conn
	wmu    sync.Mutex
	broken chan struct{}
	once   sync.Once
}

func (jc *jobConn) breakConn() { jc.once.Do(func() { close(jc.broken) }) }

func (jc *jobConn) send(f JobFrame) error {
	b, err := json.Marshal(f)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	jc.wmu.Lock()
	defer jc.wmu.Unlock()
	select {
	case <-jc.broken:
		return net.ErrClosed
	default:
	}
	_ = jc.c.SetWriteDeadline(time.Now().Add(frameWriteTimeout))
	if _, err := jc.c.Write(b); err != nil {
		jc.breakConn()
		return err
	}
	return nil
}

// stdinOp is one queued stdin command.
type stdinOp struct {
	id    uint64
	data  []byte
	close bool
}

// serveJob runs one job for the connection c, whose first line was req.
func (s *Server) serveJob(ctx context.Context, c net.Conn, br *bufio.Reader, req JobRequest) {
	jc := &jobConn{c: c, broken: make(chan struct{})}
	refuse := func(err error) {
		var je *jobErr
		if !errors.As(err, &je) {
			je = &jobErr{JobErrInternal, err.Error()}
		}
		_ = jc.send(JobFrame{T: FrameError, Kind: je.kind, Error: je.msg})
	}
	timeout, dir, env, err := s.checkJob(req)
	if err != nil {
		refuse(err)
		return
	}
	if !s.takeJobSlot() {
		refuse(&jobErr{JobErrLimit, fmt.Sprintf("the sandbox already runs its maximum of %d jobs", MaxJobs)})
		return
	}
	defer s.releaseJobSlot()
	if ctx.Err() != nil {
		refuse(errors.New("agent shutting down"))
		return
	}
	var fwd *egressForwarder
	if req.EgressSocket != "" || req.EgressTunnel != "" {
		if fwd, err = s.startJobEgress(req); err != nil {
			refuse(err)
			return
		}
		defer fwd.close()
		proxy := "http://127.0.0.1:" + strconv.Itoa(fwd.port())
		for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"} {
			env = append(env, k+"="+proxy)
		}
		env = append(env, "NO_PROXY=", "no_proxy=")
	}
	j, err := s.startJob(req, dir, env)
	if err != nil {
		refuse(err)
		return
	}
	j.fwd = fwd
	j.run(ctx, jc, br, timeout)
}

// checkJob validates req and returns its timeout, resolved working
// directory and environment.
func (s *Server) checkJob(req JobRequest) (time.Duration, string, []string, error) {
	if strings.TrimSpace(req.Command) == "" {
		return 0, "", nil, invalidJob("command is empty")
	}
	if strings.IndexByte(req.Command, 0) >= 0 {
		return 0, "", nil, invalidJob("command contains a NUL byte")
	}
	switch {
	case req.TimeoutMS < 0:
		return 0, "", nil, invalidJob("timeout_ms must not be negative")
	case req.TimeoutMS > MaxTimeoutMS:
		return 0, "", nil, invalidJob("timeout_ms exceeds %d", MaxTimeoutMS)
	}
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout == 0 {
		timeout = DefaultTimeoutMS * time.Millisecond
	}
	dir, err := s.jobDir(req.WorkDir)
	if err != nil {
		return 0, "", nil, err
	}
	if len(req.Env) > MaxJobEnv {
		return 0, "", nil, invalidJob("more than %d environment variables", MaxJobEnv)
	}
	env := append([]string(nil), s.opts.Env...)
	for _, kv := range req.Env {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || !validEnvKey(k) || strings.IndexByte(kv, 0) >= 0 {
			return 0, "", nil, invalidJob("invalid environment entry %q", truncate(kv, 40))
		}
		env = append(env, kv)
	}
	switch {
	case req.EgressSocket != "" && req.EgressTunnel != "":
		return 0, "", nil, invalidJob("egress_socket and egress_tunnel exclude each other")
	case req.EgressSocket != "":
		if err := s.checkEgressSocket(req.EgressSocket); err != nil {
			return 0, "", nil, err
		}
	case req.EgressTunnel != "" && (s.opts.Pod == nil || !sandbox.ValidID(req.EgressTunnel)):
		return 0, "", nil, invalidJob("egress_tunnel needs pod mode and a 16-hex token")
	}
	return timeout, dir, env, nil
}

// validEnvKey accepts shell variable names: [A-Za-z_][A-Za-z0-9_]*.
func validEnvKey(k string) bool {
	if k == "" || len(k) > 255 {
		return false
	}
	for i, c := range k {
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// jobDir resolves p (absolute, "" for the WorkDir) and refuses anything
// that is not a directory under the WorkDir once symlinks are resolved.
func (s *Server) jobDir(p string) (string, error) {
	base, err := filepath.EvalSymlinks(s.opts.WorkDir)
	if err != nil {
		return "", &jobErr{JobErrInternal, "work dir unavailable: " + err.Error()}
	}
	if p == "" {
		return base, nil
	}
	if !filepath.IsAbs(p) || strings.IndexByte(p, 0) >= 0 {
		return "", invalidJob("work_dir must be an absolute path")
	}
	r, err := filepath.EvalSymlinks(p)
	if err != nil {
		return "", invalidJob("work_dir does not exist")
	}
	if r != base && !strings.HasPrefix(r, base+"/") {
		return "", invalidJob("work_dir is outside the workspace")
	}
	if fi, err := os.Stat(r); err != nil || !fi.IsDir() {
		return "", invalidJob("work_dir is not a directory")
	}
	return r, nil
}

// startJobEgress starts the job's forwarder to the broker's egress socket
// or, in pod mode, to its tunnels; closing it ends the tunnels too.
func (s *Server) startJobEgress(req JobRequest) (*egressForwarder, error) {
	if req.EgressSocket != "" {
		return startEgress(req.EgressSocket)
	}
	dial, closeTunnels, ok := s.tunnels.open(req.EgressTunnel)
	if !ok {
		return nil, invalidJob("egress_tunnel is in use")
	}
	f, err := startForwarder(dial)
	if err != nil {
		closeTunnels()
		return nil, err
	}
	f.onClose = closeTunnels
	return f, nil
}

// checkEgressSocket accepts only a socket directly in the agent's own
// socket directory, other than the agent's socket.
func (s *Server) checkEgressSocket(p string) error {
	dir := filepath.Dir(s.opts.Socket)
	if !filepath.IsAbs(p) || filepath.Clean(p) != p || filepath.Dir(p) != dir || p == s.opts.Socket {
		return invalidJob("egress_socket must be a socket in %s", dir)
	}
	fi, err := os.Lstat(p)
	if err != nil || fi.Mode()&os.ModeSocket == 0 {
		return invalidJob("egress_socket is not a socket")
	}
	return nil
}

func (s *Server) takeJobSlot() bool {
	s.jobsMu.Lock()
	defer s.jobsMu.Unlock()
	if s.nJobs >= MaxJobs {
		return false
	}
	s.nJobs++
	return true
}

func (s *Server) releaseJobSlot() {
	s.jobsMu.Lock()
	s.nJobs--
	s.jobsMu.Unlock()
}

// agentJob is a started job: bash in a session of its own.
type agentJob struct {
	s           *Server
	pid         int
	start       time.Time
	interactive bool
	stdin       *os.File // write end, nil unless interactive
	outR, errR  *os.File
	done        chan outcome
	stdinBusy   atomic.Bool      // a stdin command is queued or being written
	fwd         *egressForwarder // nil without egress
}

func (s *Server) startJob(req JobRequest, dir string, env []string) (*agentJob, error) {
	bin, err := lookPath("bash", envValue(env, "PATH"))
	if err != nil {
		return nil, &jobErr{JobErrInternal, "bash not found on PATH"}
	}
	var stdinR, stdinW *os.File
	if req.Interactive {
		stdinR, stdinW, err = os.Pipe()
	} else {
		stdinR, err = os.Open(os.DevNull)
	}
	if err != nil {
		return nil, err
	}
	defer stdinR.Close()
	outR, outW, err := os.Pipe()
	if err != nil {
		closeAll(stdinW)
		return nil, err
	}
	defer outW.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		closeAll(stdinW, outR)
		return nil, err
	}
	defer errW.Close()
	c := &exec.Cmd{
		Path:        bin,
		Args:        []string{"bash", "-c", req.Command},
		Env:         env,
		Dir:         dir,
		Stdin:       stdinR,
		Stdout:      outW,
		Stderr:      errW,
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	// Registered in the same critical section as the fork, so that no
	// sweep round sees the job without knowing it is one.
	spawnMu.Lock()
	err = c.Start()
	if err == nil {
		managed[c.Process.Pid] = true
		jobSessions[c.Process.Pid] = true
	}
	spawnMu.Unlock()
	if err != nil {
		closeAll(stdinW, outR, errR)
		return nil, fmt.Errorf("start bash: %v", err)
	}
	j := &agentJob{s: s, pid: c.Process.Pid, start: time.Now(), interactive: req.Interactive,
		stdin: stdinW, outR: outR, errR: errR, done: make(chan outcome, 1)}
	go func() {
		err := c.Wait()
		j.done <- outcomeOf(c.ProcessState, err)
	}()
	return j, nil
}

func closeAll(fs ...*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

// run streams the job's output, serves the client's commands and ends the
// job on exit, timeout, client drop or agent shutdown.
func (j *agentJob) run(ctx context.Context, jc *jobConn, br *bufio.Reader, timeout time.Duration) {
	ended := make(chan struct{}) // closed once the job's end is settled
	defer func() {
		closeAll(j.stdin, j.outR, j.errR)
	}()
	_ = jc.send(JobFrame{T: FrameStarted, PID: j.pid})

	var pumps sync.WaitGroup
	pumps.Add(2)
	go func() { defer pumps.Done(); pump(jc, j.outR, sandbox.StreamStdout) }()
	go func() { defer pumps.Done(); pump(jc, j.errR, sandbox.StreamStderr) }()

	stdinOps := make(chan stdinOp, 1)
	stdinDone := make(chan struct{})
	if j.interactive {
		go func() { defer close(stdinDone); j.writeStdin(jc, stdinOps, ended) }()
	} else {
		close(stdinDone)
	}
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		j.readCommands(jc, br, stdinOps, ended)
	}()

	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var o outcome
	timedOut, finished := false, false
	select {
	case o = <-j.done:
		finished = true
	case <-timer.C:
		timedOut = true
	case <-readerDone: // the client went away: the job goes with it
	case <-jc.broken:
	case <-ctx.Done():
	}
	if !finished {
		_ = syscall.Kill(-j.pid, syscall.SIGKILL)
		_ = syscall.Kill(j.pid, syscall.SIGKILL)
		o = <-j.done
	}
	dur := time.Since(j.start)
	j.cleanup()

	// Every holder of the pipes' write ends is dead now; bound the wait
	// anyway (a process the agent cannot signal may hold them).
	pumped := make(chan struct{})
	go func() { pumps.Wait(); close(pumped) }()
	select {
	case <-pumped:
	case <-time.After(killGraceWait):
		closeAll(j.outR, j.errR)
		<-pumped
	}
	close(ended)
	// A stdin write the job consumed just before it exited is acknowledged
	// before the exit frame, so the client never reports it as failed.
	select {
	case <-stdinDone:
	case <-time.After(killGraceWait):
		closeAll(j.stdin) // unblocks a write no process will ever read
		<-stdinDone
	}
	if j.fwd != nil {
		j.fwd.close() // before the exit frame: the job's network ends with it
	}
	_ = jc.send(JobFrame{T: FrameExit, Code: o.exitCode, Signal: o.signal, TimedOut: timedOut, DurationMS: dur.Milliseconds()})
}

// cleanup forgets the job and kills what is left of it. Leftovers that
// escaped its session and process tree are not members of any live job, so
// a full sweep gets them: at once when no run is in progress, else by the
// run's own sweep when it ends.
func (j *agentJob) cleanup() {
	spawnMu.Lock()
	delete(jobSessions, j.pid)
	delete(managed, j.pid)
	spawnMu.Unlock()
	s := j.s
	if res := killJobTree(s.opts.ProcRoot, j.pid); !res.converged || !res.gone {
		s.logf("job %d cleanup incomplete: killed %d, converged %v, all gone %v", j.pid, res.killed, res.converged, res.gone)
	}
	select {
	case runSem <- struct{}{}:
		sweep(s.mode, s.opts.ProcRoot)
		s.nb.freeze()
		<-runSem
	default:
	}
}

// readCommands serves client frames until the connection ends or fails.
func (j *agentJob) readCommands(jc *jobConn, br *bufio.Reader, stdinOps chan<- stdinOp, ended <-chan struct{}) {
	ack := func(id uint64, err error) {
		f := JobFrame{T: FrameAck, ID: id}
		if err != nil {
			f.Error = err.Error()
		}
		_ = jc.send(f)
	}
	for {
		line, err := readLine(br, MaxJobFrameBytes)
		if err != nil {
			return
		}
		var f JobFrame
		if err := decodeStrict(line, &f); err != nil {
			j.s.logf("job %d: bad frame: %v", j.pid, err)
			return // a client that breaks the protocol loses its job
		}
		switch f.T {
		case FrameSignal:
			sig, ok := JobSignals[f.Sig]
			if !ok {
				ack(f.ID, fmt.Errorf("signal %q is not allowed", truncate(f.Sig, 16)))
				continue
			}
			select {
			case <-ended:
				ack(f.ID, errors.New("the job has ended"))
				continue
			default:
			}
			err := syscall.Kill(-j.pid, sig)
			if errors.Is(err, syscall.ESRCH) {
				err = syscall.Kill(j.pid, sig)
			}
			ack(f.ID, err)
		case FrameStdin, FrameCloseStdin:
			if !j.interactive {
				ack(f.ID, errors.New("the job is not interactive: its stdin is closed"))
				continue
			}
			if len(f.D) > MaxJobChunk {
				ack(f.ID, fmt.Errorf("stdin frame exceeds %d bytes", MaxJobChunk))
				continue
			}
			if !j.stdinBusy.CompareAndSwap(false, true) {
				ack(f.ID, errors.New("a stdin write is still pending"))
				continue
			}
			// The writer clears stdinBusy before it acknowledges.
			select {
			case stdinOps <- stdinOp{id: f.ID, data: f.D, close: f.T == FrameCloseStdin}:
			case <-ended:
				j.stdinBusy.Store(false)
				ack(f.ID, errors.New("the job has ended"))
			}
		default:
			ack(f.ID, fmt.Errorf("unknown frame type %q", truncate(f.T, 16)))
		}
	}
}

// writeStdin applies stdin commands in order; a write blocks until the job
// reads, without holding up signals.
func (j *agentJob) writeStdin(jc *jobConn, ops <-chan stdinOp, ended <-chan struct{}) {
	for {
		select {
		case op := <-ops:
			var err error
			if op.close {
				err = j.stdin.Close()
			} else {
				_, err = j.stdin.Write(op.data)
			}
			if errors.Is(err, os.ErrClosed) {
				err = errors.New("stdin is closed")
			}
			j.stdinBusy.Store(false)
			f := JobFrame{T: FrameAck, ID: op.id}
			if err != nil {
				f.Error = err.Error()
			}
			_ = jc.send(f)
		case <-ended:
			select { // settle a command queued as the job ended
			case op := <-ops:
				j.stdinBusy.Store(false)
				_ = jc.send(JobFrame{T: FrameAck, ID: op.id, Error: "the job has ended"})
			default:
			}
			return
		}
	}
}

// pump sends r's data as out frames: coalesced up to MaxJobChunk, flushed
// at a newline or JobFlushDelay after a partial line. It reads to EOF even
// when the client is gone, so that the job never blocks on a full pipe.
func pump(jc *jobConn, r *os.File, stream string) {
	chunks := make(chan []byte, 4)
	go func() {
		defer close(chunks)
		buf := make([]byte, MaxJobChunk)
		for {
			n, err := r.Read(buf)
			if n > 0 {
				chunks <- bytes.Clone(buf[:n])
			}
			if err != nil {
				return
			}
		}
	}()
	var pending []byte
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	armed := false
	emit := func(b []byte) { _ = jc.send(JobFrame{T: FrameOut, S: stream, D: b}) }
	flush := func() {
		if len(pending) > 0 {
			emit(pending)
			pending = nil
		}
		if armed {
			timer.Stop()
			armed = false
		}
	}
	for {
		select {
		case b, ok := <-chunks:
			if !ok {
				flush()
				return
			}
			pending = append(pending, b...)
			for len(pending) >= MaxJobChunk {
				emit(pending[:MaxJobChunk:MaxJobChunk])
				pending = append([]byte(nil), pending[MaxJobChunk:]...)
			}
			if bytes.IndexByte(b, '\n') >= 0 {
				flush()
			} else if len(pending) > 0 && !armed {
				timer.Reset(JobFlushDelay)
				armed = true
			}
		case <-timer.C:
			armed = false
			flush()
		}
	}
}
