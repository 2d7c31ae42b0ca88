package agent

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Notebook mode. The agent runs kernel.py, IPython's InteractiveShell (the
// shell inside ipykernel, from Debian's python3-ipykernel) as its child,
// and exchanges a cell's code and outputs with it as JSON lines over a
// socket pair: Jupyter's semantics for cells, without the ZeroMQ
// transport and event loop that made a cell cost several milliseconds
// (see kernel.py). The kernel leads a session of its own. The sweep after
// every run spares it (see notebookProcs) and kills everything else, the
// kernel's children included; the broker's host-side check then holds
// the kernel's session to the kernel alone (see Strays). Between runs the
// kernel is stopped (SIGSTOP), so no code of the session runs while no
// call is in progress. A timeout, a dead kernel or one that closed its
// socket ends it; the next notebook run starts a new kernel and says why
// the old one went.

//go:embed kernel.py
var kernelScript string

const (
	// kernelInlineBackend is Jupyter's own matplotlib backend: plt.show()
	// and the figures a cell leaves open become image/png displays.
	kernelInlineBackend = "module://matplotlib_inline.backend_inline"
	// maxKernelLine bounds one line from the kernel (a MIME value of up
	// to 1 Mi characters, JSON-escaped); longer lines are dropped.
	maxKernelLine = 8 << 20
)

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
	status, err := ReadProcFile(filepath.Join(procRoot, strconv.Itoa(c.pid), "status"))
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
	kern  *child
	conn  net.Conn      // the agent's end of the kernel's socket (fd 3 there)
	lines chan []byte   // the kernel's messages, one line each; closed at EOF
	skip  chan struct{} // a line over maxKernelLine was dropped
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
	if k := nb.cur; k != nil && k.kern.dying(s.opts.ProcRoot) {
		k.waitExit()
		nb.end(k, "the kernel "+k.kern.describe())
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

// waitExit waits, bounded, for the dying kernel to be collected, so that
// describe can say how it ended.
func (k *kernel) waitExit() {
	t := time.NewTimer(killGraceWait)
	defer t.Stop()
	select {
	case <-k.kern.done:
	case <-t.C:
	}
}

// end kills k, if it is the current kernel forgets it, and notes why.
func (nb *notebook) end(k *kernel, why string) {
	k.kill()
	if nb.cur == k {
		nb.cur = nil
		nb.lost = why
	}
}

// freeze stops the kernel (SIGSTOP to its process group) once a run is
// over, so that between calls no code of the session runs, threads a cell
// started included, as after a fresh run's sweep. Every run ends with it
// (fresh runs too: their code could resume the kernel), and so does a
// job's cleanup. The caller holds runSem.
func (nb *notebook) freeze() { nb.signal(syscall.SIGSTOP) }

// thaw resumes a frozen kernel for a cell. The caller holds runSem.
func (nb *notebook) thaw() { nb.signal(syscall.SIGCONT) }

func (nb *notebook) signal(sig syscall.Signal) {
	if k := nb.cur; k != nil && !k.kern.exited() {
		_ = syscall.Kill(-k.kern.pid, sig)
	}
}

// shutdown kills the kernel (the agent is stopping).
func (nb *notebook) shutdown() {
	if nb.cur != nil {
		nb.end(nb.cur, "the agent stopped")
	}
}

var errStartTimeout = errors.New("start timed out")

// start starts the kernel and waits, until deadline, for it to report
// ready.
func (nb *notebook) start(ctx context.Context, deadline time.Time) (*kernel, error) {
	s := nb.s
	bin, err := lookPath("python3", envValue(s.opts.Env, "PATH"))
	if err != nil {
		return nil, errors.New("python3 not found on PATH")
	}
	conn, theirs, err := childSocket(syscall.SOCK_STREAM)
	if err != nil {
		return nil, err
	}
	defer theirs.Close()
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		conn.Close()
		return nil, err
	}
	defer devnull.Close()
	var id [8]byte
	_, _ = rand.Read(id[:])
	k := &kernel{conn: conn, lines: make(chan []byte, 64), skip: make(chan struct{}, 1), gone: make(chan struct{})}
	k.kern, err = s.startChild(&exec.Cmd{
		Path:       bin,
		Args:       []string{"python3", "-c", kernelScript, "sandbox-kernel-" + hex.EncodeToString(id[:])},
		Env:        withEnv(s.opts.Env, map[string]string{"MPLBACKEND": kernelInlineBackend}),
		Dir:        s.opts.WorkDir,
		Stdin:      devnull,
		Stdout:     devnull,
		Stderr:     s.log,
		ExtraFiles: []*os.File{theirs}, // fd 3
	})
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("start the kernel: %w", err)
	}
	go k.readLines(conn)

	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	for {
		select {
		case line, ok := <-k.lines:
			if !ok {
				k.kill()
				return nil, fmt.Errorf("the kernel %s during start-up", k.waitKernel())
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
				return nil, fmt.Errorf("the kernel did not start: %s (is python3-ipykernel installed in the sandbox image?)", truncate(m.Error, 300))
			}
		case <-k.kern.done:
			k.kill()
			return nil, fmt.Errorf("the kernel %s during start-up (is python3-ipykernel installed in the sandbox image?)", k.kern.describe())
		case <-t.C:
			k.kill()
			return nil, errStartTimeout
		case <-ctx.Done():
			k.kill()
			return nil, errors.New("agent shutting down")
		}
	}
}

// waitKernel describes the kernel's end once it has been waited for
// (bounded).
func (k *kernel) waitKernel() string {
	select {
	case <-k.kern.done:
		return k.kern.describe()
	case <-time.After(killGraceWait):
		return "closed its socket"
	}
}

// startChild starts c leading a session of its own and registers it with
// the sweep as the notebook kernel.
func (s *Server) startChild(c *exec.Cmd) (*child, error) {
	c.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
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

// kill ends the kernel (SIGKILL to its process group), waits for it
// (bounded) and closes the agent's end of its socket. Call it once.
func (k *kernel) kill() {
	close(k.gone)
	if c := k.kern; c != nil {
		_ = syscall.Kill(-c.pid, syscall.SIGKILL)
		_ = syscall.Kill(c.pid, syscall.SIGKILL)
		select {
		case <-c.done:
		case <-time.After(killGraceWait):
		}
	}
	k.conn.Close()
}
