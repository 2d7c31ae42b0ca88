package hosted

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Session is one session on its VM. It implements sandbox.Session and
// sandbox.JobRunner.
type Session struct {
	b   *Backend
	ref sandbox.SessionRef
	v   *vm
}

var (
	_ sandbox.Session   = (*Session)(nil)
	_ sandbox.JobRunner = (*Session)(nil)
)

// runMargin is what a run may take past its timeout before the broker
// stops waiting: the helper's walks of the workspace and its kill (a
// variable for tests).
var runMargin = 30 * time.Second

const (
	defaultTimeout = 60 * time.Second
	// terminalTail is the terminal output kept for errors (a helper that
	// could not start says why there).
	terminalTail = 4 << 10
	// recoverPoll is how often a run whose connection dropped is looked
	// for again.
	recoverPoll = 500 * time.Millisecond
)

func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// maxEntries is the most workspace entries the helper walks: the quota's,
// with room for the directories the quota also counts.
func (s *Session) maxEntries() int {
	return s.b.o.WorkspaceLimits.WithDefaults().MaxFiles + 1
}

// prepare is what comes before any command: the VM up, the agent joined,
// the host's files pushed, the command's spec (made by mk for the VM's
// workspace path) written. It returns the connection and the open host
// workspace (the caller closes it). Nothing has run when it fails, so a
// connection that turns out closed (the VM went to sleep just before) is
// replaced once.
func (s *Session) prepare(ctx context.Context, notes *[]string, mk func(ws string) spec) (*codesandbox.Pitcher, *workspace.Workspace, error) {
	w, err := s.openWorkspace()
	if err != nil {
		return nil, nil, err
	}
	for attempt := 0; ; attempt++ {
		conn, err := s.agent(ctx)
		if err != nil {
			w.Close()
			return nil, nil, err
		}
		s.markUse() // the VM may have been joined or forked just now
		err = s.push(ctx, conn, w, notes)
		if err == nil {
			err = writeSpec(ctx, conn, mk(s.v.ws))
		}
		if err == nil {
			return conn, w, nil
		}
		if attempt == 0 && errors.Is(err, codesandbox.ErrPitcherClosed) && ctx.Err() == nil {
			*notes = (*notes)[:0]
			s.v.drop(conn)
			continue
		}
		w.Close()
		return nil, nil, unreachable(codesandbox.AgentError(err))
	}
}

// writeSpec writes a command's spec into the VM.
func writeSpec(ctx context.Context, conn *codesandbox.Pitcher, sp spec) error {
	b, err := json.Marshal(sp)
	if err != nil {
		return err
	}
	return conn.WriteFile(ctx, specPath(sp.ID), b)
}

// Exec implements sandbox.Session.
func (s *Session) Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	lang, ok := languages[req.Language]
	if !ok {
		return sandbox.ExecResult{}, brokererr.New(brokererr.UnknownLanguage, "unknown language %q", req.Language)
	}
	if req.Mode == sandbox.ModeNotebook {
		return sandbox.ExecResult{}, brokererr.New(brokererr.InvalidInput, "mode notebook is not available on the codesandbox backend; use mode fresh")
	}
	timeout := req.Timeout
	if timeout <= 0 {
		timeout = defaultTimeout
	}
	timeout = min(timeout, agent.MaxTimeoutMS*time.Millisecond)
	maxOut := req.MaxOutputBytes
	if maxOut <= 0 || maxOut > agent.MaxOutputLimit {
		maxOut = min(max(maxOut, agent.DefaultMaxOutputBytes), agent.MaxOutputLimit)
	}
	s.v.runMu.Lock()
	defer s.v.runMu.Unlock()
	defer s.use()()

	var notes []string
	id := newID()
	conn, w, err := s.prepare(ctx, &notes, func(ws string) spec {
		return spec{
			ID: id, Workspace: ws, Cwd: ws, Argv: lang.argv, Code: req.Code, CodeName: lang.file,
			TimeoutMS: max(timeout.Milliseconds(), 1), MaxOutput: maxOut, Network: s.b.o.Network,
			MaxEntries: s.maxEntries(), Result: resultPath(id),
		}
	})
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	defer w.Close()

	// From here the code may run: it is never sent again. A dropped
	// connection is followed by a look for its result, not a retry.
	start := time.Now()
	deadline := start.Add(timeout + runMargin)
	rctx, cancel := context.WithDeadline(ctx, deadline)
	res, tail, err := s.runHelper(rctx, conn, "run", id, maxOut)
	hardStop := rctx.Err() != nil && ctx.Err() == nil
	cancel()
	switch {
	case err == nil:
	case errors.Is(err, errNoResult):
		return sandbox.ExecResult{Duration: time.Since(start)}, s.helperFailed(err, tail)
	case hardStop:
		s.v.unknown()
		s.b.log.Warn().Str("sandbox_id", s.v.id()).Dur("timeout", timeout).Msg("codesandbox_run_missed_deadline")
		return sandbox.ExecResult{TimedOut: true, Duration: time.Since(start), ExitCode: -1, Signal: "SIGKILL"},
			brokererr.New(brokererr.SandboxTimeout, "the code did not finish within %s and was stopped", timeout)
	case ctx.Err() != nil:
		s.v.unknown()
		return sandbox.ExecResult{Duration: time.Since(start)}, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "the call was cancelled")
	case errors.Is(err, codesandbox.ErrPitcherClosed):
		if res, err = s.recoverResult(ctx, id, maxOut, deadline); err != nil {
			return sandbox.ExecResult{Duration: time.Since(start)}, err
		}
		conn, _ = s.agent(ctx)
	default:
		s.v.unknown()
		return sandbox.ExecResult{Duration: time.Since(start)}, codesandbox.AgentError(err)
	}
	if res.Error != "" {
		return sandbox.ExecResult{Duration: time.Since(start)}, brokererr.New(brokererr.Unavailable, "the hosted VM could not run the code: %s", res.Error).NotRetryable()
	}
	er := sandbox.ExecResult{
		ExitCode: res.ExitCode, Signal: res.Signal, Stdout: res.Stdout, Stderr: res.Stderr,
		Truncated: res.Truncated, TimedOut: res.TimedOut, Duration: time.Duration(res.DurationMS) * time.Millisecond,
	}
	if conn == nil {
		s.v.unknown()
		return er, brokererr.New(brokererr.Unavailable, "the run finished but its files could not be copied back; they will be on the next run")
	}
	er.Changed, err = s.pull(ctx, conn, w, res.fileChanges, &notes)
	er.Stderr = appendNotes(er.Stderr, notes)
	return er, err
}

// appendNotes adds the broker's notes about files to a run's stderr.
func appendNotes(stderr []byte, notes []string) []byte {
	if len(notes) == 0 {
		return stderr
	}
	var b strings.Builder
	if len(stderr) > 0 && stderr[len(stderr)-1] != '\n' {
		b.WriteByte('\n')
	}
	for _, n := range notes {
		b.WriteString("sandbox-broker: " + n + "\n")
	}
	return append(stderr, b.String()...)
}

// errNoResult: the helper ended without a result.
var errNoResult = errors.New("the helper left no result")

// runHelper runs the helper in mode for spec id and returns its result:
// the one it sends on the terminal as it ends (no extra round trip), else
// the one in its result file. tail is the terminal's last output, for a
// helper that could not start. When ctx ends first the shell is
// terminated (the helper then kills its command) and ctx's error returned.
func (s *Session) runHelper(ctx context.Context, conn *codesandbox.Pitcher, mode, id string, maxOut int) (*result, string, error) {
	var (
		mu    sync.Mutex
		fr    frameReader
		frame []byte
		out   []byte
	)
	sh, err := conn.Stream(ctx, helperCommand(mode, id), s.v.ws, func(chunk string) {
		mu.Lock()
		defer mu.Unlock()
		if out = append(out, chunk...); len(out) > 2*terminalTail {
			out = append(out[:0], out[len(out)-terminalTail:]...)
		}
		fr.feed(chunk, func(kind byte, data []byte) {
			if kind == frameResult {
				frame = append([]byte(nil), data...)
			}
		})
	})
	if err != nil {
		return nil, "", err
	}
	select {
	case <-sh.Done():
	case <-ctx.Done():
		tctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		sh.Terminate(tctx)
		cancel()
		return nil, "", ctx.Err()
	}
	mu.Lock()
	defer mu.Unlock()
	tail := string(codesandbox.CleanOutput(clip(out, terminalTail)))
	if frame != nil {
		if res, err := decodeResult(frame, id, maxOut, s.maxEntries()); err == nil {
			s.removeResult(conn, id)
			return res, tail, nil
		}
	}
	if _, err := sh.Exit(); err != nil {
		return nil, tail, err // the connection dropped: see recoverResult
	}
	res, err := s.readResult(ctx, conn, id, maxOut)
	if notFound(err) {
		err = errNoResult
	}
	return res, tail, err
}

// readResult reads and checks run id's result file, and deletes it off
// the run's critical path.
func (s *Session) readResult(ctx context.Context, conn *codesandbox.Pitcher, id string, maxOut int) (*result, error) {
	b, err := conn.ReadFile(ctx, resultPath(id))
	if err != nil {
		return nil, err
	}
	res, err := decodeResult(b, id, maxOut, s.maxEntries())
	if err != nil {
		return nil, err
	}
	s.removeResult(conn, id)
	return res, nil
}

// removeResult deletes a result file in the background.
func (s *Session) removeResult(conn *codesandbox.Pitcher, id string) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := conn.Remove(ctx, resultPath(id), false); err != nil && !notFound(err) && !errors.Is(err, codesandbox.ErrPitcherClosed) {
			s.b.log.Warn().Err(codesandbox.AgentError(err)).Msg("codesandbox_result_remove_failed")
		}
	}()
}

// helperFailed explains a run that left no result: the helper could not
// start (no python3 in the template) or broke.
func (s *Session) helperFailed(err error, tail string) error {
	s.v.unknown()
	s.b.log.Warn().Str("sandbox_id", s.v.id()).Str("cause", cleanMessage(err.Error())).Msg("codesandbox_helper_failed")
	if errors.Is(err, errNoResult) {
		return brokererr.New(brokererr.Unavailable, "the hosted VM's helper did not run (does the runner template have python3?): %s",
			cleanMessage(strings.TrimSpace(tail))).NotRetryable()
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "the hosted VM returned an unusable result")
}

// recoverResult is what follows a connection that dropped while run id
// ran: reconnect and look for its result until the run's deadline. The
// run is never started again; when its result does not turn up (the VM
// restarted, or it never finished) the outcome is unknown, and the error
// says so rather than running the code a second time.
func (s *Session) recoverResult(ctx context.Context, id string, maxOut int, deadline time.Time) (*result, error) {
	s.b.log.Warn().Str("sandbox_id", s.v.id()).Msg("codesandbox_run_connection_lost")
	for {
		conn, bootup, err := s.connect(ctx)
		if err == nil {
			res, rerr := s.readResult(ctx, conn, id, maxOut)
			if rerr == nil {
				s.b.log.Info().Str("sandbox_id", s.v.id()).Msg("codesandbox_run_result_recovered")
				return res, nil
			}
			if !notFound(rerr) || bootup == "CLEAN" || bootup == "FORK" {
				break // the VM restarted: nothing of the run is left
			}
		}
		if ctx.Err() != nil || !time.Now().Add(recoverPoll).Before(deadline) {
			break
		}
		t := time.NewTimer(recoverPoll)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}
	s.v.unknown()
	return nil, brokererr.New(brokererr.Unavailable,
		"the connection to the hosted VM dropped while the code ran, and its outcome could not be learned; it was not run again. Check the session's files before running it again").NotRetryable()
}

// WriteFile implements sandbox.Session on the host workspace; the VM gets
// the file before the next command.
func (s *Session) WriteFile(ctx context.Context, p string, data []byte, overwrite bool) error {
	if err := s.checkLive(); err != nil {
		return err
	}
	w, err := s.openWorkspace()
	if err != nil {
		return err
	}
	defer w.Close()
	return w.Write(p, data, overwrite)
}

// ReadFile implements sandbox.Session.
func (s *Session) ReadFile(ctx context.Context, p string, offset, max int64) (sandbox.File, error) {
	if err := s.checkLive(); err != nil {
		return sandbox.File{}, err
	}
	return workspace.ReadFile(s.ref.Dir, s.b.o.WorkspaceLimits, p, offset, max)
}

// ListFiles implements sandbox.Session.
func (s *Session) ListFiles(ctx context.Context, dir string) ([]sandbox.FileInfo, error) {
	if err := s.checkLive(); err != nil {
		return nil, err
	}
	return workspace.ListFiles(s.ref.Dir, s.b.o.WorkspaceLimits, dir)
}

// PrepareWorkspace implements sandbox.Session.
func (s *Session) PrepareWorkspace(ctx context.Context) error {
	if err := s.checkLive(); err != nil {
		return err
	}
	w, err := s.openWorkspace()
	if err != nil {
		return err
	}
	return w.Close()
}

func (s *Session) checkLive() error {
	s.v.mu.Lock()
	defer s.v.mu.Unlock()
	if s.v.destroyed {
		return brokererr.New(brokererr.SandboxNotFound, "the session's sandbox was destroyed")
	}
	return nil
}

// Destroy implements sandbox.Session: the VM is deleted, then the files.
func (s *Session) Destroy(ctx context.Context) error {
	s.v.mu.Lock()
	s.v.destroyed = true
	conn := s.v.conn
	s.v.conn = nil
	s.v.mu.Unlock()
	if conn != nil {
		_ = conn.Close()
	}
	if s.v.id() == "" {
		// Another replica may have forked the session's VM: it goes too.
		id, err := s.b.sessionVM(ctx, s.ref)
		if err != nil {
			s.v.mu.Lock()
			s.v.destroyed = false
			s.v.mu.Unlock()
			return err
		}
		s.v.sandboxID.Store(id)
	}
	if id := s.v.id(); id != "" {
		if err := s.b.destroyVM(ctx, id); err != nil {
			s.v.mu.Lock()
			s.v.destroyed = false // try again on the next Destroy
			s.v.mu.Unlock()
			return err
		}
		s.b.log.Info().Str("sandbox_id", id).Msg("codesandbox_session_vm_deleted")
	}
	if err := s.b.db.remove(ctx, s.ref.WorkspaceID); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	s.b.forget(s.ref.WorkspaceID)
	if err := os.RemoveAll(s.ref.Dir); err != nil {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot delete the workspace")
	}
	return nil
}
