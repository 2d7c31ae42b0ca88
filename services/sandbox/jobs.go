package sandbox

import (
	"context"
	"fmt"
	"net"
	"slices"
	"syscall"
	"time"
)

// JobSpec is one shell command run as a long-lived job. Every field is
// validated by the caller before it reaches a backend.
type JobSpec struct {
	// ID is the broker's execution ID (32 hex), for names and logs.
	ID string
	// Command runs with `bash -c` as the sandbox user.
	Command string
	// Language picks the runner image on backends that have several
	// ("" takes the backend's default, which has bash and python).
	Language string
	// WorkDir is workspace-relative ("" is the workspace root).
	WorkDir string
	// Env is added to the sandbox's base environment.
	Env map[string]string
	// Timeout ends the job (whole process tree) when it elapses.
	Timeout time.Duration
	// Interactive keeps stdin open as a pipe; otherwise stdin is /dev/null.
	Interactive bool
	// Egress, when set, gives the job a network path: the backend creates a
	// Unix socket listener the sandbox can reach, calls Egress with it (the
	// callee serves a proxy on it until it is closed), points the job's
	// HTTP_PROXY/HTTPS_PROXY/ALL_PROXY at a loopback port inside the
	// sandbox that forwards to that socket, and closes the listener when
	// the job ends. The sandbox itself keeps no network interface.
	Egress func(net.Listener)
}

// EnvList is the job's Env as sorted NAME=value pairs, as the agent takes
// them.
func (s JobSpec) EnvList() []string {
	env := make([]string, 0, len(s.Env))
	for k, v := range s.Env {
		env = append(env, k+"="+v)
	}
	slices.Sort(env)
	return env
}

// Output stream names a JobSink receives.
const (
	StreamStdout = "stdout"
	StreamStderr = "stderr"
)

// JobSink receives a job's output as it arrives. Calls are serialised; data
// is only valid during the call.
type JobSink func(stream string, data []byte)

// JobExit is how a job ended.
type JobExit struct {
	ExitCode int
	Signal   string // "SIGTERM", "SIGKILL", … when killed by a signal
	TimedOut bool
	Duration time.Duration
	// Err is set when the job's end could not be observed (agent lost).
	Err error
}

// PartialStdinError is WriteStdin's error when ctx ended after part of the
// data got through: Written bytes are in the job's stdin, Queued more reach
// it when the job reads, and the rest was not sent. Sending the same data
// again would repeat that part.
type PartialStdinError struct {
	Written, Queued, Total int
	Err                    error
}

func (e *PartialStdinError) Error() string {
	return fmt.Sprintf("stdin: %d of %d bytes written, %d queued: %v", e.Written, e.Total, e.Queued, e.Err)
}

func (e *PartialStdinError) Unwrap() error { return e.Err }

// Job is a started job.
type Job interface {
	// WriteStdin sends data to the job's stdin (interactive jobs only).
	// When ctx ends after part of data got through, the error is a
	// *PartialStdinError.
	WriteStdin(ctx context.Context, data []byte) error
	// CloseStdin closes the job's stdin.
	CloseStdin(ctx context.Context) error
	// Signal sends sig to the job's whole process group.
	Signal(ctx context.Context, sig syscall.Signal) error
	// Done is closed once the job has ended and all its output was delivered.
	Done() <-chan struct{}
	// Exit is the job's outcome; valid once Done is closed.
	Exit() JobExit
}

// JobRunner is implemented by sessions that can run jobs. Jobs run beside
// run_code: finishing a run_code call must not kill a live job.
type JobRunner interface {
	StartJob(ctx context.Context, spec JobSpec, sink JobSink) (Job, error)
}
