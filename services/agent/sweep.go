package agent

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// SweepMode decides which processes the post-run sweep kills.
type SweepMode int

const (
	// SweepAuto picks SweepContainer when the agent looks like a container's
	// main process (it is PID 1 or a direct child of PID 1, i.e. of
	// docker-init) and does not run as root; otherwise SweepDescendants.
	SweepAuto SweepMode = iota
	// SweepContainer kills every process the agent may signal except
	// itself, PID 1, its zygote(s) and its notebook kernel. Only meaningful inside a sandbox
	// container's PID namespace; Serve refuses it when the agent is neither
	// PID 1 nor a child of PID 1, or runs as root.
	SweepContainer
	// SweepDescendants kills only the agent's descendants (except its
	// zygotes and notebook kernel). The agent makes itself a child subreaper so that
	// setsid/double-fork daemons stay its descendants. Used by tests and
	// when the agent runs on a normal host.
	SweepDescendants
)

func (m SweepMode) String() string {
	switch m {
	case SweepAuto:
		return "auto"
	case SweepContainer:
		return "container"
	case SweepDescendants:
		return "descendants"
	}
	return fmt.Sprintf("SweepMode(%d)", int(m))
}

// ParseSweepMode parses "auto", "container" or "descendants".
func ParseSweepMode(s string) (SweepMode, error) {
	switch s {
	case "", "auto":
		return SweepAuto, nil
	case "container":
		return SweepContainer, nil
	case "descendants":
		return SweepDescendants, nil
	}
	return 0, fmt.Errorf("unknown sweep mode %q (want auto, container or descendants)", s)
}

// containerLike reports whether the process looks like a sandbox's main
// process: PID 1, or a child of PID 1 (docker-init/tini), and not root.
func containerLike() bool {
	if os.Geteuid() == 0 {
		return false
	}
	return os.Getpid() == 1 || os.Getppid() == 1
}

func resolveSweepMode(m SweepMode) (SweepMode, error) {
	switch m {
	case SweepAuto:
		if containerLike() {
			return SweepContainer, nil
		}
		return SweepDescendants, nil
	case SweepContainer:
		if !containerLike() {
			return 0, errors.New("sweep mode container needs the agent to be PID 1 or a child of PID 1 and not root (it kills every process it can signal); use descendants outside a sandbox container")
		}
		return SweepContainer, nil
	case SweepDescendants:
		return SweepDescendants, nil
	}
	return 0, fmt.Errorf("invalid sweep mode %d", int(m))
}

// Process bookkeeping shared by every Server in the process.
//
// spawnMu is held while a child is started and registered and during every
// sweep round, so a sweep never sees a just-forked child it does not know
// about yet. protected holds the pids the sweep must spare (live zygotes,
// the Node resident and idle spare);
// managed holds the pids some exec.Cmd will wait for, which the sweep must
// not reap itself. See infra.go for what else the sweep spares.
//
// jobSessions holds the session IDs of live jobs (a job leader starts its
// own session, so the ID is also its pid): the post-run sweep spares every
// process in those sessions and all their descendants.
//
// notebookProcs holds the pids of the live notebook kernel and its client
// (see kernel.go): the sweep spares them, but not their children.
var (
	spawnMu       sync.Mutex
	protected     = map[int]bool{}
	managed       = map[int]bool{}
	jobSessions   = map[int]bool{}
	notebookProcs = map[int]bool{}
)

// runSem serialises runs (and with them sweeps) across all Servers of the
// process: the sweep kills everything outside the protected set, so two
// concurrent runs would kill each other.
var runSem = make(chan struct{}, 1)

// subreaperOnce makes the agent a child subreaper (PR_SET_CHILD_SUBREAPER),
// so that orphans of runs are re-parented to the agent rather than to PID 1
// and stay visible as descendants.
var subreaperOnce sync.Once

func becomeSubreaper() {
	subreaperOnce.Do(func() {
		const prSetChildSubreaper = 36
		_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0)
	})
}

type procInfo struct {
	pid, ppid int
	sid       int
	state     byte
	flags     uint64 // PF_* flags of the thread-group leader
	threads   int    // num_threads
	start     uint64 // starttime in clock ticks since boot: (pid, start) names a process
}

// pfExiting is PF_EXITING: the task is in do_exit and never returns to
// user space.
const pfExiting = 0x4

// spareOfZygote reports whether p is an idle spare of a live zygote: a
// child of a protected process that is still in the agent's session (see
// infra.go: a spare calls setsid before it runs any code, and nothing can
// join another session). Caller holds spawnMu.
func spareOfZygote(p procInfo) bool {
	return protected[p.ppid] && p.sid == infraSID && p.state != 'Z' && p.state != 'X'
}

type procKey struct {
	pid   int
	start uint64
}

// listProcs reads pid, ppid, state and start time of every process visible
// in procRoot; misses counts listed processes whose stat could not be read
// (they exited in between).
func listProcs(procRoot string) (procs []procInfo, misses int, err error) {
	d, err := os.Open(procRoot)
	if err != nil {
		return nil, 0, err
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return nil, 0, err
	}
	out := make([]procInfo, 0, len(names))
	for _, n := range names {
		pid, err := strconv.Atoi(n)
		if err != nil || pid <= 0 {
			continue
		}
		b, err := ReadProcFile(procRoot + "/" + n + "/stat")
		if err != nil {
			misses++ // gone
			continue
		}
		p, ok := parseStat(b)
		if !ok {
			misses++
			continue
		}
		p.pid = pid
		out = append(out, p)
	}
	return out, misses, nil
}

// parseStat parses "pid (comm) S ppid ... starttime ..."; comm may contain
// anything, so the fields are counted from the last ')'.
func parseStat(b []byte) (procInfo, bool) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procInfo{}, false
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state), f[1] field 4 (ppid), f[3] field 6
	// (session), f[6] field 9 (flags), f[17] field 20 (num_threads),
	// f[19] field 22 (starttime).
	if len(f) < 20 || len(f[0]) != 1 {
		return procInfo{}, false
	}
	ppid, err := strconv.Atoi(string(f[1]))
	if err != nil {
		return procInfo{}, false
	}
	sid, err := strconv.Atoi(string(f[3]))
	if err != nil {
		return procInfo{}, false
	}
	flags, err := strconv.ParseUint(string(f[6]), 10, 64)
	if err != nil {
		return procInfo{}, false
	}
	threads, err := strconv.Atoi(string(f[17]))
	if err != nil {
		return procInfo{}, false
	}
	st, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		return procInfo{}, false
	}
	return procInfo{ppid: ppid, sid: sid, state: f[0][0], flags: flags, threads: threads, start: st}, true
}

// ProcStat is what the sandbox backends read of a thread's stat file
// (/proc/<pid>/stat or /proc/<pid>/task/<tid>/stat), with the parser the
// sweep uses.
type ProcStat struct {
	State   byte
	PPid    int
	Session int
	Flags   uint64 // PF_* flags
	Start   uint64 // starttime in clock ticks since boot
}

// ParseProcStat parses a stat file's contents.
func ParseProcStat(b []byte) (ProcStat, bool) {
	p, ok := parseStat(b)
	return ProcStat{State: p.state, PPid: p.ppid, Session: p.sid, Flags: p.flags, Start: p.start}, ok
}

// Live reports whether the thread can run code again: not a zombie, not
// dead, not already in exit.
func (p ProcStat) Live() bool {
	return p.State != 'Z' && p.State != 'X' && p.Flags&pfExiting == 0
}

// sweepTargets returns the processes a sweep round should consider. In
// descendants mode, dangling reports whether some process's parent is
// missing from the snapshot: /proc is not read atomically, so a process
// whose parent exited while it was being re-parented to the agent can look
// unrelated; the sweep then does not trust a quiet round.
func sweepTargets(mode SweepMode, procs []procInfo, self int) (out []procInfo, dangling bool) {
	if mode == SweepContainer {
		out = make([]procInfo, 0, len(procs))
		for _, p := range procs {
			if p.pid != self && p.pid != 1 {
				out = append(out, p)
			}
		}
		return out, false
	}
	children := map[int][]procInfo{}
	present := make(map[int]bool, len(procs))
	for _, p := range procs {
		children[p.ppid] = append(children[p.ppid], p)
		present[p.pid] = true
	}
	for _, p := range procs {
		if p.ppid > 0 && !present[p.ppid] && p.state != 'Z' && p.state != 'X' {
			dangling = true
		}
	}
	queue := []int{self}
	seen := map[int]bool{self: true}
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		for _, c := range children[pid] {
			if seen[c.pid] {
				continue
			}
			seen[c.pid] = true
			out = append(out, c)
			queue = append(queue, c.pid)
		}
	}
	return out, dangling
}

const (
	// maxSweepRounds bounds the kill loop. Every round SIGKILLs every
	// process it has not signalled yet; a process with SIGKILL pending
	// cannot fork any more, so fork bombs converge within the pids limit.
	maxSweepRounds = 50
	// sweepExitWait bounds how long the sweep waits for the processes it
	// killed to actually disappear (exit is asynchronous).
	sweepExitWait = 2 * time.Second
)

// sweepResult summarises one sweep.
type sweepResult struct {
	killed    int  // processes SIGKILLed
	converged bool // a round found nothing new to kill
	gone      bool // every killed process has exited or is in exit
}

// sweep SIGKILLs every target process except the protected ones, round after
// round, until a round is quiet, then waits (bounded) until the killed
// processes have exited. Zombies that are the agent's own unmanaged
// children (orphans re-parented to the subreaper) are reaped.
//
// A snapshot of /proc is not atomic: the pid list is read first and each
// stat file later, so a process can fork and exit in between, its child
// missing from the list and itself looking like a harmless zombie. A round
// is therefore quiet only if it killed nothing, saw no target it had not
// seen in the previous round (zombies included), could read every listed
// process and found no process whose parent was missing. Any process that
// could still fork after such a round would have been alive, and so killed,
// in it.
//
// Members of live jobs are spared (see jobMembers).
func sweep(mode SweepMode, procRoot string) sweepResult {
	return sweepWith(procRoot, func(procs []procInfo, self int) ([]procInfo, bool) {
		targets, dangling := sweepTargets(mode, procs, self)
		if len(jobSessions) == 0 {
			return targets, dangling
		}
		members := jobMembers(procs, func(p procInfo) bool { return jobSessions[p.sid] || jobSessions[p.pid] })
		out := targets[:0]
		for _, p := range targets {
			if !members[p.pid] {
				out = append(out, p)
			}
		}
		return out, dangling
	})
}

// jobMembers returns the pids of the processes seed selects and of all
// their descendants in the snapshot.
func jobMembers(procs []procInfo, seed func(procInfo) bool) map[int]bool {
	children := map[int][]int{}
	members := map[int]bool{}
	var queue []int
	for _, p := range procs {
		children[p.ppid] = append(children[p.ppid], p.pid)
		if seed(p) {
			members[p.pid] = true
			queue = append(queue, p.pid)
		}
	}
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		for _, c := range children[pid] {
			if !members[c] {
				members[c] = true
				queue = append(queue, c)
			}
		}
	}
	return members
}

// killJobTree SIGKILLs what is left of the job whose session is sid: the
// processes in that session, their descendants, and the processes in any
// session one of those started (a setsid child that forked just before its
// parent died is found through its session). A process that escaped both
// links (setsid, then orphaned) between two snapshots is not found here;
// the sweep that follows every job end and every run kills it, since it
// belongs to no live job. The caller has removed sid from jobSessions.
func killJobTree(procRoot string, sid int) sweepResult {
	sids := map[int]bool{sid: true}
	return sweepWith(procRoot, func(procs []procInfo, self int) ([]procInfo, bool) {
		present := make(map[int]bool, len(procs))
		for _, p := range procs {
			present[p.pid] = true
		}
		members := jobMembers(procs, func(p procInfo) bool { return sids[p.sid] || p.pid == sid })
		var out []procInfo
		dangling := false
		for _, p := range procs {
			if p.ppid > 0 && !present[p.ppid] && p.state != 'Z' && p.state != 'X' {
				dangling = true
			}
			if !members[p.pid] || p.pid == self || p.pid == 1 {
				continue
			}
			out = append(out, p)
			if p.sid > 1 {
				sids[p.sid] = true
			}
		}
		return out, dangling
	})
}

// sweepWith is the kill loop of sweep; sel picks a round's targets from a
// snapshot and is called with spawnMu held.
func sweepWith(procRoot string, sel func(procs []procInfo, self int) ([]procInfo, bool)) sweepResult {
	self := os.Getpid()
	signalled := map[procKey]bool{}
	exiting := map[procKey]bool{}
	var res sweepResult
	prev := map[procKey]bool{}
	// pass scans once. With kill it signals new targets and reports
	// whether the round was quiet; either way it counts the signalled
	// processes that are still alive (live). Zombies of ours are reaped.
	pass := func(kill bool) (n, live int, quiet bool, err error) {
		procs, misses, err := listProcs(procRoot)
		if err != nil {
			return 0, 0, false, err
		}
		spawnMu.Lock()
		defer spawnMu.Unlock()
		targets, dangling := sel(procs, self)
		quiet = misses == 0 && !dangling
		seen := make(map[procKey]bool, len(targets))
		for _, p := range targets {
			if protected[p.pid] || notebookProcs[p.pid] || spareOfZygote(p) {
				continue
			}
			k := procKey{p.pid, p.start}
			seen[k] = true
			if !prev[k] {
				quiet = false
			}
			if p.state == 'Z' || p.state == 'X' {
				if p.ppid == self && !managed[p.pid] {
					var ws syscall.WaitStatus
					_, _ = syscall.Wait4(p.pid, &ws, syscall.WNOHANG, nil)
				}
				continue
			}
			// Killed and already in exit, it runs no user code again;
			// still wait for our own children, to reap them.
			if signalled[k] && (p.flags&pfExiting == 0 || p.ppid == self) {
				live++
			}
			if !kill || signalled[k] || exiting[k] {
				continue
			}
			if p.flags&pfExiting != 0 {
				// Already in exit (a run that reported its status just
				// before os._exit): SIGKILL dooms any other thread and
				// forbids new children, and no user code runs again, so
				// its teardown is not waited for.
				if syscall.Kill(p.pid, syscall.SIGKILL) == nil {
					exiting[k] = true
				}
				continue
			}
			if syscall.Kill(p.pid, syscall.SIGKILL) == nil {
				signalled[k] = true
				n++
			}
		}
		prev = seen
		return n, live, quiet && n == 0, nil
	}
	live := 0
	for round := 0; round < maxSweepRounds; round++ {
		n, l, quiet, err := pass(true)
		if err != nil {
			return res
		}
		res.killed += n
		if quiet {
			res.converged = true
			live = l
			break
		}
		if n == 0 && round > 0 {
			// let exits and re-parenting settle (a first round that only
			// met new targets is retried at once)
			nap(sweepPause)
		}
	}
	// The quiet round saw what the kills had done already.
	if res.killed == 0 || res.converged && live == 0 {
		res.gone = true
		return res
	}
	deadline := time.Now().Add(sweepExitWait)
	for {
		_, live, _, err := pass(false)
		if err != nil {
			return res
		}
		if live == 0 {
			res.gone = true
			return res
		}
		if time.Now().After(deadline) {
			return res
		}
		nap(sweepPause)
	}
}

// sweepPause is how long the sweep waits between two reads of /proc for
// the processes it killed to reach exit (the run's answer waits too).
const sweepPause = 100 * time.Microsecond

// nap sleeps d in nanosleep: the Go runtime rounds a timer under a
// millisecond up to its next check, and time.Sleep(100µs) took 1.09 ms at
// p50 here, against 0.16 ms for nanosleep (which blocks only this
// goroutine's thread for that long).
func nap(d time.Duration) {
	ts := unix.NsecToTimespec(d.Nanoseconds())
	_ = unix.Nanosleep(&ts, nil)
}
