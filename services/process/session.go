package process

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Session is one session's sandboxes: one bwrap sandbox per runner (per
// language with runner file systems, one for all on the host's /usr),
// each started on first use and restarted when it died or was retired.
// It implements sandbox.Session and sandbox.JobRunner.
type Session struct {
	workspace.Files // WriteFile, ReadFile, ListFiles
	b               *Backend
	ref             sandbox.SessionRef
	uid, gid        int // host ids of its sandboxes (see Backend.sessionIDs)

	// runMu serialises Exec (the agent runs one request at a time); a
	// run's stray check ends after its answer (see Exec).
	runMu sandbox.RunLock

	mu        sync.Mutex // guards sbs and destroyed
	sbs       map[*runner]*sbx
	destroyed bool

	kernel *sandbox.KernelLedger // the notebook kernel in its python sandbox
}

var (
	_ sandbox.Session   = (*Session)(nil)
	_ sandbox.JobRunner = (*Session)(nil)
)

// Open implements sandbox.Backend. Nothing starts until Exec or StartJob.
func (b *Backend) Open(ctx context.Context, ref sandbox.SessionRef) (sandbox.Session, error) {
	if err := sandbox.CheckRef(ref); err != nil {
		return nil, err
	}
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return nil, brokererr.New(brokererr.Unavailable, "the process sandbox backend is shut down")
	}
	s := &Session{b: b, ref: ref, sbs: map[*runner]*sbx{}, kernel: b.kernels.Get(ref.WorkspaceID)}
	var err error
	if s.uid, s.gid, err = b.sessionIDs(ctx, ref.WorkspaceID); err != nil {
		return nil, err
	}
	s.Files = workspace.Files{Backend: b.Name(), Dir: ref.Dir, Limits: b.o.WorkspaceLimits, Hold: s.hold,
		Owner: func(context.Context) (int, int, error) { return s.uid, s.gid, nil }}
	return s, nil
}

// sandbox returns the session's running sandbox of r, starting one if
// there is none or the last one died.
func (s *Session) sandbox(ctx context.Context, r *runner) (*sbx, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	old := s.sbs[r]
	if old != nil && old.alive() {
		return old, nil
	}
	if old != nil {
		s.b.log.Info().Str("sandbox", old.id).Msg("sandbox_died_restarting")
		s.lostKernel(old, sandbox.LostStopped)
		_ = s.b.stop(ctx, old)
		delete(s.sbs, r)
	}
	w, err := s.OpenWorkspace(ctx)
	if err != nil {
		return nil, err
	}
	_ = w.Close()
	sb, err := s.b.start(ctx, r, s.ref.Dir, s.uid, s.gid)
	if err != nil {
		return nil, err
	}
	s.sbs[r] = sb
	return sb, nil
}

// lostKernel notes why the notebook kernel went when sb, the sandbox that
// runs python (and so the kernel), goes.
func (s *Session) lostKernel(sb *sbx, why string) {
	if sb.r.lang == agent.LangPython {
		s.kernel.Lost(why)
	}
}

// retire stops sb and forgets it if it is still the session's sandbox;
// why says what that did to a notebook kernel in it.
func (s *Session) retire(sb *sbx, why string) {
	s.mu.Lock()
	if s.sbs[sb.r] == sb {
		delete(s.sbs, sb.r)
		s.lostKernel(sb, why)
	}
	s.mu.Unlock()
	s.b.bg.Add(1)
	go func() {
		defer s.b.bg.Done()
		if err := s.b.stop(context.Background(), sb); err != nil {
			s.b.log.Warn().Err(err).Str("sandbox", sb.id).Msg("sandbox_stop_failed")
		}
	}()
}

// Exec runs code through the session's agent.
func (s *Session) Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	r, err := s.b.runnerFor(req.Language)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	s.runMu.Lock()
	defer s.runMu.Unlock()
	sb, err := s.sandbox(ctx, r)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	timeout := req.Timeout
	if timeout <= 0 {
		timeout = defaultExecTimeout
	}
	timeout = min(timeout, agent.MaxTimeoutMS*time.Millisecond)
	w, err := s.OpenWorkspace(ctx)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	defer w.Close()
	before, err := w.Snapshot()
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	oomBefore := sb.cg.oomKills()
	sessionsBefore := sb.sessionsBefore()
	rctx, cancel := context.WithTimeout(ctx, timeout+hardStopMargin)
	stopWatch := w.WatchQuota(rctx, func(kctx context.Context) {
		s.b.log.Warn().Str("sandbox", sb.id).Msg("workspace_quota_exceeded")
		_ = s.b.stop(kctx, sb)
	})
	start := time.Now()
	resp, err := sb.run(rctx, agent.Request{
		Language:       req.Language,
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
		return s.quotaExceeded(w, before, sb, dur)
	}
	if err != nil {
		// The agent is gone, hung or the caller gave up: the sandbox's
		// state is unknown, so it goes; the next Exec starts a new one.
		s.retire(sb, sandbox.LostUnresponsive)
		switch {
		case hardStop:
			s.b.log.Warn().Str("sandbox", sb.id).Dur("timeout", timeout).Msg("sandbox_missed_deadline_killed")
			return sandbox.ExecResult{TimedOut: true, Duration: dur, ExitCode: -1, Signal: "SIGKILL"},
				brokererr.New(brokererr.SandboxTimeout, "the code did not finish within %s and the sandbox was killed", timeout)
		case ctx.Err() != nil:
			return sandbox.ExecResult{Duration: dur}, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "the call was cancelled")
		}
		s.b.log.Warn().Err(err).Str("sandbox", sb.id).Msg("sandbox_agent_unreachable")
		return sandbox.ExecResult{Duration: dur}, brokererr.Wrap(err, brokererr.Unavailable, "the sandbox stopped responding; it will be restarted on the next call")
	}
	sb.used.Store(time.Now().UnixNano())
	if resp.Cold {
		s.b.warmAsync(sb) // released when idle, or still warming up
	}
	res, err := agent.ExecResult(resp, dur)
	if err != nil {
		return res, err
	}
	res.Changed = w.ChangedFiles(before)
	if !res.TimedOut && (resp.Signal == "SIGKILL" || resp.ExitCode == 137) && oomBefore >= 0 {
		res.OOMKilled = sb.cg.oomKills() > oomBefore
	}
	s.kernel.Observe(&res)
	// A run that timed out, hit the OOM killer or left processes behind
	// may have left the sandbox in a bad state: the next run gets a fresh
	// one. Files in the workspace stay.
	switch {
	case res.TimedOut:
		s.retire(sb, sandbox.LostTimeout)
	case res.OOMKilled:
		s.retire(sb, sandbox.LostOOM)
	case !sb.alive():
		s.retire(sb, sandbox.LostStopped)
	default:
		// Checked once the answer is on its way, before the next run.
		started := res.Kernel.StartedLive()
		s.runMu.AfterUnlock(func() bool { return s.hasStrays(sb, sessionsBefore, started) }, func(panicked any) {
			if panicked != nil {
				s.b.log.Error().Str("sandbox", sb.id).Str("panic", fmt.Sprint(panicked)).Msg("sandbox_stray_check_failed")
			}
			s.retire(sb, sandbox.LostStrays)
		})
	}
	return res, nil
}

// hasStrays reports processes a run left, read from the host's /proc
// rather than from the (untrusted) agent (see agent.Strays), and keeps
// track of the sandbox's notebook kernel session (kernelStarted: the run
// started one that lives on). Live jobs are not strays (a job started
// during the run would be; the sandbox is then replaced). Caller holds
// runMu.
func (s *Session) hasStrays(sb *sbx, before map[int][]int, kernelStarted bool) bool {
	if before == nil {
		return false
	}
	after := sb.sessions()
	sb.known.Record(after)
	stray, sid := agent.Strays(before, after, sb.kernelSID, kernelStarted)
	sb.kernelSID = sid
	if stray {
		s.b.log.Info().Str("sandbox", sb.id).Msg("sandbox_strays_found")
	}
	return stray
}

// quotaExceeded removes what the run wrote, retires the sandbox and
// reports QUOTA_EXCEEDED.
func (s *Session) quotaExceeded(w *workspace.Workspace, before map[string]workspace.FileStamp, sb *sbx, dur time.Duration) (sandbox.ExecResult, error) {
	s.retire(sb, sandbox.LostQuota)
	return sandbox.ExecResult{Duration: dur, ExitCode: -1}, w.RemoveRun(before)
}

// hold is Files.Hold: file calls need only a session not yet destroyed.
func (s *Session) hold() (func(), error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	return func() {}, nil
}

// stopLocked stops the session's sandboxes, waiting. Caller holds s.mu.
func (s *Session) stopLocked(ctx context.Context) error {
	for r, sb := range s.sbs {
		if err := s.b.stop(ctx, sb); err != nil {
			return brokererr.Wrap(err, brokererr.Unavailable, "cannot stop the sandbox")
		}
		delete(s.sbs, r)
	}
	return nil
}

// Release implements sandbox.Session: the sandbox's processes (jobs
// included) are killed, files stay; the next Exec starts a new sandbox.
func (s *Session) Release(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.kernel.Lost(sandbox.LostIdle)
	return s.stopLocked(ctx)
}

// Destroy implements sandbox.Session: processes and files go.
func (s *Session) Destroy(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.stopLocked(ctx); err != nil {
		return err
	}
	s.destroyed = true
	s.b.kernels.Forget(s.ref.WorkspaceID)
	if err := os.RemoveAll(s.ref.Dir); err != nil {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot delete the workspace")
	}
	if s.b.ids != nil {
		// Nothing runs as the uid and none of its files is left.
		if err := s.b.ids.Free(ctx, s.ref.WorkspaceID); err != nil {
			return brokererr.Wrap(err, brokererr.Unavailable, "cannot release the sandbox uid")
		}
	}
	return nil
}
