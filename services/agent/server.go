package agent

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Command says how to run one language: Argv is the interpreter command;
// the path of the written code file is appended. Ext is that file's
// extension (".py").
type Command struct {
	Argv []string
	Ext  string
}

// DefaultCommands is the language table used when Options.Commands is nil.
func DefaultCommands() map[string]Command {
	return map[string]Command{
		LangPython:     {Argv: []string{"python3"}, Ext: ".py"},
		LangTypeScript: {Argv: []string{"tsx"}, Ext: ".ts"},
		LangJavaScript: {Argv: []string{"node"}, Ext: ".js"},
		LangBash:       {Argv: []string{"bash"}, Ext: ".sh"},
		LangNode:       {Argv: []string{"bash"}, Ext: ".sh"},
		LangAgent:      {Argv: []string{"bash"}, Ext: ".sh"},
	}
}

// Options configures Serve.
type Options struct {
	// Socket is the unix socket path to listen on (required unless
	// Listener is set). A stale socket file is replaced; the socket is
	// chmod 0600.
	Socket string
	// Listener, in pod mode, replaces Socket: Pod's mutual-TLS listener
	// (pod.go), whose clients are authenticated by their certificate.
	Listener net.Listener
	// Pod is the agent's TLS identity in pod mode; it also enables the
	// pod-mode operations (podops.go).
	Pod *PodTLS
	// Language is the sandbox's language: the default for requests with
	// an empty Language, and "python" starts the zygote.
	Language string
	// WorkDir is every run's working directory (default WorkDir).
	WorkDir string
	// TmpDir receives the per-run directories run-<n> (default "/tmp").
	TmpDir string
	// Sweep selects which processes are killed after each run (see
	// SweepMode; default SweepAuto).
	Sweep SweepMode
	// Commands overrides the language table (default DefaultCommands()).
	Commands map[string]Command
	// Env is the run environment (default BaseEnv(os.Getenv)).
	Env []string
	// NoZygote disables the Python zygote: every python run spawns python3.
	NoZygote bool
	// Log receives diagnostics (default io.Discard). The zygote's own
	// stderr goes here too.
	Log io.Writer
	// ProcRoot is where processes are enumerated (default "/proc").
	ProcRoot string
	// AllowLocalPeers disables, in container sweep mode, the refusal of
	// clients that live in the agent's own PID namespace (see peerAllowed).
	AllowLocalPeers bool
	// WarmOnRequest starts the language's runtime (zygote, Node resident)
	// only when a ping asks for it (Request.Warm), not at once.
	WarmOnRequest bool
	// IdleRelease stops the runtimes after this long without a run (0:
	// never); see warm.go.
	IdleRelease time.Duration
	// NodeToolchain is the TypeScript toolchain directory (see node.go;
	// default: found from the typescript command).
	NodeToolchain string

	// zygoteReady, residentReady and spareReady, if set, are called with
	// the pid of every zygote, Node resident or Node spare that became
	// ready (tests).
	zygoteReady, residentReady, spareReady func(pid int)
}

// BaseEnv returns the minimal environment given to runs: PATH from the
// agent's environment (or a default), HOME=/tmp and the fixed settings.
// MPLCONFIGDIR is taken from the agent's environment if set (the python
// image seeds its font cache there), else /tmp/mpl.
func BaseEnv(getenv func(string) string) []string {
	path := getenv("PATH")
	if path == "" {
		path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	}
	mpl := getenv("MPLCONFIGDIR")
	if mpl == "" {
		mpl = "/tmp/mpl"
	}
	return []string{
		"PATH=" + path,
		"HOME=/tmp",
		"TMPDIR=/tmp",
		"LANG=C.UTF-8",
		"MPLBACKEND=Agg",
		"MPLCONFIGDIR=" + mpl,
		"PYTHONDONTWRITEBYTECODE=1",
		"PYTHONUNBUFFERED=1",
	}
}

// Server is a running agent; Serve wraps it.
type Server struct {
	opts  Options
	mode  SweepMode
	log   io.Writer
	logMu sync.Mutex
	runN  atomic.Int64
	zyg   *zygoteManager // nil without zygote
	node  *nodeRuntime   // nil without a TypeScript toolchain
	nb    *notebook
	// lastActive is when the last run ended or the last warm request came
	// (UnixNano); ran is set by the first run (see releaseWhenIdle).
	lastActive atomic.Int64
	ran        atomic.Bool
	// nextSpare is the zygote whose spare the last run took, when it was
	// not asked for the next one during the run: it is, answerGrace after
	// the run's answer is written.
	nextSpare atomic.Pointer[zygote]

	jobsMu sync.Mutex
	nJobs  int // live jobs, at most MaxJobs

	tunnels tunnelTable // pod mode: parked egress tunnels by job
}

// Serve listens on opts.Socket and answers requests until ctx is done.
// Runs are serialised: a request arriving while another run is in progress
// waits for it, for at most its own timeout, and is then answered with
// Error "busy". Ping requests never wait.
func Serve(ctx context.Context, opts Options) error {
	if opts.Socket == "" && opts.Listener == nil {
		return errors.New("agent: no socket path")
	}
	s, err := newServer(opts)
	if err != nil {
		return err
	}
	reserveThreads(spareThreads)
	defaultIgnoredSignals()
	ln := opts.Listener
	if ln == nil {
		_ = os.Remove(opts.Socket)
		if ln, err = net.Listen("unix", opts.Socket); err != nil {
			return fmt.Errorf("agent: listen: %w", err)
		}
		if err := os.Chmod(opts.Socket, 0o600); err != nil {
			ln.Close()
			return fmt.Errorf("agent: chmod socket: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if s.zyg != nil {
		s.zyg.begin(ctx)
	}
	if s.node != nil {
		s.node.begin(ctx)
	}
	if !opts.WarmOnRequest {
		s.warm()
	}
	var wg sync.WaitGroup
	if opts.IdleRelease > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.releaseWhenIdle(ctx)
		}()
	}
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var acceptErr error
	backoff := time.Millisecond
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			if errors.Is(err, net.ErrClosed) {
				acceptErr = fmt.Errorf("agent: accept: %w", err)
				break
			}
			// EMFILE and friends: a flood of connections must not end
			// the agent.
			s.logf("accept: %v", err)
			select {
			case <-time.After(backoff):
			case <-ctx.Done():
			}
			backoff = min(backoff*2, time.Second)
			continue
		}
		backoff = time.Millisecond
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.handle(ctx, c)
		}()
	}
	ln.Close()
	cancel()
	wg.Wait()
	if s.zyg != nil {
		s.zyg.shutdown()
	}
	if s.node != nil {
		s.node.shutdown()
	}
	s.nb.shutdown() // no run is left to use it
	if opts.Listener == nil {
		_ = os.Remove(opts.Socket)
	}
	return acceptErr
}

func newServer(opts Options) (*Server, error) {
	if opts.WorkDir == "" {
		opts.WorkDir = WorkDir
	}
	if opts.TmpDir == "" {
		opts.TmpDir = "/tmp"
	}
	if opts.Commands == nil {
		opts.Commands = DefaultCommands()
	}
	if opts.Env == nil {
		opts.Env = BaseEnv(os.Getenv)
	}
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	if opts.ProcRoot == "" {
		opts.ProcRoot = "/proc"
	}
	if opts.Language != "" {
		if _, ok := opts.Commands[opts.Language]; !ok {
			return nil, fmt.Errorf("agent: unknown language %q", opts.Language)
		}
	}
	mode, err := resolveSweepMode(opts.Sweep)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	becomeSubreaper()
	initInfraSession()
	if mode == SweepContainer {
		setDumpable(false)
	}
	s := &Server{opts: opts, mode: mode, log: opts.Log}
	s.nb = &notebook{s: s}
	if opts.Language == LangPython && !opts.NoZygote {
		s.zyg = newZygoteManager(s)
	}
	s.node = newNodeRuntime(s)
	return s, nil
}

func (s *Server) logf(format string, args ...any) {
	s.logMu.Lock()
	defer s.logMu.Unlock()
	fmt.Fprintf(s.log, "sandbox agent: "+format+"\n", args...)
}

// peerAllowed refuses clients inside the sandbox. The broker connects from
// the host, outside the container's PID namespace, so SO_PEERCRED reports
// its pid as 0 there; code running in the sandbox (same uid as the agent,
// so it can open the socket) has a visible, non-zero pid. Without this a
// run could queue a request of its own that executes after the run ends.
func peerAllowed(c net.Conn) error {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return errors.New("forbidden: not a unix connection")
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return fmt.Errorf("forbidden: %v", err)
	}
	var cred *syscall.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return fmt.Errorf("forbidden: %v", err)
	}
	if cerr != nil {
		return fmt.Errorf("forbidden: peer credentials: %v", cerr)
	}
	if cred.Pid != 0 {
		return fmt.Errorf("forbidden: clients inside the sandbox (pid %d) may not use the agent", cred.Pid)
	}
	return nil
}

// requestReadTimeout bounds how long a client may take to send its line.
const requestReadTimeout = 30 * time.Second

func (s *Server) handle(ctx context.Context, c net.Conn) {
	defer c.Close()
	if tc, ok := c.(*tls.Conn); ok {
		// Mutual TLS (pod mode) authenticates the client: a failed
		// handshake ends the connection.
		hctx, cancel := context.WithTimeout(ctx, requestReadTimeout)
		err := tc.HandshakeContext(hctx)
		cancel()
		if err != nil {
			return
		}
	} else if s.mode == SweepContainer && !s.opts.AllowLocalPeers {
		if err := peerAllowed(c); err != nil {
			b, _ := json.Marshal(Response{ExitCode: -1, Error: err.Error()})
			_ = c.SetWriteDeadline(time.Now().Add(time.Second))
			_, _ = c.Write(append(b, '\n'))
			return
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(requestReadTimeout))
	// The reader outlives the first line: a job's frames follow it.
	br := bufio.NewReaderSize(c, 64<<10)
	resp, job, op := s.serveConn(ctx, br)
	if op != nil {
		op(ctx, c, br)
		return
	}
	if job != nil {
		_ = c.SetReadDeadline(time.Time{})
		s.serveJob(ctx, c, br, *job)
		return
	}
	b, err := json.Marshal(resp)
	if err != nil {
		b, _ = json.Marshal(Response{ExitCode: -1, Error: "encode response: " + err.Error()})
	}
	b = append(b, '\n')
	_ = c.SetWriteDeadline(time.Now().Add(30 * time.Second))
	_, _ = c.Write(b)
	if z := s.nextSpare.Swap(nil); z != nil {
		c.Close() // the answer is complete: the client stops waiting now
		time.AfterFunc(answerGrace, func() { _ = z.requestSpare() })
	}
}

// serveConn reads the first line and answers a run; for a job request it
// returns the request instead, and for a pod-mode operation its handler.
func (s *Server) serveConn(ctx context.Context, br *bufio.Reader) (resp Response, job *JobRequest, op func(context.Context, net.Conn, *bufio.Reader)) {
	defer func() {
		if r := recover(); r != nil {
			s.logf("panic: %v", r)
			resp, job, op = Response{ExitCode: -1, Error: fmt.Sprintf("internal error: %v", r)}, nil, nil
		}
	}()
	line, err := readLine(br, MaxRequestBytes)
	if err != nil {
		return Response{ExitCode: -1, Error: err.Error()}, nil, nil
	}
	if op := s.podOp(line); op != nil {
		return Response{}, nil, op
	}
	req, jreq, err := parseFirstLine(line)
	if err != nil {
		return Response{ExitCode: -1, Error: err.Error()}, nil, nil
	}
	if jreq != nil {
		return Response{}, jreq, nil
	}
	if req.Language == PingLanguage {
		if req.Warm {
			s.noteActive()
			s.warm()
		}
		return Response{Zygote: s.zyg != nil && s.zyg.isReady(), Warm: s.isWarm()}, nil, nil
	}
	if req.Warm {
		return Response{ExitCode: -1, Error: "bad request: warm is for pings only"}, nil, nil
	}
	return s.run(ctx, req), nil, nil
}

// readRequest reads one run request line of at most MaxRequestBytes and
// decodes it strictly.
func readRequest(r io.Reader) (Request, error) {
	line, err := readLine(bufio.NewReaderSize(r, 64<<10), MaxRequestBytes)
	if err != nil {
		return Request{}, err
	}
	req, jreq, err := parseFirstLine(line)
	if err == nil && jreq != nil {
		err = errors.New("bad request: not a run request")
	}
	return req, err
}

// lineTooLongError is readLine's answer to a line over its limit.
type lineTooLongError struct{ max int }

func (e lineTooLongError) Error() string {
	return fmt.Sprintf("bad request: longer than %d bytes", e.max)
}

// readLine reads one line of at most max bytes (without reading further
// than its newline, beyond what br buffers). A final line without newline
// is accepted at EOF.
func readLine(br *bufio.Reader, max int) ([]byte, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		line = append(line, chunk...)
		if len(line) > max {
			return nil, lineTooLongError{max}
		}
		if err == nil {
			return line, nil
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if errors.Is(err, io.EOF) && len(line) > 0 {
			return line, nil // accept a final line without newline
		}
		return nil, fmt.Errorf("bad request: read: %v", err)
	}
}

// parseFirstLine decodes a connection's first line strictly: a run Request
// when it has no "op" key, a JobRequest when "op" is "job".
func parseFirstLine(line []byte) (Request, *JobRequest, error) {
	var probe struct {
		Op *string `json:"op"`
	}
	// Only the first value is probed: trailing data is decodeStrict's.
	if err := json.NewDecoder(bytes.NewReader(line)).Decode(&probe); err != nil {
		return Request{}, nil, fmt.Errorf("bad request: %v", err)
	}
	if probe.Op == nil {
		var req Request
		if err := decodeStrict(line, &req); err != nil {
			return Request{}, nil, err
		}
		return req, nil, nil
	}
	if *probe.Op != OpJob {
		return Request{}, nil, fmt.Errorf("bad request: unknown op %q", truncate(*probe.Op, 40))
	}
	var env struct {
		Op string `json:"op"`
		JobRequest
	}
	if err := decodeStrict(line, &env); err != nil {
		return Request{}, nil, err
	}
	return Request{}, &env.JobRequest, nil
}

func decodeStrict(line []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("bad request: %v", err)
	}
	if dec.More() {
		return errors.New("bad request: trailing data after the JSON object")
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// run validates the request, takes the run lock and runs it.
func (s *Server) run(ctx context.Context, req Request) Response {
	lang := req.Language
	if lang == "" {
		lang = s.opts.Language
	}
	cmd, ok := s.opts.Commands[lang]
	if !ok || lang == "" {
		return Response{ExitCode: -1, Error: fmt.Sprintf("unknown language %q", req.Language)}
	}
	switch {
	case req.TimeoutMS < 0:
		return Response{ExitCode: -1, Error: "timeout_ms must not be negative"}
	case req.TimeoutMS > MaxTimeoutMS:
		return Response{ExitCode: -1, Error: fmt.Sprintf("timeout_ms exceeds %d", MaxTimeoutMS)}
	case req.MaxOutputBytes < 0:
		return Response{ExitCode: -1, Error: "max_output_bytes must not be negative"}
	}
	switch req.Mode {
	case "", ModeFresh:
	case ModeNotebook:
		if lang != LangPython {
			return Response{ExitCode: -1, Error: "notebook mode runs python only"}
		}
	default:
		return Response{ExitCode: -1, Error: fmt.Sprintf("unknown mode %q", truncate(req.Mode, 40))}
	}
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout == 0 {
		timeout = DefaultTimeoutMS * time.Millisecond
	}
	limit := req.MaxOutputBytes
	if limit == 0 {
		limit = DefaultMaxOutputBytes
	}
	limit = min(limit, MaxOutputLimit)

	wait := time.NewTimer(timeout)
	defer wait.Stop()
	select {
	case runSem <- struct{}{}:
	case <-wait.C:
		return Response{ExitCode: -1, Error: "busy: another run is in progress"}
	case <-ctx.Done():
		return Response{ExitCode: -1, Error: "agent shutting down"}
	}
	defer func() { <-runSem }()
	s.ran.Store(true)
	defer s.noteActive()
	if !s.opts.WarmOnRequest {
		s.warm() // again after an idle release
	}
	if req.Mode == ModeNotebook {
		return s.notebookRun(ctx, req, timeout, limit)
	}

	dir := filepath.Join(s.opts.TmpDir, fmt.Sprintf("run-%d-%d", os.Getpid(), s.runN.Add(1)))
	if err := os.Mkdir(dir, 0o700); err != nil {
		return Response{ExitCode: -1, Error: "create run dir: " + err.Error()}
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "main"+cmd.Ext)
	if err := os.WriteFile(path, []byte(req.Code), 0o600); err != nil {
		return Response{ExitCode: -1, Error: "write code: " + err.Error()}
	}
	var env map[string]string
	if lang == LangPython {
		var err error
		if env, err = prepareFigures(dir); err != nil {
			s.logf("figures: %v", err)
		}
	}
	start := time.Now()
	if s.node != nil && (lang == LangTypeScript || lang == LangJavaScript) {
		if lang == LangTypeScript {
			js := filepath.Join(dir, "main.js")
			n, diags, err := s.node.check(ctx, path, js, start.Add(timeout))
			switch {
			case errors.Is(err, errCheckTimeout):
				return Response{ExitCode: -1, Signal: "SIGKILL", TimedOut: true, Stdout: []byte{},
					Stderr:     []byte("the TypeScript type check did not finish within the timeout\n"),
					DurationMS: time.Since(start).Milliseconds()}
			case err != nil:
				s.logf("no type check, running %s: %v", cmd.Argv[0], err)
			case n > 0: // reported as tsc does; nothing runs
				out := Response{ExitCode: 1, Stdout: []byte{}, Stderr: []byte(diags), DurationMS: time.Since(start).Milliseconds()}
				if len(diags) > limit {
					out.Stderr, out.Truncated = out.Stderr[:limit], true
				}
				return out
			default:
				path, cmd = js, s.node.command()
			}
		} else {
			cmd = s.node.command()
		}
	}
	resp := s.execute(ctx, lang, cmd, path, env, timeout-time.Since(start), limit)
	resp.DurationMS = time.Since(start).Milliseconds()
	s.nb.freeze()
	return resp
}

// defaultIgnoredSignals undoes, for what the agent starts, SIGHUP and
// SIGINT inherited as ignored (a broker under nohup, a shell's `&`): an
// ignored signal stays ignored across exec, so every run and job would
// ignore the HUP and INT the job tools send, and a shell could not even
// trap them. A handler (whose signals are dropped, so the agent still
// ignores them) is reset to the default at exec.
func defaultIgnoredSignals() {
	var sigs []os.Signal
	for _, sig := range []os.Signal{syscall.SIGHUP, syscall.SIGINT} {
		if signal.Ignored(sig) {
			sigs = append(sigs, sig)
		}
	}
	if len(sigs) > 0 {
		signal.Notify(make(chan os.Signal, 1), sigs...)
	}
}
