package kube

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Session is one session's sandbox: a pod per language, started on the
// first Exec (or job) of that language. It implements sandbox.Session;
// the file methods work on the broker's copy, which is synced with the
// pods around every run and job, and before every file call while a job
// may be writing.
type Session struct {
	workspace.Files
	b   *Backend
	ref sandbox.SessionRef

	mu        sync.Mutex
	pods      map[string]*pod
	destroyed bool

	kernel *sandbox.KernelLedger
}

var (
	_ sandbox.Session   = (*Session)(nil)
	_ sandbox.Describer = (*Session)(nil)
)

// Open implements sandbox.Backend. No pod starts until Exec.
func (b *Backend) Open(ctx context.Context, ref sandbox.SessionRef) (sandbox.Session, error) {
	if err := sandbox.CheckRef(ref); err != nil {
		return nil, err
	}
	if b.isClosed() {
		return nil, closedErr()
	}
	s := &Session{b: b, ref: ref, pods: map[string]*pod{}, kernel: b.kernels.Get(ref.WorkspaceID)}
	s.Files = workspace.Files{Backend: b.Name(), Dir: ref.Dir, Limits: b.o.WorkspaceLimits, Hold: s.hold,
		// The broker's copy is the broker's own: pods hold theirs.
		Owner: func(context.Context) (int, int, error) { return os.Geteuid(), os.Getegid(), nil }}
	return s, nil
}

// hold is Files.Hold: file calls take the session lock, so they never
// overlap a run; while a job may be writing in a pod, its files are
// synced first.
func (s *Session) hold() (func(), error) {
	s.mu.Lock()
	if s.destroyed {
		s.mu.Unlock()
		return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	for _, p := range s.pods {
		if p.jobs.Load() > 0 {
			s.syncQuietly(p)
		}
	}
	return s.mu.Unlock, nil
}

// syncQuietly syncs p, logging what fails (a file call still serves the
// broker's copy). Caller holds s.mu.
func (s *Session) syncQuietly(p *pod) {
	ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
	defer cancel()
	w, err := s.OpenWorkspace(ctx)
	if err == nil {
		err = s.syncLocked(ctx, w, p)
		w.Close()
	}
	if err != nil {
		s.b.log.Warn().Err(err).Str("pod", p.name).Msg("workspace_sync_failed")
	}
}

// Compute implements sandbox.Describer.
func (s *Session) Compute() []sandbox.Compute {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]sandbox.Compute, 0, len(s.pods))
	for lang, p := range s.pods {
		out = append(out, sandbox.Compute{Kind: "pod", ID: p.name, Language: lang})
	}
	return out
}

// Exec implements sandbox.Session.
func (s *Session) Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if _, err := s.b.image(req.Language); err != nil {
		return sandbox.ExecResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return sandbox.ExecResult{}, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	for attempt := 0; ; attempt++ {
		res, err := s.execLocked(ctx, req)
		// Nothing ran when the agent was not reached: once more, on a new
		// pod (the old one is gone, evicted say, and already dropped).
		if attempt == 0 && ctx.Err() == nil && unreachable(err) {
			continue
		}
		if unreachable(err) {
			err = brokererr.Wrap(err, brokererr.Unavailable, "the %s sandbox pod could not be reached; nothing ran", req.Language)
		}
		return res, err
	}
}

// execLocked runs req once. Caller holds s.mu.
func (s *Session) execLocked(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	p, err := s.podLocked(ctx, req.Language)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	w, err := s.OpenWorkspace(ctx)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	defer w.Close()
	if err := s.syncLocked(ctx, w, p); err != nil {
		return sandbox.ExecResult{}, s.syncFailed(p, err)
	}
	before, err := w.Snapshot()
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	timeout := req.Timeout
	if timeout <= 0 {
		timeout = defaultExecTimeout
	}
	timeout = min(timeout, agent.MaxTimeoutMS*time.Millisecond)
	jobsLive := p.jobs.Load() > 0
	rctx, cancel := context.WithTimeout(ctx, timeout+hardStopMargin)
	start := time.Now()
	resp, err := agent.RunVia(rctx, func(ctx context.Context) (net.Conn, error) { return agentConn(p.client.Dial(ctx)) }, agent.Request{
		Language:       req.Language,
		Code:           req.Code,
		TimeoutMS:      max(timeout.Milliseconds(), 1),
		MaxOutputBytes: req.MaxOutputBytes,
		Mode:           req.Mode,
	})
	hardStop := rctx.Err() != nil && ctx.Err() == nil
	cancel()
	dur := time.Since(start)
	if err != nil {
		return sandbox.ExecResult{Duration: dur}, s.runLost(ctx, p, err, hardStop, timeout)
	}
	res, err := agent.ExecResult(resp, dur)
	if err != nil {
		return res, err
	}
	if err := s.syncLocked(ctx, w, p); err != nil {
		if isQuota(err) {
			// Nothing was pulled: the broker's copy is as before the run;
			// the pod and what the run wrote go.
			s.retireLocked(p, sandbox.LostQuota)
			return sandbox.ExecResult{Duration: dur, ExitCode: -1}, err
		}
		return res, s.syncFailed(p, err)
	}
	res.Changed = w.ChangedFiles(before)
	s.kernel.Observe(&res)
	// A run that timed out may have left the pod in a bad state: the next
	// run gets a new one (not while jobs run in it).
	if res.TimedOut && !jobsLive && p.jobs.Load() == 0 {
		s.retireLocked(p, sandbox.LostTimeout)
	}
	return res, nil
}

// agentConn wraps a run's connection to the agent: tests see when the
// request has gone out.
var agentConn = func(c net.Conn, err error) (net.Conn, error) { return c, err }

// runLost maps a run whose agent connection failed: the pod goes, and the
// API says why when it can (evicted, out of memory, deleted).
func (s *Session) runLost(ctx context.Context, p *pod, err error, hardStop bool, timeout time.Duration) error {
	if unreachable(err) {
		s.retireLocked(p, sandbox.LostUnresponsive)
		return err // Exec retries on a new pod: nothing ran
	}
	f := s.b.podFate(ctx, p)
	s.retireLocked(p, sandbox.LostUnresponsive)
	s.b.log.Warn().Err(err).Str("pod", p.name).Str("fate", f.why).Msg("sandbox_agent_lost")
	switch {
	case f.overQuota:
		return quotaError(s.b.o.WorkspaceLimits)
	case f.oom:
		return brokererr.New(brokererr.Unavailable, "the %s sandbox pod ran out of memory and was killed; the run did not finish, and what it wrote since it began is lost", p.lang).NotRetryable()
	case f.evicted || f.deleted:
		return brokererr.Wrap(err, brokererr.Unavailable, "the %s sandbox pod went away during the run (%s); the run did not finish, and what it wrote since it began is lost; the next call starts a new pod", p.lang, f.why)
	case hardStop:
		return brokererr.New(brokererr.SandboxTimeout, "the code did not finish within %s and the sandbox pod was deleted", timeout)
	case ctx.Err() != nil:
		return brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "the call was cancelled")
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "the %s sandbox pod stopped responding; it will be replaced on the next call", p.lang)
}

// syncFailed retires p after a failed sync and returns the error to give:
// the quota as is, an unreachable agent as is (Exec retries), anything
// else as UNAVAILABLE.
func (s *Session) syncFailed(p *pod, err error) error {
	if isQuota(err) || unreachable(err) {
		s.retireLocked(p, sandbox.LostUnresponsive)
		return err
	}
	s.retireLocked(p, sandbox.LostUnresponsive)
	s.b.log.Warn().Err(err).Str("pod", p.name).Msg("workspace_sync_failed")
	if brokererr.As(err) != nil {
		return err
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "cannot sync the workspace with the sandbox pod; it will be replaced on the next call")
}

// podLocked returns the session's pod for lang, starting one if there is
// none. Caller holds s.mu.
func (s *Session) podLocked(ctx context.Context, lang string) (*pod, error) {
	if p := s.pods[lang]; p != nil && !p.gone.Load() {
		return p, nil
	}
	delete(s.pods, lang)
	p, err := s.b.startPod(ctx, s.ref.WorkspaceID, lang)
	if err != nil {
		return nil, err
	}
	s.pods[lang] = p
	return p, nil
}

// retireLocked drops p and deletes it in the background. Caller holds
// s.mu.
func (s *Session) retireLocked(p *pod, why string) {
	if s.pods[p.lang] == p {
		delete(s.pods, p.lang)
	}
	if p.lang == agent.LangPython {
		s.kernel.Lost(why)
	}
	s.b.releaseAsync(p)
}

// Release implements sandbox.Session: pods go, files stay (they were
// synced after the last run). It refuses while jobs run.
func (s *Session) Release(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.pods {
		n += int(p.jobs.Load())
	}
	if n > 0 {
		return brokererr.New(brokererr.Conflict, "%d executions are still running in this sandbox; cancel them first", n)
	}
	if err := s.removeAllLocked(ctx); err != nil {
		return err
	}
	s.kernel.Lost(sandbox.LostIdle)
	return nil
}

// removeAllLocked deletes every pod of the session. Caller holds s.mu.
func (s *Session) removeAllLocked(ctx context.Context) error {
	var errs []error
	for lang, p := range s.pods {
		if err := s.b.release(ctx, p); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(s.pods, lang)
	}
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// Destroy implements sandbox.Session: pods and files go.
func (s *Session) Destroy(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.removeAllLocked(ctx); err != nil {
		return err
	}
	s.destroyed = true
	s.b.kernels.Forget(s.ref.WorkspaceID)
	if err := os.RemoveAll(s.ref.Dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot delete the workspace")
	}
	return nil
}
