package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// outcome is how a run's main process ended.
type outcome struct {
	exitCode int
	signal   string
}

// proc is a started run: its pid (also its process group and session) and
// a channel that yields its outcome exactly once.
type proc struct {
	pid  int
	done <-chan outcome
	// abandon is called when the outcome does not arrive after the kill
	// (zygote wedged); it must make done deliver soon.
	abandon func()
}

// killGraceWait bounds how long the agent waits for the run's main process
// to be reported dead after SIGKILL, and for the output pipes to drain
// after the sweep.
const killGraceWait = 2 * time.Second

// execute runs the code file at path; env, when set, is added to the run's
// environment (the figure backend of Python runs).
func (s *Server) execute(ctx context.Context, lang string, cmd Command, path string, env map[string]string, timeout time.Duration, limit int) Response {
	stdin, err := os.Open(os.DevNull)
	if err != nil {
		return Response{ExitCode: -1, Error: "open /dev/null: " + err.Error()}
	}
	defer stdin.Close()
	start := time.Now()
	var p *proc
	var outR, errR *os.File
	usedZygote := false
	// No infrastructure process starts while the run's code executes.
	locked := false
	lock := func() { codeLock.RLock(); locked = true }
	defer func() {
		if locked {
			codeLock.RUnlock()
		}
	}()
	if s.node != nil && filepath.Ext(path) == ".js" && (lang == LangTypeScript || lang == LangJavaScript) {
		p, outR, errR, err = s.node.spawn(ctx, path, s.opts.WorkDir, lock)
		if err != nil {
			s.logf("running node directly: %v", err)
		}
	}
	if p == nil {
		lock()
		var outW, errW *os.File
		if outR, outW, err = os.Pipe(); err != nil {
			return Response{ExitCode: -1, Error: "pipe: " + err.Error()}
		}
		defer outW.Close()
		if errR, errW, err = os.Pipe(); err != nil {
			outR.Close()
			return Response{ExitCode: -1, Error: "pipe: " + err.Error()}
		}
		defer errW.Close()
		if lang == LangPython && s.zyg != nil {
			p, err = s.zyg.spawn(ctx, path, s.opts.WorkDir, env, stdin, outW, errW)
			if err != nil {
				s.logf("zygote unavailable, running python3 directly: %v", err)
				p = nil
			} else {
				usedZygote = true
			}
		}
		if p == nil {
			p, err = s.spawnDirect(lang, cmd, path, withEnv(s.opts.Env, env), stdin, outW, errW)
			if err != nil {
				outR.Close()
				errR.Close()
				return Response{ExitCode: -1, Error: err.Error()}
			}
		}
		// The children hold their own copies now.
		outW.Close()
		errW.Close()
	}
	defer outR.Close()
	defer errR.Close()
	stdin.Close()

	type captured struct {
		data      []byte
		truncated bool
	}
	outC := make(chan captured, 1)
	errC := make(chan captured, 1)
	go func() { d, t := drain(outR, limit); outC <- captured{d, t} }()
	go func() { d, t := drain(errR, limit); errC <- captured{d, t} }()

	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var o outcome
	timedOut, finished := false, false
	select {
	case o = <-p.done:
		finished = true
	case <-timer.C:
		timedOut = true
	case <-ctx.Done():
	}
	if !finished {
		_ = syscall.Kill(-p.pid, syscall.SIGKILL)
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
		select {
		case o = <-p.done:
		case <-time.After(killGraceWait):
			if p.abandon != nil {
				p.abandon()
			}
			o = <-p.done
		}
	}
	dur := time.Since(start)

	res := sweep(s.mode, s.opts.ProcRoot)
	if !res.converged || !res.gone {
		s.logf("sweep incomplete: killed %d, converged %v, all gone %v", res.killed, res.converged, res.gone)
	}

	// Everything that could hold the pipes' write ends is dead now; bound
	// the wait anyway (a process the agent cannot signal may hold them).
	grace := time.NewTimer(killGraceWait)
	defer grace.Stop()
	var so, se captured
	for got := 0; got < 2; {
		select {
		case so = <-outC:
			outC = nil
			got++
		case se = <-errC:
			errC = nil
			got++
		case <-grace.C:
			outR.Close()
			errR.Close()
		}
	}
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
		Zygote:          usedZygote,
		Cold:            lang == LangPython && s.zyg != nil && !usedZygote,
	}
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
