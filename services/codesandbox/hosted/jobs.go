package hosted

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"path"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

const (
	// jobStartWait bounds how long StartJob waits for the helper to say
	// the command started.
	jobStartWait = 60 * time.Second
	// stdinChunk is the data one shell/in carries (base64 grows it by 4/3).
	stdinChunk = 3 << 10
	// wrapUp bounds the copy-back after a job.
	wrapUp = 2 * time.Minute
)

// errJobEnded is returned by commands to a job that has ended.
var errJobEnded = errors.New("the job has ended")

type frame struct {
	kind byte
	data []byte
}

// job is a command started by StartJob: its helper streams frames on the
// terminal (helper.py), and stdin, close and signals go back as lines
// typed into it.
type job struct {
	s           *Session
	id          string
	conn        *codesandbox.Pitcher
	sh          *codesandbox.StreamedShell
	interactive bool
	timeout     time.Duration
	start       time.Time
	frames      chan frame
	stop        chan struct{} // closed once run reads no more frames
	started     chan error    // the helper's S (nil) or its refusal
	inUse       func()        // ends the job's use of the VM (idle.go)

	inMu   sync.Mutex // one control line at a time, in order
	ended  bool
	closed bool // stdin

	done chan struct{}
	exit sandbox.JobExit
}

var _ sandbox.Job = (*job)(nil)

// StartJob implements sandbox.JobRunner. A job with a network (Egress) is
// refused: VMs are not behind the broker's egress proxy, so its
// allow-lists could not apply.
func (s *Session) StartJob(ctx context.Context, spec0 sandbox.JobSpec, sink sandbox.JobSink) (sandbox.Job, error) {
	if spec0.Egress != nil {
		return nil, brokererr.New(brokererr.InvalidInput, "network access for executions is not available on the codesandbox backend (its VMs are not behind the broker's egress proxy); use network \"none\"")
	}
	if sink == nil {
		sink = func(string, []byte) {}
	}
	rel := ""
	if spec0.WorkDir != "" && spec0.WorkDir != "." {
		var err error
		if rel, err = workspace.ValidatePath(spec0.WorkDir); err != nil {
			return nil, err
		}
	}
	timeout := spec0.Timeout
	if timeout <= 0 {
		timeout = defaultTimeout
	}
	timeout = min(timeout, agent.MaxTimeoutMS*time.Millisecond)

	inUse := s.use()
	var notes []string
	id := newID()
	conn, w, err := s.prepare(ctx, &notes, func(ws string) spec {
		return spec{
			ID: id, Workspace: ws, Cwd: path.Join(ws, rel), Argv: []string{"bash", "-c", spec0.Command}, Env: spec0.Env,
			TimeoutMS: max(timeout.Milliseconds(), 1), Interactive: spec0.Interactive, Network: s.b.o.Network,
			MaxEntries: s.maxEntries(), Result: resultPath(id),
		}
	})
	if err != nil {
		inUse()
		return nil, err
	}
	w.Close()
	for _, n := range notes {
		sink(sandbox.StreamStderr, []byte("sandbox-broker: "+n+"\n"))
	}
	j := &job{
		s: s, id: id, conn: conn, interactive: spec0.Interactive, timeout: timeout, start: time.Now(),
		frames: make(chan frame, 256), stop: make(chan struct{}), started: make(chan error, 1), done: make(chan struct{}),
		inUse: inUse,
	}
	var fr frameReader
	// From here the job may run: it is never started again.
	j.sh, err = conn.Stream(ctx, helperCommand("job", id), s.v.ws, func(chunk string) {
		fr.feed(chunk, func(kind byte, data []byte) {
			select { // the connection's reader waits here, unless run stopped reading
			case j.frames <- frame{kind, append([]byte(nil), data...)}:
			case <-j.stop:
			}
		})
	})
	if err != nil {
		inUse()
		s.v.unknown()
		return nil, brokererr.Wrap(codesandbox.AgentError(err), brokererr.Unavailable,
			"the hosted VM did not confirm the execution's start; it was not started again").NotRetryable()
	}
	go j.run(sink)
	wait := time.NewTimer(jobStartWait)
	defer wait.Stop()
	select {
	case err := <-j.started:
		if err != nil {
			return nil, err
		}
		return j, nil
	case <-j.done:
		if err := <-j.started; err != nil {
			return nil, err
		}
		return j, nil
	case <-ctx.Done():
	case <-wait.C:
	}
	tctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	j.sh.Terminate(tctx)
	cancel()
	return nil, brokererr.New(brokererr.Unavailable, "the hosted VM did not start the execution in time; it was stopped").NotRetryable()
}

// Backend names the backend running the job (sandbox.BackendReporter).
func (j *job) Backend() string { return Name }

// run delivers the job's output and learns its end.
func (j *job) run(sink sandbox.JobSink) {
	startedSent := false
	signalStart := func(err error) {
		if !startedSent {
			startedSent = true
			j.started <- err
		}
	}
	deadline := time.NewTimer(j.timeout + runMargin)
	defer deadline.Stop()
	var res *result
	lost := false
	handle := func(f frame) {
		switch f.kind {
		case frameStarted:
			signalStart(nil)
		case frameStdout:
			sink(sandbox.StreamStdout, f.data)
		case frameStderr:
			sink(sandbox.StreamStderr, f.data)
		case frameExit:
			r, err := decodeResult(f.data, j.id, 0, j.s.maxEntries())
			if err == nil {
				res = r
			}
		}
	}
loop:
	for res == nil {
		select {
		case f := <-j.frames:
			handle(f)
		case <-j.sh.Done():
			for drained := false; !drained && res == nil; { // frames come before the exit
				select {
				case f := <-j.frames:
					handle(f)
				default:
					drained = true
				}
			}
			if _, err := j.sh.Exit(); err != nil && res == nil {
				lost = errors.Is(err, codesandbox.ErrPitcherClosed)
			}
			break loop
		case <-deadline.C:
			tctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			j.sh.Terminate(tctx)
			cancel()
			break loop
		}
	}
	close(j.stop)
	if res == nil && lost {
		res = j.recover(sink)
	}
	x := sandbox.JobExit{Duration: time.Since(j.start), ExitCode: -1}
	switch {
	case res == nil:
		x.Err = errors.New("the hosted VM's helper ended without reporting the job's end")
		j.s.v.unknown()
	case res.Error != "":
		signalStart(brokererr.New(brokererr.InvalidInput, "the execution could not start in the hosted VM: %s", res.Error))
		x.Err = errors.New(res.Error)
	default:
		x = sandbox.JobExit{ExitCode: res.ExitCode, Signal: res.Signal, TimedOut: res.TimedOut, Duration: time.Duration(res.DurationMS) * time.Millisecond}
		if err := j.copyBack(res, sink); err != nil {
			x.Err = err
		}
	}
	signalStart(brokererr.New(brokererr.Unavailable, "the hosted VM's helper ended before starting the execution").NotRetryable())
	j.inUse()
	j.inMu.Lock()
	j.ended = true
	j.exit = x
	j.inMu.Unlock()
	close(j.done)
}

// recover looks for the result of a job whose connection dropped, until
// its deadline; the output after the drop is lost and the job was not
// started again.
func (j *job) recover(sink sandbox.JobSink) *result {
	sink(sandbox.StreamStderr, []byte("\nsandbox-broker: the connection to the hosted VM dropped; output from then on was lost\n"))
	ctx, cancel := context.WithDeadline(context.Background(), j.start.Add(j.timeout+runMargin))
	defer cancel()
	res, err := j.s.recoverResult(ctx, j.id, 0, j.start.Add(j.timeout+runMargin))
	if err != nil {
		return nil
	}
	return res
}

// copyBack copies the job's file changes to the host before the job is
// reported ended.
func (j *job) copyBack(res *result, sink sandbox.JobSink) error {
	ctx, cancel := context.WithTimeout(context.Background(), wrapUp)
	defer cancel()
	w, err := j.s.openWorkspace()
	if err != nil {
		return err
	}
	defer w.Close()
	conn, err := j.s.agent(ctx)
	if err != nil {
		j.s.v.unknown()
		return err
	}
	j.s.removeResult(conn, j.id)
	var notes []string
	_, err = j.s.pull(ctx, conn, w, res.fileChanges, &notes)
	for _, n := range notes {
		sink(sandbox.StreamStderr, []byte("sandbox-broker: "+n+"\n"))
	}
	return err
}

// control types one control line into the job's terminal.
func (j *job) control(ctx context.Context, line string) error {
	if j.ended {
		return errJobEnded
	}
	return codesandbox.AgentError(j.conn.ShellIn(ctx, j.sh.ID, line+"\n"))
}

// WriteStdin implements sandbox.Job.
func (j *job) WriteStdin(ctx context.Context, data []byte) error {
	if !j.interactive {
		return errors.New("stdin is not open: the job is not interactive")
	}
	j.inMu.Lock()
	defer j.inMu.Unlock()
	if j.closed {
		return errors.New("stdin is closed")
	}
	for sent := 0; sent < len(data); {
		n := min(stdinChunk, len(data)-sent)
		if err := j.control(ctx, "D "+base64.StdEncoding.EncodeToString(data[sent:sent+n])); err != nil {
			if sent > 0 || ctx.Err() != nil {
				return &sandbox.PartialStdinError{Written: sent, Total: len(data), Err: err}
			}
			return err
		}
		sent += n
	}
	return nil
}

// CloseStdin implements sandbox.Job.
func (j *job) CloseStdin(ctx context.Context) error {
	j.inMu.Lock()
	defer j.inMu.Unlock()
	if !j.interactive || j.closed {
		return errors.New("stdin is already closed")
	}
	if err := j.control(ctx, "C"); err != nil {
		return err
	}
	j.closed = true
	return nil
}

// Signal implements sandbox.Job: the helper signals the job's process
// group.
func (j *job) Signal(ctx context.Context, sig syscall.Signal) error {
	if sig <= 0 || sig > 64 {
		return fmt.Errorf("signal %d out of range", sig)
	}
	j.inMu.Lock()
	defer j.inMu.Unlock()
	return j.control(ctx, "K "+strconv.Itoa(int(sig)))
}

// Done implements sandbox.Job.
func (j *job) Done() <-chan struct{} { return j.done }

// Exit implements sandbox.Job.
func (j *job) Exit() sandbox.JobExit {
	j.inMu.Lock()
	defer j.inMu.Unlock()
	return j.exit
}
