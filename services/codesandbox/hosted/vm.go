package hosted

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// vm is a session's VM as the backend keeps it across idle releases.
type vm struct {
	sandboxID atomic.Value // string; "" until the first run forks one

	runMu sync.Mutex // one run at a time (jobs run beside it)

	mu        sync.Mutex // held while forking, starting or connecting
	conn      *codesandbox.Pitcher
	ws        string // the VM's workspace path
	bootup    string // bootup_type of the last start
	destroyed bool

	syncMu sync.Mutex // held while copying files either way
	// base holds the host stamps of every file as of the last sync, and
	// known says the VM's workspace still matches it. When it may not (a
	// run whose outcome was lost, a copy that failed half-way, a broker
	// restart) the next push reconciles the two sides; a fresh VM (its
	// template's workspace) is made the host's.
	known, fresh bool
	base         map[string]workspace.FileStamp

	markMu   sync.Mutex // the last use recorded in the store (idle.go)
	markedID string
	markedAt time.Time
}

func (v *vm) id() string {
	s, _ := v.sandboxID.Load().(string)
	return s
}

// disconnect closes the agent connection, if any.
func (v *vm) disconnect() {
	v.mu.Lock()
	conn := v.conn
	v.conn = nil
	v.mu.Unlock()
	if conn != nil {
		_ = conn.Close()
	}
}

// drop closes conn if it is still the VM's connection: one a call just
// found ended, which Done may not show yet.
func (v *vm) drop(conn *codesandbox.Pitcher) {
	v.mu.Lock()
	mine := v.conn == conn
	if mine {
		v.conn = nil
	}
	v.mu.Unlock()
	if mine {
		_ = conn.Close()
	}
}

// unknown marks the VM's workspace as maybe not matching the host.
func (v *vm) unknown() {
	v.syncMu.Lock()
	v.known = false
	v.syncMu.Unlock()
}

// forked marks a new VM, whose workspace is its template's.
func (v *vm) forked() {
	v.syncMu.Lock()
	v.known, v.fresh, v.base = false, true, nil
	v.syncMu.Unlock()
}

// unreachable marks, as sandbox.NotStarted, an error that came before any
// work reached the VM and says CodeSandbox could not be reached or would
// not take work now (5xx, 429, a timeout, a dropped connection): such a
// call may run elsewhere (sandbox.Fallback). Refused credentials or a
// missing template are the operator's to fix, and stay as they are.
func unreachable(err error) error {
	switch brokererr.CodeOf(err) {
	case brokererr.Unavailable, brokererr.RateLimitExceeded, brokererr.SandboxTimeout:
		return sandbox.NotStarted(err)
	}
	return err
}

// agent returns a live connection to the session's VM: forking one on
// first use (or when the old one was deleted), resuming a hibernated one,
// joining its agent and installing the helper. Nothing has run yet when it
// fails (see unreachable).
func (s *Session) agent(ctx context.Context) (*codesandbox.Pitcher, error) {
	conn, _, err := s.connect(ctx)
	return conn, err
}

// connect is agent, also returning the bootup type of the start that
// made the connection ("" for a connection that was already open).
func (s *Session) connect(ctx context.Context) (*codesandbox.Pitcher, string, error) {
	v := s.v
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.destroyed {
		return nil, "", brokererr.New(brokererr.SandboxNotFound, "the session's sandbox was destroyed")
	}
	if v.conn != nil {
		select {
		case <-v.conn.Done():
			_ = v.conn.Close()
			v.conn = nil
		default:
			return v.conn, "", nil
		}
	}
	if v.id() == "" {
		// Another replica may have forked the session's VM since Open:
		// join it rather than fork a second.
		id, err := s.b.sessionVM(ctx, s.ref)
		if err != nil {
			return nil, "", err
		}
		v.sandboxID.Store(id)
	}
	for attempt := 0; ; attempt++ {
		start, err := s.startVM(ctx)
		if brokererr.CodeOf(err) == brokererr.SandboxNotFound && attempt == 0 {
			// The VM was deleted behind the broker's back: the host
			// workspace is the truth, so a new VM takes its place.
			s.b.log.Warn().Str("workspace_id", s.ref.WorkspaceID).Str("sandbox_id", v.id()).Msg("codesandbox_session_vm_gone")
			if err := s.b.db.removeVM(ctx, s.ref.WorkspaceID, v.id()); err != nil {
				return nil, "", brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
			}
			// Another replica may have put a new VM in its place: join
			// it, reconciling its workspace with the host's.
			id, err := s.b.sessionVM(ctx, s.ref)
			if err != nil {
				return nil, "", err
			}
			v.sandboxID.Store(id)
			v.unknown()
			continue
		}
		if err != nil {
			return nil, "", unreachable(err)
		}
		o := s.b.o.Pitcher
		o.Log = s.b.o.Log.With().Str("sandbox_id", start.ID).Logger()
		conn, err := codesandbox.DialPitcher(ctx, start.PitcherURL, start.PitcherToken, o)
		if err != nil {
			return nil, "", unreachable(codesandbox.AgentError(err))
		}
		if err := installHelper(ctx, conn); err != nil {
			_ = conn.Close()
			return nil, "", unreachable(codesandbox.AgentError(err))
		}
		v.conn, v.ws, v.bootup = conn, start.Workspace(), start.BootupType
		s.b.log.Debug().Str("sandbox_id", start.ID).Str("bootup_type", start.BootupType).Msg("codesandbox_session_connected")
		return conn, start.BootupType, nil
	}
}

// startVM forks the session's VM, or starts (resumes) it. Caller holds v.mu.
func (s *Session) startVM(ctx context.Context) (*codesandbox.StartResponse, error) {
	v := s.v
	so := s.b.startOptions()
	if id := v.id(); id != "" {
		return s.b.c.Start(ctx, id, so)
	}
	privacy, private := codesandbox.PrivacyPrivate, true
	t0 := time.Now()
	fr, err := s.b.c.Fork(ctx, s.b.o.Template, codesandbox.ForkRequest{
		Title:          "sandbox-broker session",
		Privacy:        &privacy,
		PrivatePreview: &private,
		Path:           "/" + s.b.o.Tag,
		Tags:           []string{s.b.o.Tag},
		StartOptions:   &so,
	})
	if err != nil {
		return nil, err
	}
	// A crash from here to the row leaves a tagged VM no row names: the
	// sweep deletes it.
	id, err := s.own(ctx, fr.ID)
	if err != nil {
		return nil, err
	}
	v.sandboxID.Store(id)
	if id != fr.ID {
		return s.b.c.Start(ctx, id, so)
	}
	v.forked()
	s.b.log.Info().Str("sandbox_id", fr.ID).Str("workspace_id", s.ref.WorkspaceID).
		Int64("duration_ms", time.Since(t0).Milliseconds()).Msg("codesandbox_session_vm_created")
	if fr.StartResponse != nil {
		return fr.StartResponse, nil
	}
	return s.b.c.Start(ctx, fr.ID, so)
}

// own records the new VM forked as the session's, and returns it; or,
// when another replica forked one at the same time and recorded it first,
// deletes forked and returns that replica's VM, which the call joins.
func (s *Session) own(ctx context.Context, forked string) (string, error) {
	perr := s.b.db.put(ctx, s.ref.WorkspaceID, s.ref.Principal, forked, s.b.now())
	if perr == nil {
		return forked, nil
	}
	winner, err := s.b.sessionVM(ctx, s.ref)
	if err == nil && winner == forked {
		return forked, nil // the insert took effect after all
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	if derr := s.b.destroyVM(cctx, forked); derr != nil {
		s.b.log.Error().Str("sandbox_id", forked).Msg("codesandbox_session_cleanup_failed")
	}
	switch {
	case err != nil:
		return "", err
	case winner == "":
		return "", brokererr.Wrap(perr, brokererr.Unavailable, "session store unavailable")
	}
	s.b.log.Info().Str("sandbox_id", winner).Str("workspace_id", s.ref.WorkspaceID).Msg("codesandbox_session_vm_joined")
	return winner, nil
}

// installHelper writes the helper into the VM (its name is its content's
// hash: rewriting it is harmless).
func installHelper(ctx context.Context, conn *codesandbox.Pitcher) error {
	if err := conn.Mkdir(ctx, stateDir, true); err != nil {
		return err
	}
	return conn.WriteFile(ctx, helperPath, helperSource)
}
