package agent

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Notebook mode. The agent runs ipykernel (Debian's python3-ipykernel) as
// its child and drives it through kernel_shim.py, a jupyter_client
// BlockingKernelClient that speaks JSON lines with the agent: the Jupyter
// messaging protocol is the maintained one's, over ipc (Unix) sockets in a
// private directory under the sandbox's /tmp, so it needs no network, not
// even loopback. The kernel leads a session of its own, and the shim, which
// runs no code of the session, a process group in the agent's session. The
// sweep after every run spares the two (see notebookProcs) and kills
// everything else, the kernel's children included; the broker's host-side
// check then holds the kernel's session to the kernel alone (see Strays).
// Between runs both are stopped (SIGSTOP), so no code of the session runs
// while no call is in progress. A timeout, a dead kernel or a dead shim
// kills both; the next notebook run starts a new kernel and says why the
// old one went.

//go:embed kernel_shim.py
var kernelShim string

const (
	// kernelInlineBackend is Jupyter's own matplotlib backend: plt.show()
	// and the figures a cell leaves open become image/png displays.
	kernelInlineBackend = "module://matplotlib_inline.backend_inline"
	// maxShimLine bounds one line from the shim (a MIME value of up to
	// 1 Mi characters, JSON-escaped); longer lines are dropped.
	maxShimLine = 8 << 20
)

// kernelArgs are ipykernel's options: no history database (no SQLite
// file or thread in the sandbox) and tracebacks without ANSI colours.
var kernelArgs = []string{"--HistoryManager.enabled=False", "--InteractiveShell.colors=NoColor"}

// child is a process the agent started and waits for.
type child struct {
	pid   int
	done  chan struct{} // closed once waited for; state is then set
	state *os.ProcessState
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// dying reports whether the child has exited or is about to, before
// its waiter has noticed: it is a zombie not yet collected, or a SIGKILL
// is pending for it. Code of a fresh run can kill the kernel just before
// the next cell; seen here, the cell goes to a new kernel instead of
// being lost with the old one.
func (c *child) dying(procRoot string) bool {
	if c.exited() {
		return true
	}
	var info unix.Siginfo
	err := unix.Waitid(unix.P_PID, c.pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
	if errors.Is(err, unix.ECHILD) || (err == nil && info.Signo == int32(unix.SIGCHLD)) {
		return true
	}
	status, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(c.pid), "status"))
	if err != nil {
		return errors.Is(err, os.ErrNotExist)
	}
	for _, line := range strings.Split(string(status), "\n") {
		name, mask, ok := strings.Cut(line, ":")
		if !ok || (name != "SigPnd" && name != "ShdPnd") {
			continue
		}
		if v, err := strconv.ParseUint(strings.TrimSpace(mask), 16, 64); err == nil && v&(1<<(unix.SIGKILL-1)) != 0 {
			return true
		}
	}
	return false
}

// describe says how the exited child ended.
func (c *child) describe() string {
	o := outcomeOf(c.state, nil)
	if o.signal != "" {
		return "was killed by " + o.signal
	}
	return fmt.Sprintf("exited with code %d", o.exitCode)
}

// kernel is one running notebook kernel.
type kernel struct {
	dir   string // connection file and sockets
	kern  *child // ipykernel
	shim  *child
	in    *os.File      // the shim's stdin
	lines chan []byte   // the shim's stdout, one line each; closed at EOF
	skip  chan struct{} // a line over maxShimLine was dropped
	gone  chan struct{} // closed by kill: nobody reads lines any more
	count int           // last execution count
}

// notebook is the agent's kernel slot. It is used under runSem only.
type notebook struct {
	s    *Server
	cur  *kernel
	ran  bool   // a kernel ran before
	lost string // why the last one ended, for the next start's report
}

// notebookRun runs req.Code as a cell of the kernel, starting one if
// needed. The caller holds runSem; the sweep follows as after every run.
func (s *Server) notebookRun(ctx context.Context, req Request, timeout time.Duration, limit int) Response {
	codeLock.RLock() // see infra.go
	defer codeLock.RUnlock()
	nb := s.nb
	start := time.Now()
	deadline := start.Add(timeout)
	started, lost := false, ""
	if k := nb.cur; k != nil && (k.kern.dying(s.opts.ProcRoot) || k.shim.dying(s.opts.ProcRoot)) {
		k.waitExit()
		nb.end(k, "the kernel "+k.deathNote())
	}
	if nb.cur == nil {
		k, err := nb.start(ctx, deadline)
		if err != nil {
			res := Response{ExitCode: -1, Error: "notebook kernel: " + err.Error()}
			if errors.Is(err, errStartTimeout) {
				res = Response{ExitCode: -1, Signal: "SIGKILL", TimedOut: true, Stdout: []byte{},
					Stderr: []byte("the notebook kernel did not start within the timeout\n"),
					Kernel: &KernelStatus{Ended: "timed out while starting"}}
			}
			res.DurationMS = time.Since(start).Milliseconds()
			s.sweepAfter()
			return res
		}
		started = true
		if nb.ran {
			lost = nb.lost
		}
		nb.cur, nb.ran, nb.lost = k, true, ""
	}
	nb.thaw()
	res := nb.cur.execute(ctx, req.Code, deadline, limit)
	res.DurationMS = time.Since(start).Milliseconds()
	if res.Kernel != nil && res.Kernel.Ended != "" {
		nb.end(nb.cur, res.Kernel.Ended)
	} else {
		res.Kernel = &KernelStatus{}
	}
	res.Kernel.Started, res.Kernel.Lost = started, lost
	if nb.cur != nil {
		res.Kernel.ExecutionCount = nb.cur.count
	}
	s.sweepAfter()
	nb.freeze()
	return res
}

// sweepAfter runs the post-run sweep and logs when it fell short.
func (s *Server) sweepAfter() {
	res := sweep(s.mode, s.opts.ProcRoot)
	if !res.converged || !res.gone {
		s.logf("sweep incomplete: killed %d, converged %v, all gone %v", res.killed, res.converged, res.gone)
	}
}

// waitExit waits, bounded, for whichever of k's processes is dying to be
// collected, so that deathNote can say how it ended.
func (k *kernel) waitExit() {
	t := time.NewTimer(killGraceWait)
	defer t.Stop()
	select {
	case <-k.kern.done:
	case <-k.shim.done:
	case <-t.C:
	}
}

// deathNote describes a kernel one of whose processes has exited.
func (k *kernel) deathNote() string {
	if k.kern.exited() {
		return k.kern.describe()
	}
	return "client " + k.shim.describe()
}

// end kills k, if it is the current kernel forgets it, and notes why.
func (nb *notebook) end(k *kernel, why string) {
	k.kill()
	if nb.cur == k {
		nb.cur = nil
		nb.lost = why
	}
}

// freeze stops the kernel and its client (SIGSTOP to their process
// groups) once a run is over, so that between calls no code of the
// session runs, threads a cell started included, as after a fresh run's
// sweep. Every run ends with it (fresh runs too: their code could resume
// the kernel), and so does a job's cleanup. The caller holds runSem.
func (nb *notebook) freeze() { nb.signal(syscall.SIGSTOP) }

// thaw resumes a frozen kernel for a cell. The caller holds runSem.
func (nb *notebook) thaw() { nb.signal(syscall.SIGCONT) }

func (nb *notebook) signal(sig syscall.Signal) {
	if k := nb.cur; k != nil {
		for _, c := range []*child{k.kern, k.shim} {
			if !c.exited() {
				_ = syscall.Kill(-c.pid, sig)
			}
		}
	}
}

// shutdown kills the kernel (the agent is stopping).
func (nb *notebook) shutdown() {
	if nb.cur != nil {
		nb.end(nb.cur, "the agent stopped")
	}
}

var errStartTimeout = errors.New("start timed out")

// start starts ipykernel and the shim and waits, until deadline, for the
// shim to report the kernel ready.
func (nb *notebook) start(ctx context.Context, deadline time.Time) (*kernel, error) {
	s := nb.s
	bin, err := lookPath("python3", envValue(s.opts.Env, "PATH"))
	if err != nil {
		return nil, errors.New("python3 not found on PATH")
	}
	dir, err := os.MkdirTemp(s.opts.TmpDir, "kernel-")
	if err != nil {
		return nil, fmt.Errorf("kernel dir: %w", err)
	}
	k := &kernel{dir: dir, lines: make(chan []byte, 64), skip: make(chan struct{}, 1), gone: make(chan struct{})}
	cf, err := writeConnectionFile(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	defer devnull.Close()
	env := withEnv(s.opts.Env, map[string]string{
		"MPLBACKEND": kernelInlineBackend,
		// debugpy, which ipykernel imports, warns about frozen modules.
		"PYDEVD_DISABLE_FILE_VALIDATION": "1",
	})
	k.kern, err = s.startChild(true, &exec.Cmd{
		Path:   bin,
		Args:   append([]string{"python3", "-m", "ipykernel_launcher", "-f", cf}, kernelArgs...),
		Env:    env,
		Dir:    s.opts.WorkDir,
		Stdin:  devnull,
		Stdout: devnull,
		Stderr: s.log,
	})
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start ipykernel: %w", err)
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		k.kill()
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		k.kill()
		return nil, err
	}
	wait := time.Until(deadline).Seconds()
	k.shim, err = s.startChild(false, &exec.Cmd{
		Path:   bin,
		Args:   []string{"python3", "-s", "-c", kernelShim, cf, strconv.FormatFloat(max(wait, 1), 'f', 1, 64)}, // -s: no user site (cells write it)
		Env:    s.opts.Env,
		Dir:    "/",
		Stdin:  inR,
		Stdout: outW,
		Stderr: s.log,
	})
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		k.kill()
		return nil, fmt.Errorf("start kernel client: %w", err)
	}
	k.in = inW
	go k.readLines(outR)

	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	for {
		select {
		case line, ok := <-k.lines:
			if !ok {
				k.kill()
				return nil, fmt.Errorf("the kernel client %s during start-up", k.waitShim())
			}
			var m struct {
				T     string `json:"t"`
				Error string `json:"error"`
			}
			if json.Unmarshal(line, &m) != nil {
				continue
			}
			switch m.T {
			case "ready":
				return k, nil
			case "fatal":
				k.kill()
				return nil, fmt.Errorf("the kernel did not start: %s", truncate(m.Error, 300))
			}
		case <-k.kern.done:
			k.kill()
			return nil, fmt.Errorf("ipykernel %s during start-up (is python3-ipykernel installed in the sandbox image?)", k.kern.describe())
		case <-t.C:
			k.kill()
			return nil, errStartTimeout
		case <-ctx.Done():
			k.kill()
			return nil, errors.New("agent shutting down")
		}
	}
}

// waitShim describes the shim's end once it has been waited for (bounded).
func (k *kernel) waitShim() string {
	select {
	case <-k.shim.done:
		return k.shim.describe()
	case <-time.After(killGraceWait):
		return "closed its output"
	}
}

// writeConnectionFile writes a Jupyter connection file for the ipc
// transport into dir, with a fresh HMAC key, readable by its owner only.
func writeConnectionFile(dir string) (string, error) {
	var key [32]byte
	if _, err := rand.Read(key[:]); err != nil {
		return "", err
	}
	b, err := json.Marshal(map[string]any{
		"transport": "ipc", "ip": filepath.Join(dir, "k"),
		"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5,
		"key": hex.EncodeToString(key[:]), "signature_scheme": "hmac-sha256", "kernel_name": "python3",
	})
	if err != nil {
		return "", err
	}
	p := filepath.Join(dir, "kernel.json")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		return "", fmt.Errorf("connection file: %w", err)
	}
	return p, nil
}

// startChild starts c leading a session (setsid) or else a process group
// of its own, and registers it with the sweep as a notebook process.
func (s *Server) startChild(setsid bool, c *exec.Cmd) (*child, error) {
	c.SysProcAttr = &syscall.SysProcAttr{Setsid: setsid, Setpgid: !setsid}
	c.WaitDelay = time.Second
	return startRegistered(c, notebookProcs)
}

// startRegistered starts c and, until it has been waited for, lists it as
// managed and in set (under spawnMu, so the sweep never sees it unlisted).
func startRegistered(c *exec.Cmd, set map[int]bool) (*child, error) {
	spawnMu.Lock()
	err := c.Start()
	if err == nil {
		managed[c.Process.Pid] = true
		set[c.Process.Pid] = true
	}
	spawnMu.Unlock()
	if err != nil {
		return nil, err
	}
	ch := &child{pid: c.Process.Pid, done: make(chan struct{})}
	go func() {
		_ = c.Wait()
		spawnMu.Lock()
		delete(managed, ch.pid)
		delete(set, ch.pid)
		spawnMu.Unlock()
		ch.state = c.ProcessState
		close(ch.done)
	}()
	return ch, nil
}

// kill ends both processes (SIGKILL to their process groups), waits for
// them (bounded) and removes the kernel's directory. Call it once.
func (k *kernel) kill() {
	close(k.gone)
	for _, c := range []*child{k.kern, k.shim} {
		if c != nil {
			_ = syscall.Kill(-c.pid, syscall.SIGKILL)
			_ = syscall.Kill(c.pid, syscall.SIGKILL)
		}
	}
	for _, c := range []*child{k.kern, k.shim} {
		if c != nil {
			select {
			case <-c.done:
			case <-time.After(killGraceWait):
			}
		}
	}
	if k.in != nil {
		k.in.Close()
	}
	os.RemoveAll(k.dir)
}
