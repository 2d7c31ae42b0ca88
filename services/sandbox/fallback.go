package sandbox

import (
	"context"
	"errors"
	"sync"
)

// NotStarted marks err as a failure that came before any of a call's work
// reached the sandbox (the engine could not be reached, no sandbox could
// be made): running the call elsewhere cannot run it twice. Fallback
// retries only such calls.
func NotStarted(err error) error {
	if err == nil || IsNotStarted(err) {
		return err
	}
	return &notStartedError{err}
}

// IsNotStarted reports whether err was marked by NotStarted.
func IsNotStarted(err error) bool {
	var e *notStartedError
	return errors.As(err, &e)
}

type notStartedError struct{ err error }

func (e *notStartedError) Error() string { return e.err.Error() }
func (e *notStartedError) Unwrap() error { return e.err }

// BackendReporter is implemented by jobs that say which backend runs them.
type BackendReporter interface {
	Backend() string
}

// Fallback runs sessions on Primary and runs a call on Secondary instead
// when Primary could not start it (NotStarted). Both must keep a session's
// files in its host workspace (SessionRef.Dir), so a call that falls back
// sees the same files. The operator opts in (SANDBOX_FALLBACK).
type Fallback struct {
	Primary, Secondary Backend
	// OnFallback is told of each call that fell back, with Primary's error.
	OnFallback func(ref SessionRef, err error)
}

var _ Backend = (*Fallback)(nil)

// Name is Primary's: tools report Secondary's name on the calls it ran.
func (f *Fallback) Name() string { return f.Primary.Name() }

// Runners are Primary's: the languages calls may name.
func (f *Fallback) Runners(ctx context.Context) ([]Runner, error) { return f.Primary.Runners(ctx) }

// Open opens the session on Primary; Secondary's is opened on first use.
func (f *Fallback) Open(ctx context.Context, ref SessionRef) (Session, error) {
	s, err := f.Primary.Open(ctx, ref)
	if err != nil {
		return nil, err
	}
	return &fallbackSession{f: f, ref: ref, Session: s}, nil
}

// Close closes both.
func (f *Fallback) Close(ctx context.Context) error {
	return errors.Join(f.Primary.Close(ctx), f.Secondary.Close(ctx))
}

// Ping succeeds while either backend can serve.
func (f *Fallback) Ping(ctx context.Context) error {
	err := f.Primary.Ping(ctx)
	if err == nil || f.Secondary.Ping(ctx) == nil {
		return nil
	}
	return err
}

// fallbackSession is Primary's session; file calls go to it (they work on
// the host workspace), runs and jobs fall back.
type fallbackSession struct {
	Session
	f   *Fallback
	ref SessionRef

	mu        sync.Mutex
	secondary Session
}

func (s *fallbackSession) second(ctx context.Context, cause error) (Session, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f.OnFallback != nil {
		s.f.OnFallback(s.ref, cause)
	}
	if s.secondary == nil {
		sec, err := s.f.Secondary.Open(ctx, s.ref)
		if err != nil {
			return nil, errors.Join(cause, err)
		}
		s.secondary = sec
	}
	return s.secondary, nil
}

func (s *fallbackSession) opened() Session {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.secondary
}

func (s *fallbackSession) Exec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	res, err := s.Session.Exec(ctx, req)
	if !IsNotStarted(err) {
		return res, err
	}
	sec, serr := s.second(ctx, err)
	if serr != nil {
		return res, err
	}
	res, err = sec.Exec(ctx, req)
	if res.Backend == "" {
		res.Backend = s.f.Secondary.Name()
	}
	return res, err
}

// StartJob implements JobRunner when Primary's session does.
func (s *fallbackSession) StartJob(ctx context.Context, spec JobSpec, sink JobSink) (Job, error) {
	r, ok := s.Session.(JobRunner)
	if !ok {
		return nil, errors.New("sandbox: the primary backend cannot run jobs")
	}
	j, err := r.StartJob(ctx, spec, sink)
	if !IsNotStarted(err) {
		return j, err
	}
	sec, serr := s.second(ctx, err)
	if serr != nil {
		return nil, err
	}
	sr, ok := sec.(JobRunner)
	if !ok {
		return nil, err
	}
	j, err = sr.StartJob(ctx, spec, sink)
	if err != nil {
		return nil, err
	}
	return namedJob{Job: j, name: s.f.Secondary.Name()}, nil
}

type namedJob struct {
	Job
	name string
}

func (j namedJob) Backend() string { return j.name }

// Release releases both sessions' compute.
func (s *fallbackSession) Release(ctx context.Context) error {
	var err error
	if sec := s.opened(); sec != nil {
		err = sec.Release(ctx)
	}
	return errors.Join(err, s.Session.Release(ctx))
}

// Destroy destroys Secondary's session first (its containers hold the
// workspace), then Primary's.
func (s *fallbackSession) Destroy(ctx context.Context) error {
	if sec := s.opened(); sec != nil {
		if err := sec.Destroy(ctx); err != nil {
			return err
		}
	}
	return s.Session.Destroy(ctx)
}
