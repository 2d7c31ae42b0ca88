package process

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// sbx is one running sandbox: the bwrap process tree of a session's agent.
type sbx struct {
	id      string
	r       *runner
	runDir  string // host <Root>/run/p-<id>, bound at agent.SocketDir (rw)
	pidFile string // host <Root>/run/p-<id>.pid: "pid starttime" of bwrap
	cmd     *exec.Cmd
	pid     int    // outer bwrap (host pid)
	start   uint64 // its start time, so a recycled pid is never killed
	cg      *cgroup
	exited  chan struct{} // closed once bwrap has been waited for
	stderr  *tailBuffer

	stopOnce sync.Once
	stopErr  error

	// kernelSID is the host session ID of its notebook kernel (see
	// agent.Strays), and known what the last stray check read (see
	// sessionsBefore); guarded by the session's runMu.
	kernelSID int
	known     agent.SessionCache
	// warming is set while a warm-up is pending (see warmAsync); used is
	// when its last run ended (UnixNano).
	warming atomic.Bool
	used    atomic.Int64
}

func (s *sbx) alive() bool {
	select {
	case <-s.exited:
		return false
	default:
		return true
	}
}

// wrapperScript holds the sandbox back until the broker has placed it in
// its cgroup: it waits for "go" on fd 3 and only then execs prlimit, which
// sets the rlimits and execs bwrap (same pid throughout), so no process of
// the sandbox ever runs unconstrained. If the broker
// dies first, read fails and nothing starts.
const wrapperScript = `read -r x <&3 && [ "$x" = go ] && exec "$@" 3<&-; exit 111`

// start launches a sandbox of r with workspaceDir at /mnt/data and waits
// for its agent; its language runtime then warms up in the background.
func (b *Backend) start(ctx context.Context, r *runner, workspaceDir string, uid, gid int) (*sbx, error) {
	defer b.o.Warmups.Starting()()
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, brokererr.New(brokererr.Unavailable, "the process sandbox backend is shut down")
	}
	id := sandbox.NewID()
	s := &sbx{
		id:      id,
		r:       r,
		runDir:  filepath.Join(b.o.Root, "run", "p-"+id),
		exited:  make(chan struct{}),
		stderr:  &tailBuffer{max: 2048},
		pidFile: filepath.Join(b.o.Root, "run", "p-"+id+".pid"),
	}
	cleanup := func() {
		_ = os.RemoveAll(s.runDir)
		_ = os.Remove(s.pidFile)
		_ = s.cg.remove()
	}
	if err := b.prepareDir(s.runDir, uid, gid); err != nil {
		cleanup()
		return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot create the sandbox run directory")
	}
	cg, err := b.cg.create(id, cgLimits{memory: b.o.MemoryBytes, pids: b.o.PidsLimit, cpuMilli: b.o.CPUMilli})
	if err != nil {
		b.log.Warn().Err(err).Msg("cgroup_create_failed")
	}
	s.cg = cg

	pr, w, err := os.Pipe()
	if err != nil {
		cleanup()
		return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot start a sandbox")
	}
	args := append([]string{"-c", wrapperScript, "sandbox-wrapper"}, b.prlimitArgs(r)...)
	args = append(args, b.o.Bwrap)
	args = append(args, b.bwrapArgs(r, workspaceDir, s.runDir, b.agentCommand(r))...)
	cmd := &exec.Cmd{
		Path:        "/bin/sh",
		Args:        append([]string{"sh"}, args...),
		Env:         []string{"PATH=/usr/bin:/bin"},
		Dir:         "/",
		Stderr:      s.stderr,
		ExtraFiles:  []*os.File{pr},
		SysProcAttr: b.sysProcAttr(uid, gid),
		WaitDelay:   2 * time.Second,
	}
	err = cmd.Start()
	pr.Close()
	if err != nil {
		w.Close()
		cleanup()
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "cannot start a sandbox")
	}
	s.cmd, s.pid = cmd, cmd.Process.Pid
	go func() {
		_ = cmd.Wait()
		close(s.exited)
	}()
	fail := func(err error) (*sbx, error) {
		w.Close()
		_ = b.stop(context.WithoutCancel(ctx), s)
		return nil, err
	}
	b.mu.Lock()
	b.live[s] = true
	closed = b.closed // Close may have run since the check above
	b.mu.Unlock()
	if closed {
		return fail(brokererr.New(brokererr.Unavailable, "the process sandbox backend is shut down"))
	}
	st, ok := procStart(s.pid)
	if !ok {
		return fail(brokererr.New(brokererr.Unavailable, "the sandbox exited at once"))
	}
	s.start = st
	if err := os.WriteFile(s.pidFile, fmt.Appendf(nil, "%d %d\n", s.pid, s.start), 0o600); err != nil {
		return fail(brokererr.Wrap(err, brokererr.InternalError, "cannot record the sandbox"))
	}
	if err := s.cg.add(s.pid); err != nil {
		return fail(brokererr.Wrap(err, brokererr.Unavailable, "cannot place the sandbox in its cgroup"))
	}
	if _, err := w.Write([]byte("go\n")); err != nil {
		return fail(brokererr.Wrap(err, brokererr.Unavailable, "the sandbox exited at once"))
	}
	w.Close()

	// Readiness, cut short when bwrap exits (a bad mount, no userns).
	rctx, cancel := context.WithTimeout(ctx, b.o.ReadyTimeout)
	defer cancel()
	go func() {
		select {
		case <-s.exited:
			cancel()
		case <-rctx.Done():
		}
	}()
	if err := agent.WaitReady(rctx, s.socket()); err != nil {
		b.log.Warn().Err(err).Str("sandbox", id).Str("stderr_tail", b.redact(s.stderr.String(), workspaceDir)).Msg("sandbox_agent_not_ready")
		return fail(brokererr.Wrap(err, brokererr.Unavailable, "the sandbox did not become ready"))
	}
	// The first run does not wait for the runtime (it lives in the agent's
	// session, which every stray check counts as existing: agent/infra.go).
	b.warmAsync(s)
	return s, nil
}

// warmAsync has sb's agent warm its language runtime in the background, in
// its turn (Options.Warmups); at most one warm-up is pending per sandbox.
// A sandbox unused for the agent's idle release is left cold: the agent
// would only release it again.
func (b *Backend) warmAsync(sb *sbx) {
	if !agent.HasRuntime(sb.r.lang) || !sb.warming.CompareAndSwap(false, true) {
		return
	}
	b.bg.Add(1)
	go func() {
		defer b.bg.Done()
		defer sb.warming.Store(false)
		ctx, cancel := context.WithTimeout(context.Background(), warmTurnLimit) // ends with sb (Close stops every sandbox)
		defer cancel()
		go func() {
			select {
			case <-sb.exited:
				cancel()
			case <-ctx.Done():
			}
		}()
		err := agent.WarmInTurn(ctx, b.o.Warmups, sb.socket(), func() bool {
			used := sb.used.Load()
			return b.o.IdleRelease > 0 && used != 0 && time.Since(time.Unix(0, used)) >= b.o.IdleRelease
		})
		if err != nil && ctx.Err() == nil {
			b.log.Warn().Err(err).Str("sandbox", sb.id).Msg("sandbox_not_warm")
		}
	}()
}

// warmTurnLimit bounds the wait for a warm-up's turn; a later cold run
// asks again.
const warmTurnLimit = 10 * time.Minute

// stop kills the sandbox's whole tree and removes its run dir, pid file
// and cgroup. The outer bwrap's death SIGKILLs the namespace's init
// (--die-with-parent), and the kernel then kills every process of the pid
// namespace; the cgroup (or, without one, the process tree recorded
// before the kill) confirms nothing survived.
func (b *Backend) stop(ctx context.Context, s *sbx) error {
	s.stopOnce.Do(func() {
		s.stopErr = b.kill(ctx, s)
		_ = os.RemoveAll(s.runDir)
		_ = os.Remove(s.pidFile)
		if err := s.cg.remove(); err != nil && s.stopErr == nil {
			s.stopErr = err
		}
		b.mu.Lock()
		delete(b.live, s)
		b.mu.Unlock()
	})
	return s.stopErr
}

func (b *Backend) kill(ctx context.Context, s *sbx) error {
	if s.cmd == nil {
		return nil
	}
	tree := descendants(s.pid)
	_ = syscall.Kill(-s.pid, syscall.SIGKILL) // wrapper's session (Setsid)
	_ = syscall.Kill(s.pid, syscall.SIGKILL)
	for _, p := range tree {
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
	}
	deadline := time.Now().Add(stopTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if s.cg != nil && !s.cg.kill(time.Until(deadline)) {
		return fmt.Errorf("process: sandbox %s: processes left in its cgroup", s.id)
	}
	select {
	case <-s.exited:
	case <-time.After(time.Until(deadline)):
		return fmt.Errorf("process: sandbox %s: bwrap did not exit", s.id)
	}
	for _, p := range tree {
		for alive(p) {
			if time.Now().After(deadline) {
				return fmt.Errorf("process: sandbox %s: process %d survived", s.id, p.pid)
			}
			_ = syscall.Kill(p.pid, syscall.SIGKILL)
			time.Sleep(2 * time.Millisecond)
		}
	}
	return nil
}

// procKey names a process: pid plus start time (pids are recycled).
type procKey struct {
	pid   int
	start uint64
}

// alive reports whether p still exists and is not a zombie.
func alive(p procKey) bool {
	st, ok := procStat(p.pid, p.pid)
	return ok && st.Start == p.start && st.State != 'Z' && st.State != 'X'
}

// descendants walks /proc/<pid>/task/*/children from pid, pid included.
func descendants(pid int) []procKey {
	var out []procKey
	seen := map[int]bool{}
	queue := []int{pid}
	for len(queue) > 0 && len(out) < 100000 {
		p := queue[0]
		queue = queue[1:]
		if seen[p] {
			continue
		}
		seen[p] = true
		st, ok := procStat(p, p)
		if !ok {
			continue
		}
		out = append(out, procKey{p, st.Start})
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", p))
		for _, t := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", p, t.Name()))
			if err != nil {
				continue
			}
			for _, f := range strings.Fields(string(b)) {
				if c, err := strconv.Atoi(f); err == nil {
					queue = append(queue, c)
				}
			}
		}
	}
	return out
}

// sessions maps the session ID of every live thread in the sandbox to
// its threads (nil when the tree cannot be read), as agent.Strays reads
// them: a live leader stands for its process's threads.
func (s *sbx) sessions() map[int][]int {
	var tree []procKey
	if pids := s.cg.pids(); s.cg != nil && pids != nil {
		for _, p := range pids {
			tree = append(tree, procKey{pid: p})
		}
	} else {
		tree = descendants(s.pid)
	}
	if len(tree) == 0 {
		return nil
	}
	out := map[int][]int{}
	for _, p := range tree {
		// The session is the whole process's: a live leader answers for
		// its threads. Only a dead leader's threads are read one by one.
		if st, ok := procStat(p.pid, p.pid); ok && st.Live() {
			out[st.Session] = append(out[st.Session], p.pid)
			continue
		}
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", p.pid))
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			if st, ok := procStat(p.pid, tid); ok && st.Live() {
				out[st.Session] = append(out[st.Session], tid)
			}
		}
	}
	return out
}

// sessionsBefore returns the sessions in the sandbox before a run: one
// read of its cgroup's processes with what the last stray check read (see
// agent.SessionCache), or a full read.
func (s *sbx) sessionsBefore() map[int][]int {
	if before := s.known.Before(s.cg.pids(), sessionOf); before != nil {
		return before
	}
	return s.sessions()
}

// sessionOf is the session of a live process, as sessions reads it.
func sessionOf(pid int) (int, bool) {
	if st, ok := procStat(pid, pid); ok && st.Live() {
		return st.Session, true
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, t := range tasks {
		if tid, err := strconv.Atoi(t.Name()); err == nil {
			if st, ok := procStat(pid, tid); ok && st.Live() {
				return st.Session, true
			}
		}
	}
	return 0, false
}

// procStat reads /proc/<pid>/task/<tid>/stat.
func procStat(pid, tid int) (agent.ProcStat, bool) {
	b, err := agent.ReadProcFile(fmt.Sprintf("/proc/%d/task/%d/stat", pid, tid))
	if err != nil {
		return agent.ProcStat{}, false
	}
	return agent.ParseProcStat(b)
}

func procStart(pid int) (uint64, bool) {
	st, ok := procStat(pid, pid)
	return st.Start, ok
}

// parsePidFile parses "pid starttime\n" as written by start.
func parsePidFile(b []byte) (procKey, bool) {
	if len(b) > 64 {
		return procKey{}, false
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return procKey{}, false
	}
	pid, err := strconv.Atoi(f[0])
	if err != nil || pid <= 1 || pid > 1<<22 {
		return procKey{}, false
	}
	start, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		return procKey{}, false
	}
	return procKey{pid, start}, true
}

// sweepOrphans kills sandboxes an earlier broker process on this Root left
// (normally already dead: --die-with-parent) by their pid files and
// cgroups, then removes every run dir.
func (b *Backend) sweepOrphans() {
	runDir := filepath.Join(b.o.Root, "run")
	ents, _ := os.ReadDir(runDir)
	killed := 0
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".pid")
		if !ok || !e.Type().IsRegular() {
			continue
		}
		if id, ok := strings.CutPrefix(name, "p-"); !ok || !sandbox.ValidID(id) {
			continue
		}
		data, err := os.ReadFile(filepath.Join(runDir, e.Name()))
		if k, ok := parsePidFile(data); err == nil && ok && alive(k) {
			tree := descendants(k.pid)
			for _, p := range tree {
				_ = syscall.Kill(p.pid, syscall.SIGKILL)
			}
			for _, p := range tree {
				deadline := time.Now().Add(5 * time.Second)
				for alive(p) && time.Now().Before(deadline) {
					time.Sleep(2 * time.Millisecond)
				}
			}
			killed++
		}
	}
	killed += b.cg.sweep()
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), "p-")
		if ok && len(rest) >= 16 && sandbox.ValidID(rest[:16]) {
			_ = os.RemoveAll(filepath.Join(runDir, e.Name()))
		}
	}
	if killed > 0 {
		b.log.Info().Int("sandboxes", killed).Msg("orphan_sandboxes_killed")
	}
}

func (s *sbx) socket() string { return filepath.Join(s.runDir, agent.SocketName) }

// run sends one request to the agent (see agent.Run; its dial refuses a
// socket the sandbox replaced with a symlink).
func (s *sbx) run(ctx context.Context, req agent.Request) (agent.Response, error) {
	return agentRun(ctx, s.socket(), req)
}

// agentRun is a variable so tests can observe or replace the call.
var agentRun = agent.Run

// tailBuffer keeps the last max bytes written (bwrap's and the agent's
// stderr, for the log when a sandbox fails to start).
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.ToValidUTF8(string(t.b), "?")
}

// redact replaces host paths in bwrap's messages before they are logged.
func (b *Backend) redact(msg string, workspaceDir string) string {
	if workspaceDir != "" {
		msg = strings.ReplaceAll(msg, workspaceDir, "<workspace>")
	}
	return strings.ReplaceAll(msg, b.o.Root, "<root>")
}

var warned sync.Map

// warnOnce runs fn the first time key is seen in this process.
func warnOnce(key string, fn func()) {
	if _, loaded := warned.LoadOrStore(key, true); !loaded {
		fn()
	}
}
