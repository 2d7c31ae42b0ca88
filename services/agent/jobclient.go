package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// jobStartTimeout bounds a job's start when ctx has no earlier deadline.
const jobStartTimeout = 30 * time.Second

// ErrJobEnded is returned by commands sent to a job that has ended.
var ErrJobEnded = errors.New("agent: the job has ended")

// JobError is the agent's refusal to start a job.
type JobError struct {
	Kind    string // JobErrInvalid, JobErrLimit or JobErrInternal
	Message string
}

func (e *JobError) Error() string { return "agent: job refused: " + e.Message }

// StartJob starts req on the agent at socketPath. ctx bounds only the
// start: the job then lives until it exits, its timeout plus ClientMargin
// passes, or it is killed. Output goes to sink from a single goroutine.
// Everything the agent sends is bounded and decoded strictly; if the
// connection breaks or the agent misbehaves, the job is given up (the agent
// kills it when the connection closes) and Exit().Err says why.
func StartJob(ctx context.Context, socketPath string, req JobRequest, sink sandbox.JobSink) (sandbox.Job, error) {
	return StartJobVia(ctx, SocketDialer(socketPath), req, sink)
}

// StartJobVia is StartJob on the agent dial reaches.
func StartJobVia(ctx context.Context, dial Dialer, req JobRequest, sink sandbox.JobSink) (sandbox.Job, error) {
	if sink == nil {
		sink = func(string, []byte) {}
	}
	if req.TimeoutMS < 0 || req.TimeoutMS > MaxTimeoutMS {
		return nil, fmt.Errorf("agent: job timeout_ms %d out of range", req.TimeoutMS)
	}
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout == 0 {
		timeout = DefaultTimeoutMS * time.Millisecond
	}
	line, err := json.Marshal(struct {
		Op string `json:"op"`
		JobRequest
	}{OpJob, req})
	if err != nil {
		return nil, fmt.Errorf("agent: encode job request: %w", err)
	}
	if len(line)+1 > MaxRequestBytes {
		return nil, fmt.Errorf("agent: job request of %d bytes exceeds %d", len(line)+1, MaxRequestBytes)
	}
	startDeadline := time.Now().Add(jobStartTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(startDeadline) {
		startDeadline = d
	}
	dctx, cancel := context.WithDeadline(ctx, startDeadline)
	defer cancel()
	c, err := dial(dctx)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotReached, err)
	}
	ok := false
	defer func() {
		if !ok {
			c.Close()
		}
	}()
	_ = c.SetDeadline(startDeadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	if _, err := c.Write(append(line, '\n')); err != nil {
		return nil, ctxErr(ctx, fmt.Errorf("agent: write: %w", err))
	}
	br := bufio.NewReaderSize(c, 64<<10)
	f, err := readFrame(br)
	if err != nil {
		return nil, ctxErr(ctx, err)
	}
	switch f.T {
	case FrameStarted:
	case FrameError:
		kind := f.Kind
		if kind != JobErrInvalid && kind != JobErrLimit {
			kind = JobErrInternal
		}
		return nil, &JobError{Kind: kind, Message: truncate(f.Error, 300)}
	default:
		return nil, fmt.Errorf("agent: unexpected %q frame at job start", truncate(f.T, 16))
	}
	if !stop() {
		return nil, ctx.Err() // cancelled just as the job started; closing c kills it
	}
	j := &clientJob{
		c: c, pid: f.PID, interactive: req.Interactive, start: time.Now(),
		pending: map[uint64]pendingCmd{}, stdinSem: make(chan struct{}, 1), done: make(chan struct{}),
	}
	_ = c.SetWriteDeadline(time.Time{})
	_ = c.SetReadDeadline(j.start.Add(timeout + ClientMargin))
	ok = true
	go j.read(br, sink)
	return j, nil
}

// readFrame reads and strictly decodes one frame line.
func readFrame(br *bufio.Reader) (JobFrame, error) {
	line, err := readLine(br, MaxJobFrameBytes)
	if err != nil {
		return JobFrame{}, fmt.Errorf("agent: read frame: %w", err)
	}
	var f JobFrame
	if err := decodeStrict(line, &f); err != nil {
		return JobFrame{}, fmt.Errorf("agent: %w", err)
	}
	return f, nil
}

type pendingCmd struct {
	ch    chan error
	onAck func()
}

// clientJob implements sandbox.Job over one agent connection.
type clientJob struct {
	c           net.Conn
	pid         int // inside the sandbox's PID namespace
	interactive bool
	start       time.Time

	wmu     sync.Mutex // serialises frame writes
	nextID  atomic.Uint64
	mu      sync.Mutex
	pending map[uint64]pendingCmd
	ended   bool
	exit    sandbox.JobExit

	stdinSem    chan struct{} // one stdin command in flight
	stdinClosed atomic.Bool
	done        chan struct{}
}

var _ sandbox.Job = (*clientJob)(nil)

// read delivers frames until the exit frame or an error, then ends the job.
func (j *clientJob) read(br *bufio.Reader, sink sandbox.JobSink) {
	var x sandbox.JobExit
	for {
		f, err := readFrame(br)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				err = errors.New("agent: the job did not end within its timeout")
			}
			x = sandbox.JobExit{ExitCode: -1, Err: fmt.Errorf("agent: job connection lost: %w", err)}
			break
		}
		if f.T == FrameOut {
			if (f.S != sandbox.StreamStdout && f.S != sandbox.StreamStderr) || len(f.D) > MaxJobChunk {
				x = sandbox.JobExit{ExitCode: -1, Err: errors.New("agent: malformed output frame")}
				break
			}
			if len(f.D) > 0 {
				sink(f.S, f.D)
			}
			continue
		}
		if f.T == FrameAck {
			j.acked(f.ID, f.Error)
			continue
		}
		if f.T == FrameExit {
			x = sandbox.JobExit{ExitCode: f.Code, Signal: cleanSignal(f.Signal), TimedOut: f.TimedOut}
			break
		}
		x = sandbox.JobExit{ExitCode: -1, Err: fmt.Errorf("agent: unexpected %q frame", truncate(f.T, 16))}
		break
	}
	// Billed by the host's clock: the agent's own figure is untrusted.
	x.Duration = time.Since(j.start)
	j.c.Close()
	j.mu.Lock()
	j.ended = true
	j.exit = x
	pend := j.pending
	j.pending = nil
	j.mu.Unlock()
	for _, p := range pend {
		if p.onAck != nil {
			p.onAck()
		}
		p.ch <- ErrJobEnded
	}
	close(j.done)
}

// cleanSignal keeps a signal name only if it looks like one.
func cleanSignal(s string) string {
	if s == "" {
		return ""
	}
	if len(s) > 12 || len(s) < 4 || s[:3] != "SIG" {
		return "SIG?"
	}
	for _, c := range s[3:] {
		if !(c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return "SIG?"
		}
	}
	return s
}

func (j *clientJob) acked(id uint64, msg string) {
	j.mu.Lock()
	p, ok := j.pending[id]
	delete(j.pending, id)
	j.mu.Unlock()
	if !ok {
		return // late or unsolicited: nobody waits for it
	}
	if p.onAck != nil {
		p.onAck()
	}
	var err error
	if msg != "" {
		err = errors.New("agent: " + truncate(msg, 300))
	}
	p.ch <- err
}

// command sends f and waits (within ctx) for its ack. A failed write leaves
// the frame stream in an unknown state, so it ends the connection. done (if
// set) runs exactly once when the command is settled: acked, failed, or
// dropped at the job's end; not when only ctx gave up waiting.
func (j *clientJob) command(ctx context.Context, f JobFrame, onAck func()) error {
	settle := func() {
		if onAck != nil {
			onAck()
		}
	}
	f.ID = j.nextID.Add(1)
	ch := make(chan error, 1)
	j.mu.Lock()
	if j.ended {
		j.mu.Unlock()
		settle()
		return ErrJobEnded
	}
	j.pending[f.ID] = pendingCmd{ch: ch, onAck: onAck}
	j.mu.Unlock()
	b, err := json.Marshal(f)
	if err == nil {
		err = j.write(ctx, append(b, '\n'))
	}
	if err != nil {
		j.mu.Lock()
		_, mine := j.pending[f.ID]
		delete(j.pending, f.ID)
		j.mu.Unlock()
		if mine { // else read() settled it at the job's end
			settle()
		}
		return ctxErr(ctx, err)
	}
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", errUnacked, ctx.Err())
	}
}

// errUnacked: a command was sent but ctx ended before its ack; the agent
// still applies it.
var errUnacked = errors.New("agent: sent, not acknowledged yet")

func (j *clientJob) write(ctx context.Context, b []byte) error {
	j.wmu.Lock()
	defer j.wmu.Unlock()
	deadline := time.Now().Add(frameWriteTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = j.c.SetWriteDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = j.c.SetWriteDeadline(time.Now()) })
	_, err := j.c.Write(b)
	stop()
	if err != nil {
		j.c.Close()
		return fmt.Errorf("agent: write: %w", err)
	}
	return nil
}

// acquireStdin waits for the previous stdin command's ack.
func (j *clientJob) acquireStdin(ctx context.Context) error {
	if !j.interactive {
		return errors.New("agent: the job is not interactive")
	}
	select {
	case j.stdinSem <- struct{}{}:
		return nil
	case <-j.done:
		return ErrJobEnded
	case <-ctx.Done():
		return ctx.Err()
	}
}

// stdinCommand sends one stdin command; the slot is freed by its ack (not
// by ctx), so commands never overlap at the agent.
func (j *clientJob) stdinCommand(ctx context.Context, f JobFrame) error {
	if err := j.acquireStdin(ctx); err != nil {
		return err
	}
	var once sync.Once
	return j.command(ctx, f, func() { once.Do(func() { <-j.stdinSem }) })
}

// WriteStdin implements sandbox.Job; data is sent in MaxJobChunk pieces,
// each written once the previous one is in the job's stdin. If that stops
// part-way, the error says how far it got (*sandbox.PartialStdinError).
func (j *clientJob) WriteStdin(ctx context.Context, data []byte) error {
	if j.stdinClosed.Load() {
		return errors.New("agent: stdin is closed")
	}
	written := 0
	for written < len(data) {
		n := min(len(data)-written, MaxJobChunk)
		if err := j.stdinCommand(ctx, JobFrame{T: FrameStdin, D: data[written : written+n]}); err != nil {
			queued := 0
			if errors.Is(err, errUnacked) {
				queued = n
			}
			if written+queued == 0 {
				return err
			}
			return &sandbox.PartialStdinError{Written: written, Queued: queued, Total: len(data), Err: err}
		}
		written += n
	}
	return nil
}

// CloseStdin implements sandbox.Job.
func (j *clientJob) CloseStdin(ctx context.Context) error {
	if j.stdinClosed.Load() {
		return errors.New("agent: stdin is already closed")
	}
	if err := j.stdinCommand(ctx, JobFrame{T: FrameCloseStdin}); err != nil {
		return err
	}
	j.stdinClosed.Store(true)
	return nil
}

// Signal implements sandbox.Job: TERM, KILL, INT and HUP are allowed.
// Signalling an ended job does nothing. If SIGKILL cannot be delivered
// through the agent, the connection is closed, which makes the agent kill
// the job.
func (j *clientJob) Signal(ctx context.Context, sig syscall.Signal) error {
	name := ""
	for n, s := range JobSignals {
		if s == sig {
			name = n
		}
	}
	if name == "" {
		return fmt.Errorf("agent: signal %v is not allowed for jobs", sig)
	}
	select {
	case <-j.done:
		return nil
	default:
	}
	err := j.command(ctx, JobFrame{T: FrameSignal, Sig: name}, nil)
	if errors.Is(err, ErrJobEnded) {
		return nil
	}
	if err != nil && sig == syscall.SIGKILL {
		j.c.Close()
	}
	return err
}

// Done implements sandbox.Job.
func (j *clientJob) Done() <-chan struct{} { return j.done }

// Exit implements sandbox.Job.
func (j *clientJob) Exit() sandbox.JobExit {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.exit
}

// PID is the job's process ID inside the sandbox (informational).
func (j *clientJob) PID() int { return j.pid }

// JobStartError maps a failure to start a job (StartJob) to a structured
// error: the agent's refusal by its kind, anything else UNAVAILABLE.
func JobStartError(ctx context.Context, err error) error {
	var je *JobError
	if errors.As(err, &je) {
		switch je.Kind {
		case JobErrInvalid:
			return brokererr.New(brokererr.InvalidInput, "the sandbox refused the execution: %s", je.Message)
		case JobErrLimit:
			return brokererr.New(brokererr.QuotaExceeded, "the sandbox runs its maximum of %d executions; wait for one to finish", MaxJobs).WithRetryAfter(time.Second)
		}
		return brokererr.New(brokererr.Unavailable, "the sandbox could not start the execution: %s", je.Message)
	}
	if ctx.Err() != nil {
		return brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "the call was cancelled")
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "the sandbox did not start the execution")
}
