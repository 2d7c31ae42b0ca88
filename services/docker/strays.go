package docker

import (
	"bytes"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// The broker's own check for processes a run left behind (agent.Strays):
// under runc it reads the host's /proc, under gVisor it asks the sandbox's
// session monitor (gvisor.go). Each reads IDs in one namespace and
// compares them only with IDs from the same place.

// hostSessions reads c's agent.Sessions from the host's /proc (nil when
// it cannot tell), and the same sessions' threads, for c.known. Threads,
// not processes: cgroup.procs omits a process whose leader thread exited
// while its other threads run on, so every thread of the cgroup is read,
// with its process.
func (e *Engine) hostSessions(c *ctr) (sessions agent.Sessions, threads map[int][]int) {
	tids := e.tasks(c)
	if tids == nil {
		return nil, nil
	}
	sessions, threads = agent.Sessions{}, map[int][]int{}
	seen := map[int]bool{}
	groups := make(threadGroups, len(tids))
	for _, tid := range tids {
		sid, pid, ok := hostThread(tid, c.groups, groups)
		if !ok {
			continue
		}
		threads[sid] = append(threads[sid], tid)
		if !seen[pid] {
			seen[pid] = true
			sessions[sid] = append(sessions[sid], pid)
		}
	}
	c.groups = groups
	return sessions, threads
}

// threadGroups remembers the process (thread-group ID) of each thread a
// read saw, by thread ID and start time: a thread never changes process,
// and (ID, start time) names one thread, as in the agent's sweep (the
// kernel hands out IDs in a cycle, so an ID comes back only after a wrap
// through pid_max, never within one clock tick). A thread seen before
// needs only its stat read again (for its session and liveness), not its
// status: half the reads of each run's stray check, a runner container
// having about 30 threads.
type threadGroups map[threadKey]int

type threadKey struct {
	tid   int
	start uint64
}

// tasks lists the host thread IDs in c's pids cgroup (nil when it cannot
// be read): one file read.
func (e *Engine) tasks(c *ctr) []int {
	b, err := agent.ReadProcFile(filepath.Join(cgroupRoot, "pids", "docker", c.dockerID, "tasks"))
	if err != nil {
		return nil
	}
	tids := []int{}
	for _, f := range strings.Fields(string(b)) {
		if tid, err := strconv.Atoi(f); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids
}

// hostThreadSession is hostThread's session alone (one read), for
// agent.SessionCache.
func hostThreadSession(tid int) (int, bool) {
	st, ok := readHostStat(tid)
	return st.Session, ok
}

func readHostStat(tid int) (agent.ProcStat, bool) {
	b, err := agent.ReadProcFile(fmt.Sprintf("/proc/%d/stat", tid))
	if err != nil {
		return agent.ProcStat{}, false
	}
	st, ok := agent.ParseProcStat(b)
	return st, ok && st.Live()
}

// hostThread reads the session and the process (thread-group ID) of the
// host thread tid (any thread ID works in /proc, listed or not), the
// process from known when it holds the thread, and notes it in seen.
// Threads that run no code again are skipped: zombies, and threads already
// in exit (PF_EXITING), such as a run that reported its status just before
// its teardown finished.
func hostThread(tid int, known, seen threadGroups) (sid, pid int, ok bool) {
	st, ok := readHostStat(tid)
	if !ok {
		return 0, 0, false
	}
	k := threadKey{tid, st.Start}
	if pid, ok := known[k]; ok {
		seen[k] = pid
		return st.Session, pid, true
	}
	b, err := agent.ReadProcFile(fmt.Sprintf("/proc/%d/status", tid))
	if err != nil {
		return 0, 0, false
	}
	for line := range bytes.Lines(b) {
		if v, found := bytes.CutPrefix(line, []byte("Tgid:")); found {
			pid, err := strconv.Atoi(string(bytes.TrimSpace(v)))
			if err != nil || pid <= 0 {
				return 0, 0, false
			}
			seen[k] = pid
			return st.Session, pid, true
		}
	}
	return 0, 0, false
}

// sessionsBefore returns the sessions in c before a run. Under gVisor it
// is the set the last check found (after the previous run, or when the
// container started), which saves a round trip to the sandbox per run.
// Under runc it is one read of the cgroup's threads with what the last
// check read (agent.SessionCache), or a full read the first time; its
// lists then hold threads, not processes (Strays reads only before's
// sessions).
func (e *Engine) sessionsBefore(c *ctr) agent.Sessions {
	if e.o.Runtime != RuntimeRunsc {
		if before := c.known.Before(e.tasks(c), hostThreadSession); before != nil {
			return before
		}
		s, _ := e.hostSessions(c)
		return s
	}
	if c.sessions == nil {
		var err error
		if c.sessions, err = e.sandboxSessions(c); err != nil {
			e.log.Warn().Err(err).Str("container", shortID(c.dockerID)).Msg("sandbox_sessions_unknown")
		}
	}
	return c.sessions
}

// hasStrays reports processes left after a run, read from the host's /proc
// (under gVisor, from the Sentry's, see sessionMonitor) rather than from
// the (untrusted) agent (see agent.Strays); it also keeps track of the
// container's notebook kernel session (kernelStarted: the run started one
// that lives on). Caller holds s.mu.
func (e *Engine) hasStrays(c *ctr, before agent.Sessions, kernelStarted bool) bool {
	var after agent.Sessions
	if e.o.Runtime == RuntimeRunsc {
		var err error
		after, err = e.sandboxSessions(c)
		if err != nil || before == nil {
			// The host cannot look for itself: not knowing retires the
			// container.
			e.log.Warn().Err(err).Str("container", shortID(c.dockerID)).Msg("sandbox_sessions_unknown")
			return true
		}
	} else {
		if before == nil {
			return false // cannot tell (no cgroup v1 pids controller visible)
		}
		var threads map[int][]int
		after, threads = e.hostSessions(c)
		c.known.Record(threads)
	}
	stray, sid := agent.Strays(before, after, c.kernelSID, kernelStarted)
	c.kernelSID = sid
	if stray {
		e.log.Info().Str("container", shortID(c.dockerID)).Int("sessions_before", len(before)).Msg("sandbox_strays_found")
		return true
	}
	if e.o.Runtime == RuntimeRunsc {
		c.sessions = after
	}
	return false
}
