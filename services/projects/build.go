package projects

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// BuildCommand is what a build runs, as executions list it.
const BuildCommand = "npm run build"

// JobBuilder is implemented by sandboxes whose build runs as a job of
// their own: its output streams as it comes and a signal stops it. id is
// the execution's ID, for the sandbox's names and logs.
type JobBuilder interface {
	StartBuild(ctx context.Context, id string, sink sandbox.JobSink) (sandbox.Job, error)
}

// BuildRunner runs one sandbox's build as a tracked execution: it is the
// sandbox.JobRunner the jobs manager starts, so a build that outlasts the
// caller's wait goes on and can be polled, cancelled and listed like any
// execution. It keeps the tail of the build's output for the result.
type BuildRunner struct {
	sb   Sandbox
	keep int

	mu   sync.Mutex
	tail []byte
}

var _ sandbox.JobRunner = (*BuildRunner)(nil)

// NewBuildRunner runs sb's build, keeping the last keep bytes of output.
func NewBuildRunner(sb Sandbox, keep int) *BuildRunner {
	return &BuildRunner{sb: sb, keep: keep}
}

// Output is the tail of what the build printed so far.
func (r *BuildRunner) Output() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]byte(nil), r.tail...)
}

func (r *BuildRunner) record(data []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.tail = append(r.tail, data...)
	if over := len(r.tail) - r.keep; over > 0 {
		r.tail = append(r.tail[:0], r.tail[over:]...)
	}
}

// StartJob implements sandbox.JobRunner. spec only lends its ID: the
// build's command, timeout and limits are the provider's. A sandbox that
// is no JobBuilder runs Build in the background, its output delivered
// when it ends.
func (r *BuildRunner) StartJob(ctx context.Context, spec sandbox.JobSpec, sink sandbox.JobSink) (sandbox.Job, error) {
	tee := func(stream string, data []byte) {
		r.record(data)
		sink(stream, data)
	}
	if jb, ok := r.sb.(JobBuilder); ok {
		return jb.StartBuild(ctx, spec.ID, tee)
	}
	// The build outlives the call that started it, bounded like any build.
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), CommandTimeout+time.Minute)
	j := &backgroundBuild{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(j.done)
		defer cancel()
		start := time.Now()
		out, code, err := r.sb.Build(bctx)
		if len(out) > 0 {
			tee(sandbox.StreamStdout, out)
		}
		x := sandbox.JobExit{ExitCode: code, Duration: time.Since(start)}
		switch {
		case j.signalled() != "":
			x.Signal = j.signalled()
		case errors.Is(bctx.Err(), context.DeadlineExceeded), brokererr.CodeOf(err) == brokererr.SandboxTimeout:
			x.TimedOut = true
		case err != nil:
			x.Err = err
		}
		j.exit = x
	}()
	return j, nil
}

// backgroundBuild is a Build running in a goroutine, as a sandbox.Job.
type backgroundBuild struct {
	cancel context.CancelFunc
	done   chan struct{}
	exit   sandbox.JobExit // set before done closes

	mu  sync.Mutex
	sig string
}

func (j *backgroundBuild) signalled() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.sig
}

func (j *backgroundBuild) WriteStdin(context.Context, []byte) error {
	return brokererr.New(brokererr.Conflict, "a build takes no input")
}

func (j *backgroundBuild) CloseStdin(context.Context) error { return nil }

// Signal stops the build: any signal cancels its call to the provider.
func (j *backgroundBuild) Signal(_ context.Context, sig syscall.Signal) error {
	j.mu.Lock()
	if j.sig == "" {
		j.sig = signalName(sig)
	}
	j.mu.Unlock()
	j.cancel()
	return nil
}

func (j *backgroundBuild) Done() <-chan struct{} { return j.done }
func (j *backgroundBuild) Exit() sandbox.JobExit { return j.exit }

func signalName(sig syscall.Signal) string {
	if sig == syscall.SIGKILL {
		return "SIGKILL"
	}
	return "SIGTERM" // the only other signal executions are sent
}
