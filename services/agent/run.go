package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// outcome is how a run's main process ended.
type outcome struct {
	exitCode int
	signal   string
	// notTaken: a zygote's spare ended without taking the run (see
	// zygote.py): nothing of it ran.
	notTaken bool
	// reported: the run's process sent its exit status itself, just
	// before its exit (see spare.py); it may not be in exit yet.
	reported bool
}

// proc is a started run: its pid (also its process group and session) and
// a channel that yields its outcome exactly once.
type proc struct {
	pid  int
	done <-chan outcome
	// abandon is called when the outcome does not arrive after the kill
	// (zygote wedged); it must make done deliver soon.
	abandon func()
	// next, for a run a zygote's spare took, is that zygote: it is asked
	// for the next spare after spareDelay if the run goes on that long,
	// else answerGrace after the run's answer is written.
	next *zygote
}

// killGraceWait bounds how long the agent waits for the run's main process
// to be reported dead after SIGKILL, and for the output pipes to drain
// after the sweep.
const killGraceWait = 2 * time.Second

// execute runs the code file at path; env, when set, is added to the run's
// environment (the figure backend of Python runs).
func (s *Server) execute(ctx context.Context, lang string, cmd Command, path string, env map[string]string, timeout time.Duration, limit int) Response {
	start := time.Now()
	// No infrastructure process starts while the run's code executes.
	locked := false
	lock := func() {
		if !locked {
			codeLock.RLock()
			locked = true
		}
	}
	defer func() {
		if locked {
			codeLock.RUnlock()
		}
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var r *started
	var o outcome
	timedOut := false
	for attempt := 0; ; attempt++ {
		var err error
		// A run a spare turned down goes to another spare, then to a
		// python3 of its own.
		if r, err = s.start(ctx, lang, cmd, path, env, limit, lock, attempt < 2); err != nil {
			return Response{ExitCode: -1, Error: err.Error()}
		}
		o, timedOut = r.wait(ctx, timer)
		if !o.notTaken || timedOut || ctx.Err() != nil {
			break
		}
		s.logf("zygote spare %d did not take the run", r.p.pid)
		r.close()
	}
	defer r.close()
	if z := r.p.next; z != nil && r.nextSpare.Stop() {
		s.nextSpare.Store(z) // not asked for during the run: after its answer
	}
	dur := time.Since(start)

	if o.reported {
		awaitExit(s.opts.ProcRoot, r.p.pid)
	}
	res := sweep(s.mode, s.opts.ProcRoot)
	if !res.converged || !res.gone {
		s.logf("sweep incomplete: killed %d, converged %v, all gone %v", res.killed, res.converged, res.gone)
	}

	so, se := r.output()
	if so.data == nil {
		so.data = []byte{}
	}
	if se.data == nil {
		se.data = []byte{}
	}
	var d displays
	if env != nil {
		collectFigures(filepath.Dir(path), &d)
	}
	return Response{
		Displays:        d.list,
		DisplaysDropped: d.dropped,
		ExitCode:        o.exitCode,
		Signal:          o.signal,
		Stdout:          so.data,
		Stderr:          se.data,
		Truncated:       so.truncated || se.truncated,
		TimedOut:        timedOut,
		DurationMS:      dur.Milliseconds(),
		Zygote:          r.zygote,
		Cold:            lang == LangPython && s.zyg != nil && !r.zygote,
	}
}

// exitGrace bounds how long awaitExit waits, in steps of exitStep.
const (
	exitGrace = 200 * time.Microsecond
	exitStep  = 20 * time.Microsecond
)

// awaitExit gives a run's process that reported its end a moment to reach
// its exit before the sweep looks. Its report wakes the agent on its own
// processor, where the agent runs first: the sweep then found it short of
// exit in about half the runs, killed it and waited for the kill to land
// (about a millisecond, until the scheduler moved one of the two). A few
// microseconds off the processor let it get there. A process that is not
// in exit within exitGrace (its report was a lie, say) is the sweep's to
// kill, as before.
func awaitExit(procRoot string, pid int) {
	path := procRoot + "/" + strconv.Itoa(pid) + "/stat"
	for deadline := time.Now().Add(exitGrace); time.Now().Before(deadline); {
		b, err := ReadProcFile(path)
		if err != nil {
			return // gone
		}
		if st, ok := ParseProcStat(b); !ok || !st.Live() {
			return
		}
		nap(exitStep)
	}
}

// started is a run's process and the capture of its output.
type started struct {
	p      *proc
	zygote bool // forked from the zygote
	// nextSpare, for a run in a zygote's spare, asks the zygote for the
	// next spare once the run has gone on for spareDelay.
	nextSpare  *time.Timer
	outR, errR *os.File
	outC, errC chan captured
}

type captured struct {
	data      []byte
	truncated bool
}

// start starts the run: in a Node spare, in a zygote's spare (with
// zygote), or in an interpreter of its own; its output is read into
// r.outC and r.errC.
func (s *Server) start(ctx context.Context, lang string, cmd Command, path string, env map[string]string, limit int, lock func(), zygote bool) (*started, error) {
	r := &started{}
	var err error
	if s.node != nil && filepath.Ext(path) == ".js" && (lang == LangTypeScript || lang == LangJavaScript) {
		r.p, r.outR, r.errR, err = s.node.spawn(ctx, path, s.opts.WorkDir, lock)
		if err != nil {
			s.logf("running node directly: %v", err)
		}
	}
	if r.p == nil {
		lock()
		stdin, err := os.Open(os.DevNull)
		if err != nil {
			return nil, fmt.Errorf("open /dev/null: %w", err)
		}
		defer stdin.Close()
		var outW, errW *os.File
		if r.outR, outW, err = os.Pipe(); err != nil {
			return nil, fmt.Errorf("pipe: %w", err)
		}
		// The children hold their own copies once started.
		defer outW.Close()
		if r.errR, errW, err = os.Pipe(); err != nil {
			r.outR.Close()
			return nil, fmt.Errorf("pipe: %w", err)
		}
		defer errW.Close()
		if zygote && lang == LangPython && s.zyg != nil {
			r.p, err = s.zyg.spawn(ctx, path, s.opts.WorkDir, env, stdin, outW, errW)
			if err != nil {
				s.logf("zygote unavailable, running python3 directly: %v", err)
			}
			r.zygote = err == nil
		}
		if r.p == nil {
			r.p, err = s.spawnDirect(lang, cmd, path, withEnv(s.opts.Env, env), stdin, outW, errW)
			if err != nil {
				r.outR.Close()
				r.errR.Close()
				return nil, err
			}
		}
	}
	if z := r.p.next; z != nil {
		r.nextSpare = time.AfterFunc(spareDelay, func() { _ = z.requestSpare() })
	}
	r.outC, r.errC = make(chan captured, 1), make(chan captured, 1)
	go func() { d, t := drain(r.outR, limit); r.outC <- captured{d, t} }()
	go func() { d, t := drain(r.errR, limit); r.errC <- captured{d, t} }()
	return r, nil
}

// wait waits for the run's main process to end, killing the run when
// timer fires or ctx is done.
func (r *started) wait(ctx context.Context, timer *time.Timer) (o outcome, timedOut bool) {
	select {
	case o = <-r.p.done:
		return o, false
	case <-timer.C:
		timedOut = true
	case <-ctx.Done():
	}
	_ = syscall.Kill(-r.p.pid, syscall.SIGKILL)
	_ = syscall.Kill(r.p.pid, syscall.SIGKILL)
	select {
	case o = <-r.p.done:
	case <-time.After(killGraceWait):
		if r.p.abandon != nil {
			r.p.abandon()
		}
		o = <-r.p.done
	}
	return o, timedOut
}

// output waits for the output's end: everything that could hold the
// pipes' write ends is dead (swept) by now; the wait is bounded anyway (a
// process the agent cannot signal may hold them).
func (r *started) output() (so, se captured) {
	grace := time.NewTimer(killGraceWait)
	defer grace.Stop()
	outC, errC := r.outC, r.errC
	for got := 0; got < 2; {
		select {
		case so = <-outC:
			outC = nil
			got++
		case se = <-errC:
			errC = nil
			got++
		case <-grace.C:
			r.outR.Close()
			r.errR.Close()
		}
	}
	return so, se
}

func (r *started) close() {
	r.outR.Close()
	r.errR.Close()
}

// drain reads r to EOF, keeping the first limit bytes and discarding the
// rest so that the writer never blocks on a full pipe.
func drain(r io.Reader, limit int) ([]byte, bool) {
	var out []byte
	truncated := false
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			keep := min(n, limit-len(out))
			if keep > 0 {
				out = append(out, buf[:keep]...)
			}
			if keep < n {
				truncated = true
			}
		}
		if err != nil {
			return out, truncated
		}
	}
}

// spawnDirect starts the language's interpreter in a new session.
func (s *Server) spawnDirect(lang string, cmd Command, path string, env []string, stdin, stdout, stderr *os.File) (*proc, error) {
	if len(cmd.Argv) == 0 {
		return nil, fmt.Errorf("%s: no command configured", lang)
	}
	bin, err := lookPath(cmd.Argv[0], envValue(s.opts.Env, "PATH"))
	if err != nil {
		return nil, fmt.Errorf("%s: interpreter %q not found on PATH", lang, cmd.Argv[0])
	}
	c := &exec.Cmd{
		Path:        bin,
		Args:        append(append([]string{cmd.Argv[0]}, cmd.Argv[1:]...), path),
		Env:         env,
		Dir:         s.opts.WorkDir,
		Stdin:       stdin,
		Stdout:      stdout,
		Stderr:      stderr,
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	spawnMu.Lock()
	err = c.Start()
	if err == nil {
		managed[c.Process.Pid] = true
	}
	spawnMu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("%s: start %s: %v", lang, cmd.Argv[0], err)
	}
	pid := c.Process.Pid
	done := make(chan outcome, 1)
	go func() {
		err := c.Wait()
		spawnMu.Lock()
		delete(managed, pid)
		spawnMu.Unlock()
		done <- outcomeOf(c.ProcessState, err)
	}()
	return &proc{pid: pid, done: done}, nil
}

func outcomeOf(ps *os.ProcessState, err error) outcome {
	if ps == nil {
		return outcome{exitCode: -1}
	}
	ws, ok := ps.Sys().(syscall.WaitStatus)
	if !ok {
		return outcome{exitCode: ps.ExitCode()}
	}
	return outcomeOfStatus(ws)
}

func outcomeOfStatus(ws syscall.WaitStatus) outcome {
	if ws.Signaled() {
		return outcome{exitCode: -1, signal: signalName(ws.Signal())}
	}
	return outcome{exitCode: ws.ExitStatus()}
}

var signalNames = map[syscall.Signal]string{
	syscall.SIGABRT: "SIGABRT", syscall.SIGALRM: "SIGALRM", syscall.SIGBUS: "SIGBUS",
	syscall.SIGCHLD: "SIGCHLD", syscall.SIGCONT: "SIGCONT", syscall.SIGFPE: "SIGFPE",
	syscall.SIGHUP: "SIGHUP", syscall.SIGILL: "SIGILL", syscall.SIGINT: "SIGINT",
	syscall.SIGIO: "SIGIO", syscall.SIGKILL: "SIGKILL", syscall.SIGPIPE: "SIGPIPE",
	syscall.SIGPROF: "SIGPROF", syscall.SIGPWR: "SIGPWR", syscall.SIGQUIT: "SIGQUIT",
	syscall.SIGSEGV: "SIGSEGV", syscall.SIGSTKFLT: "SIGSTKFLT", syscall.SIGSTOP: "SIGSTOP",
	syscall.SIGSYS: "SIGSYS", syscall.SIGTERM: "SIGTERM", syscall.SIGTRAP: "SIGTRAP",
	syscall.SIGTSTP: "SIGTSTP", syscall.SIGTTIN: "SIGTTIN", syscall.SIGTTOU: "SIGTTOU",
	syscall.SIGURG: "SIGURG", syscall.SIGUSR1: "SIGUSR1", syscall.SIGUSR2: "SIGUSR2",
	syscall.SIGVTALRM: "SIGVTALRM", syscall.SIGWINCH: "SIGWINCH", syscall.SIGXCPU: "SIGXCPU",
	syscall.SIGXFSZ: "SIGXFSZ",
}

func signalName(sig syscall.Signal) string {
	if n, ok := signalNames[sig]; ok {
		return n
	}
	return fmt.Sprintf("SIG%d", int(sig))
}

func envValue(env []string, key string) string {
	for i := len(env) - 1; i >= 0; i-- {
		if v, ok := strings.CutPrefix(env[i], key+"="); ok {
			return v
		}
	}
	return ""
}

// lookPath finds name in the run's PATH (not the agent's).
func lookPath(name, path string) (string, error) {
	if strings.Contains(name, "/") {
		if isExecutable(name) {
			return name, nil
		}
		return "", errors.New("not executable")
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			continue
		}
		p := filepath.Join(dir, name)
		if isExecutable(p) {
			return p, nil
		}
	}
	return "", exec.ErrNotFound
}

func isExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// setDumpable sets PR_SET_DUMPABLE: a non-dumpable agent cannot be
// ptrace'd or have its memory read through /proc by code of the same uid.
func setDumpable(on bool) {
	const prSetDumpable = 4
	v := uintptr(0)
	if on {
		v = 1
	}
	_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetDumpable, v, 0)
}
