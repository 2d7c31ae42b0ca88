package docker

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// The broker's own check for processes a run left behind (agent.Strays):
// under runc it reads the host's /proc, under gVisor it asks the sandbox's
// session monitor (gvisor.go). Each reads IDs in one namespace and
// compares them only with IDs from the same place.

// hostSessions reads c's agent.Sessions from the host's /proc (nil when
// it cannot tell). Threads, not processes: cgroup.procs omits a process
// whose leader thread exited while its other threads run on, so every
// thread of the cgroup is read, with its process.
func (e *Engine) hostSessions(c *ctr) agent.Sessions {
	b, err := os.ReadFile(filepath.Join(cgroupRoot, "pids", "docker", c.dockerID, "tasks"))
	if err != nil {
		return nil
	}
	out := agent.Sessions{}
	seen := map[int]bool{}
	for _, f := range strings.Fields(string(b)) {
		tid, err := strconv.Atoi(f)
		if err != nil {
			continue
		}
		if sid, pid, ok := hostThread(tid); ok && !seen[pid] {
			seen[pid] = true
			out[sid] = append(out[sid], pid)
		}
	}
	return out
}

// hostThread reads the session and the process (thread-group ID) of the
// host thread tid (any thread ID works in /proc, listed or not). Threads
// that run no code again are skipped: zombies, and threads already in exit
// (PF_EXITING), such as a run that reported its status just before its
// teardown finished.
func hostThread(tid int) (sid, pid int, ok bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", tid))
	if err != nil {
		return 0, 0, false
	}
	st, ok := agent.ParseProcStat(b)
	if !ok || !st.Live() {
		return 0, 0, false
	}
	b, err = os.ReadFile(fmt.Sprintf("/proc/%d/status", tid))
	if err != nil {
		return 0, 0, false
	}
	for line := range bytes.Lines(b) {
		if v, found := bytes.CutPrefix(line, []byte("Tgid:")); found {
			pid, err := strconv.Atoi(string(bytes.TrimSpace(v)))
			return st.Session, pid, err == nil && pid > 0
		}
	}
	return 0, 0, false
}

// sessionsBefore returns the sessions in c before a run. Under gVisor it
// is the set the last check found (after the previous run, or when the
// container started), which saves a round trip to the sandbox per run.
func (e *Engine) sessionsBefore(c *ctr) agent.Sessions {
	if e.o.Runtime != RuntimeRunsc {
		return e.hostSessions(c)
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
// container's notebook kernel session. Caller holds s.mu.
func (e *Engine) hasStrays(c *ctr, before agent.Sessions, kernel *sandbox.KernelStatus) bool {
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
		after = e.hostSessions(c)
	}
	started := kernel != nil && kernel.Started && kernel.Ended == ""
	stray, sid := agent.Strays(before, after, c.kernelSID, started)
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
