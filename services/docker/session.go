package docker

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/docker/docker/api/types/container"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Session is one session's sandbox: one container per language, created on
// the first Exec of that language. It implements sandbox.Session.
type Session struct {
	e   *Engine
	ref sandbox.SessionRef

	mu        sync.Mutex
	ctrs      map[string]*ctr
	uid       int // host uid (and gid) of its containers; 0 until leased
	destroyed bool

	kernel *sandbox.KernelLedger // the notebook kernel in its python container
}

var _ sandbox.Session = (*Session)(nil)

// Open implements sandbox.Backend. No container is started until Exec.
func (e *Engine) Open(ctx context.Context, ref sandbox.SessionRef) (sandbox.Session, error) {
	if !validWorkspaceID(ref.WorkspaceID) {
		return nil, brokererr.New(brokererr.InvalidInput, "invalid workspace id")
	}
	if ref.Dir == "" || !strings.HasPrefix(ref.Dir, "/") || path.Clean(ref.Dir) != ref.Dir {
		return nil, brokererr.New(brokererr.InternalError, "workspace dir must be a clean absolute path")
	}
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return nil, brokererr.New(brokererr.Unavailable, "the Docker engine is shut down")
	}
	return &Session{e: e, ref: ref, ctrs: map[string]*ctr{}, kernel: e.kernels.Get(ref.WorkspaceID)}, nil
}

func validWorkspaceID(s string) bool {
	if s == "" || len(s) > 64 || s == "pool" || s == "probe" {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// Exec runs code in the session's container for req.Language.
func (s *Session) Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	e := s.e
	r, err := e.runner(ctx, req.Language)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return sandbox.ExecResult{}, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	for attempt := 0; ; attempt++ {
		res, err := s.execLocked(ctx, r, req)
		if retryOnNewContainer(ctx, attempt, err) {
			continue
		}
		return res, err
	}
}

// retryOnNewContainer says a call whose agent could not be reached goes
// once more to a new container: nothing ran, and the old container is
// dead (a restarted Docker daemon kills them all) and already dropped.
func retryOnNewContainer(ctx context.Context, attempt int, err error) bool {
	return attempt == 0 && ctx.Err() == nil && errors.Is(err, agent.ErrNotReached)
}

// execLocked runs req once in the session's container for r. Caller holds
// s.mu.
func (s *Session) execLocked(ctx context.Context, r runnerImage, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	e := s.e
	c, err := s.containerLocked(ctx, r)
	if err != nil {
		return sandbox.ExecResult{}, err
	}

	timeout := req.Timeout
	if timeout <= 0 {
		timeout = defaultExecTimeout
	}
	if timeout > agent.MaxTimeoutMS*time.Millisecond {
		timeout = agent.MaxTimeoutMS * time.Millisecond
	}
	w, err := s.openWorkspace(ctx)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	defer w.Close()
	before, err := w.Snapshot()
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	jobsLive := c.jobs.Load() > 0
	oomBefore := e.oomKills(c)
	sessionsBefore := e.sessionsBefore(c)
	rctx, cancel := context.WithTimeout(ctx, timeout+hardStopMargin)
	stopWatch := s.watchQuota(rctx, w, c)
	start := time.Now()
	resp, err := agentRun(rctx, c.socket(), agent.Request{
		Language:       r.Language,
		Code:           req.Code,
		TimeoutMS:      max(timeout.Milliseconds(), 1),
		MaxOutputBytes: req.MaxOutputBytes,
		Mode:           req.Mode,
	})
	hardStop := rctx.Err() != nil && ctx.Err() == nil
	cancel()
	exceeded := stopWatch()
	dur := time.Since(start)
	if over, _ := w.OverQuota(); exceeded || over {
		return s.quotaExceeded(w, before, r.Language, c, dur)
	}
	if err != nil {
		// The agent is gone, hung or the caller gave up: this container's
		// state is unknown, so it goes; the next Exec starts a new one.
		oom := !hardStop && ctx.Err() == nil && e.lostToOOM(ctx, c, oomBefore)
		s.retireLocked(r.Language, c, sandbox.LostUnresponsive)
		switch {
		case oom:
			e.log.Info().Str("container", shortID(c.dockerID)).Msg("sandbox_oom_killed")
			return sandbox.ExecResult{Duration: dur, ExitCode: 137, Signal: "SIGKILL", OOMKilled: true}, nil
		case hardStop:
			e.log.Warn().Str("container", shortID(c.dockerID)).Dur("timeout", timeout).Msg("sandbox missed its deadline; killed")
			return sandbox.ExecResult{TimedOut: true, Duration: dur, ExitCode: -1, Signal: "SIGKILL"},
				brokererr.New(brokererr.SandboxTimeout, "the code did not finish within %s and the sandbox was killed", timeout)
		case ctx.Err() != nil:
			// Billed too: dropping the connection must not make a run free.
			return sandbox.ExecResult{Duration: dur}, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "the call was cancelled")
		}
		e.log.Warn().Err(err).Str("container", shortID(c.dockerID)).Msg("sandbox agent unreachable")
		return sandbox.ExecResult{Duration: dur}, brokererr.Wrap(err, brokererr.Unavailable, "the %s sandbox stopped responding; it will be restarted on the next call", r.Language)
	}
	c.used.Store(time.Now().UnixNano())
	if resp.Cold {
		e.warmAsync(c) // released when idle, or still warming up
	}
	res, err := agent.ExecResult(resp, dur)
	if err != nil {
		return res, err
	}
	res.Changed = w.ChangedFiles(before)
	if !res.TimedOut && (resp.Signal == "SIGKILL" || resp.ExitCode == 137) {
		res.OOMKilled = e.wasOOMKilled(ctx, c, oomBefore)
	}
	s.kernel.Observe(&res)
	// A run that timed out or hit the OOM killer may have left the
	// container in a bad state (stray processes, half-written /tmp): the
	// next run gets a fresh container. Files in the workspace stay.
	//
	// Not while jobs run in it: replacing the container would kill them.
	// The agent's sweep has still killed everything but the jobs, and new
	// sessions may well be theirs.
	if jobsLive || c.jobs.Load() > 0 {
		if res.TimedOut || res.OOMKilled {
			e.log.Info().Str("container", shortID(c.dockerID)).Bool("timed_out", res.TimedOut).Bool("oom_killed", res.OOMKilled).Msg("sandbox_kept_for_jobs")
		}
	} else if res.TimedOut || res.OOMKilled || e.hasStrays(c, sessionsBefore, res.Kernel) {
		s.retireLocked(r.Language, c, retireReason(res))
	}
	return res, nil
}

// retireReason says why a run's container is replaced.
func retireReason(res sandbox.ExecResult) string {
	switch {
	case res.TimedOut:
		return sandbox.LostTimeout
	case res.OOMKilled:
		return sandbox.LostOOM
	}
	return sandbox.LostStrays
}

// retireLocked removes the session's container c for lang in the
// background; the next Exec starts a new one. Caller holds s.mu.
func (s *Session) retireLocked(lang string, c *ctr, why string) {
	if s.ctrs[lang] == c {
		delete(s.ctrs, lang)
	}
	if lang == agent.LangPython {
		s.kernel.Lost(why)
	}
	s.e.removeAsync(c)
}

// containerLocked returns the session's container for r, starting or
// claiming one if there is none (or the one there was removed by a job's
// quota watcher). Caller holds s.mu.
func (s *Session) containerLocked(ctx context.Context, r runnerImage) (*ctr, error) {
	c := s.ctrs[r.Language]
	if c != nil && c.gone.Load() {
		delete(s.ctrs, r.Language)
		if r.Language == agent.LangPython {
			s.kernel.Lost(sandbox.LostStopped)
		}
		c = nil
	}
	if c == nil {
		var err error
		c, err = s.e.acquire(ctx, r, s.ref, len(s.ctrs) == 0, func() (int, error) { return s.uidLocked(ctx) })
		if err != nil {
			return nil, err
		}
		s.uid = c.uid
		s.ctrs[r.Language] = c
		c.used.Store(time.Now().UnixNano())
	}
	s.e.touchIdle(c)
	return c, nil
}

// touchIdle dates when c's session may let it go if unused, for the retry
// hint at the container cap: never while jobs run in it (they pin it).
func (e *Engine) touchIdle(c *ctr) {
	switch {
	case e.o.IdleTimeout <= 0:
	case c.jobs.Load() > 0:
		c.slot.IdleAt(time.Time{})
	default:
		c.slot.IdleAt(time.Now().Add(e.o.IdleTimeout))
	}
}

// uidLocked returns the session's uid, leasing it on first use. Caller
// holds s.mu.
func (s *Session) uidLocked(ctx context.Context) (int, error) {
	if s.uid == 0 {
		uid, err := s.e.o.UIDs.Lease(ctx, s.ref.WorkspaceID)
		if err != nil {
			return 0, err
		}
		s.uid = uid
	}
	return s.uid, nil
}

// dropLocked forgets c, whose agent is gone, and removes it in the
// background. Caller holds s.mu.
func (s *Session) dropLocked(c *ctr) {
	if s.ctrs[c.lang] == c {
		delete(s.ctrs, c.lang)
	}
	s.e.removeAsync(c)
}

// wasOOMKilled compares the cgroup v1 oom_kill counter with its value before
// the run, falling back to the container's State.OOMKilled.
func (e *Engine) wasOOMKilled(ctx context.Context, c *ctr, before int64) bool {
	if before >= 0 {
		if after := e.oomKills(c); after >= 0 {
			return after > before
		}
	}
	ins, err := e.cli.ContainerInspect(ctx, c.dockerID)
	return err == nil && ins.State != nil && ins.State.OOMKilled
}

// oomStopWait bounds the wait for a container whose agent was lost to stop.
const oomStopWait = 5 * time.Second

// lostToOOM reports whether c's agent was lost because the memory cgroup's
// OOM killer ended the container: under gVisor it kills the Sentry, so the
// whole sandbox goes, not just the run. The counter says so while the
// cgroup exists; once it is gone, the container's state does when it has
// stopped.
func (e *Engine) lostToOOM(ctx context.Context, c *ctr, before int64) bool {
	if before >= 0 {
		if after := e.oomKills(c); after >= 0 {
			return after > before
		}
	}
	wctx, cancel := context.WithTimeout(ctx, oomStopWait)
	defer cancel()
	okc, errc := e.cli.ContainerWait(wctx, c.dockerID, container.WaitConditionNotRunning)
	select {
	case <-okc:
	case <-errc:
	}
	return e.wasOOMKilled(ctx, c, -1)
}

// sessionsBefore returns the sessions in c before a run. Under gVisor it
// is the set the last check found (after the previous run, or when the
// container started), which saves a round trip to the sandbox per run.
func (e *Engine) sessionsBefore(c *ctr) map[int][]int {
	if e.o.Runtime != RuntimeRunsc {
		return e.sessions(c)
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
func (e *Engine) hasStrays(c *ctr, before map[int][]int, kernel *sandbox.KernelStatus) bool {
	var after map[int][]int
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
		after = e.sessions(c)
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

// openWorkspace opens the session's workspace, creating it on first use;
// what the broker writes there belongs to the session's uid. Caller holds
// s.mu.
func (s *Session) openWorkspace(ctx context.Context) (*workspace.Workspace, error) {
	uid, err := s.uidLocked(ctx)
	if err != nil {
		return nil, err
	}
	own := workspace.WithOwner(uid, uid)
	if _, err := os.Lstat(s.ref.Dir); errors.Is(err, fs.ErrNotExist) {
		return workspace.Create(s.ref.Dir, workspace.WithLimits(s.e.o.WorkspaceLimits), own)
	}
	return workspace.OpenOwned(s.ref.Dir, s.e.o.WorkspaceLimits, own)
}

// WorkspaceOwner is the option that gives what the broker writes into the
// session's workspace to the session's uid (for callers that write there
// themselves, such as project uploads).
func (s *Session) WorkspaceOwner(ctx context.Context) (workspace.Option, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	uid, err := s.uidLocked(ctx)
	if err != nil {
		return nil, err
	}
	return workspace.WithOwner(uid, uid), nil
}

// watchQuota removes c when the workspace grows past its quota while code
// runs in it (see workspace.WatchQuota).
func (s *Session) watchQuota(ctx context.Context, w *workspace.Workspace, c *ctr) func() bool {
	return w.WatchQuota(ctx, func(ctx context.Context) {
		s.e.log.Warn().Str("container", shortID(c.dockerID)).Msg("workspace_quota_exceeded")
		_ = s.e.removeContainer(ctx, c)
	})
}

// quotaExceeded removes what the run wrote, retires its container and
// reports QUOTA_EXCEEDED.
func (s *Session) quotaExceeded(w *workspace.Workspace, before map[string]workspace.FileStamp, lang string, c *ctr, dur time.Duration) (sandbox.ExecResult, error) {
	w.RemoveChanged(before)
	s.retireLocked(lang, c, sandbox.LostQuota)
	l := w.Limits()
	return sandbox.ExecResult{Duration: dur, ExitCode: -1}, brokererr.New(brokererr.QuotaExceeded,
		"the workspace exceeded its quota (%d files, %d MiB); the run was stopped and the files it wrote were removed", l.MaxFiles, l.MaxBytes>>20)
}

// WriteFile implements sandbox.Session on the host workspace directory.
func (s *Session) WriteFile(ctx context.Context, p string, data []byte, overwrite bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	w, err := s.openWorkspace(ctx)
	if err != nil {
		return err
	}
	defer w.Close()
	return w.Write(p, data, overwrite)
}

// PrepareWorkspace implements sandbox.Session.
func (s *Session) PrepareWorkspace(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	w, err := s.openWorkspace(ctx)
	if err != nil {
		return err
	}
	return w.Close()
}

// ReadFile implements sandbox.Session.
func (s *Session) ReadFile(ctx context.Context, p string, offset, max int64) (sandbox.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return sandbox.File{}, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	return workspace.ReadFile(s.ref.Dir, s.e.o.WorkspaceLimits, p, offset, max)
}

// ListFiles implements sandbox.Session: regular files under dir, recursively,
// sorted by path. Symlinks and special files are not listed.
func (s *Session) ListFiles(ctx context.Context, dir string) ([]sandbox.FileInfo, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	return workspace.ListFiles(s.ref.Dir, s.e.o.WorkspaceLimits, dir)
}

// removeAll removes every container of the session and waits.
func (s *Session) removeAll(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make([]error, 0, len(s.ctrs))
	var mu sync.Mutex
	for l, c := range s.ctrs {
		delete(s.ctrs, l)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.e.removeContainer(ctx, c); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Release implements sandbox.Session: containers go, files stay. The
// session stays usable; the next Exec starts new containers.
//
// While any job runs in one of the session's containers, Release refuses
// with CONFLICT and removes nothing: the jobs own the compute until they
// end or are cancelled (the sessions reaper pins such sessions anyway).
// Destroy does kill them.
func (s *Session) Release(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.ctrs {
		n += int(c.jobs.Load())
	}
	if n > 0 {
		return brokererr.New(brokererr.Conflict, "%d executions are still running in this sandbox; cancel them first", n)
	}
	if err := s.removeAll(ctx); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "cannot remove the sandbox containers")
	}
	s.kernel.Lost(sandbox.LostIdle)
	return nil
}

// Destroy implements sandbox.Session: containers and files go.
func (s *Session) Destroy(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.removeAll(ctx); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "cannot remove the sandbox containers")
	}
	// Destroyed only once the containers are gone, so a failed attempt
	// leaves a session that can still be used or destroyed again.
	s.destroyed = true
	s.e.kernels.Forget(s.ref.WorkspaceID)
	if err := os.RemoveAll(s.ref.Dir); err != nil {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot delete the workspace")
	}
	// Nothing runs as the uid and none of its files is left.
	if err := s.e.o.UIDs.Free(ctx, s.ref.WorkspaceID); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "cannot release the sandbox uid")
	}
	return nil
}
