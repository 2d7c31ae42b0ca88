package docker

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
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
	workspace.Files // WriteFile, ReadFile, ListFiles
	e               *Engine
	ref             sandbox.SessionRef

	mu        sandbox.RunLock // a run's stray check ends after its answer (see execLocked)
	ctrs      map[string]*ctr
	uid       int // host uid (and gid) of its containers; 0 until leased
	destroyed bool

	kernel *sandbox.KernelLedger // the notebook kernel in its python container
}

var _ sandbox.Session = (*Session)(nil)

// Open implements sandbox.Backend. No container is started until Exec.
func (e *Engine) Open(ctx context.Context, ref sandbox.SessionRef) (sandbox.Session, error) {
	if err := sandbox.CheckRef(ref); err != nil {
		return nil, err
	}
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return nil, brokererr.New(brokererr.Unavailable, "the Docker engine is shut down")
	}
	s := &Session{e: e, ref: ref, ctrs: map[string]*ctr{}, kernel: e.kernels.Get(ref.WorkspaceID)}
	s.Files = workspace.Files{Backend: e.Name(), Dir: ref.Dir, Limits: e.o.WorkspaceLimits, Hold: s.hold,
		Owner: func(ctx context.Context) (int, int, error) {
			uid, err := s.uidLocked(ctx)
			return uid, uid, err
		}}
	return s, nil
}

// hold is Files.Hold: file calls take the session lock, so they never
// overlap a run (whose changed files are what it wrote).
func (s *Session) hold() (func(), error) {
	s.mu.Lock()
	if s.destroyed {
		s.mu.Unlock()
		return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	return s.mu.Unlock, nil
}

// Exec runs code in the session's container for req.Language.
func (s *Session) Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	e := s.e
	if slices.Contains(e.o.JobLanguages, req.Language) {
		return sandbox.ExecResult{}, brokererr.New(brokererr.UnknownLanguage, "the %s runner runs only executions, not code", req.Language)
	}
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
	w, err := s.OpenWorkspace(ctx)
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
		if !hardStop && ctx.Err() == nil && e.lostToOOM(ctx, c, oomBefore) {
			s.retireLocked(r.Language, c, sandbox.LostOOM)
			e.log.Info().Str("container", shortID(c.dockerID)).Msg("sandbox_oom_killed")
			res := sandbox.ExecResult{Duration: dur, ExitCode: 137, Signal: "SIGKILL", OOMKilled: true}
			if req.Mode == sandbox.ModeNotebook {
				// The kernel went with the sandbox (gVisor's OOM kill ends
				// the Sentry).
				res.Kernel = &sandbox.KernelStatus{Ended: sandbox.LostOOM}
				s.kernel.Observe(&res)
			}
			return res, nil
		}
		s.retireLocked(r.Language, c, sandbox.LostUnresponsive)
		switch {
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
	} else if res.TimedOut || res.OOMKilled {
		s.retireLocked(r.Language, c, retireReason(res))
	} else {
		// Checked once the answer is on its way, before anything else
		// takes the session's lock.
		started := res.Kernel.StartedLive()
		s.mu.AfterUnlock(func() bool { return e.hasStrays(c, sessionsBefore, started) }, func(panicked any) {
			if panicked != nil {
				e.log.Error().Str("container", shortID(c.dockerID)).Str("panic", fmt.Sprint(panicked)).Msg("sandbox_stray_check_failed")
			}
			s.retireLocked(r.Language, c, sandbox.LostStrays)
		})
	}
	return res, nil
}

// retireReason says why the container of a run that timed out or hit the
// OOM killer is replaced (strays are the stray check's, see execLocked).
func retireReason(res sandbox.ExecResult) string {
	if res.TimedOut {
		return sandbox.LostTimeout
	}
	return sandbox.LostOOM
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
	err := w.RemoveRun(before)
	s.retireLocked(lang, c, sandbox.LostQuota)
	return sandbox.ExecResult{Duration: dur, ExitCode: -1}, err
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
