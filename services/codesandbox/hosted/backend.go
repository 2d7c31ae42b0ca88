// Package hosted is the sandbox.Backend on CodeSandbox VMs
// (SANDBOX_BACKEND=codesandbox): each session gets a VM forked from the
// operator's runner template, reached through the management API and the
// VM's agent (package codesandbox). The session's host workspace stays
// the source of truth: what the broker's file tools, signed links and
// GitHub commits see. A run pushes what changed there into the VM and
// copies back what the run changed in the VM (sync.go), so every check the
// workspace package makes (os.Root, quotas, no symlinks) applies to what
// comes back. Code runs under a small helper the broker writes into the
// VM (helper.py): it captures stdout and stderr apart, enforces the
// timeout and takes the network away.
//
// The VM is untrusted like any sandbox: everything read from it is
// bounded and validated. The API key never reaches it: the VM sees only
// the files and commands of its own session.
package hosted

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Name is the backend's name in results and list_runners.
const Name = "codesandbox"

// Network policies of VM commands.
const (
	NetworkDeny  = "deny"  // every command runs without a network (default)
	NetworkAllow = "allow" // commands keep the VM's network
)

// DefaultTag marks session VMs; it differs from the project provider's
// tag so neither sweep touches the other's VMs.
const DefaultTag = "sandbox-broker-session"

// Options configure the backend.
type Options struct {
	API codesandbox.Options // API.Log is replaced by Log
	// Template is the runner template (CSB_RUNNER_TEMPLATE): a sandbox
	// ID, tag or alias whose image has python3, node, tsx and bash.
	Template string
	// Tier of the VMs (default the smallest, Pico).
	Tier string
	// IdleTimeout is the session manager's: an idle session's VM is
	// hibernated by Release, and the VM's own hibernation timeout is set a
	// little past it, so a VM the broker forgot (a crash) sleeps anyway.
	IdleTimeout time.Duration
	// Network is NetworkDeny (default) or NetworkAllow.
	Network string
	// WorkspaceLimits bound the host workspace, as on the other backends.
	WorkspaceLimits workspace.Limits
	// MaxSyncFileBytes is the largest file copied between the VM and the
	// host (default 24 MiB, below the agent's 32 MiB message limit).
	MaxSyncFileBytes int64
	// DBPath is the state store: state.db or DATABASE_URL (table
	// csb_sessions), shared by replicas.
	DBPath string
	// Tag marks the broker's session VMs (default DefaultTag); Sweep
	// deletes tagged VMs no session owns.
	Tag string
	// SweepGrace spares VMs younger than this (default 15 minutes).
	SweepGrace time.Duration
	Pitcher    codesandbox.PitcherOptions
	Log        zerolog.Logger
}

// Backend implements sandbox.Backend.
type Backend struct {
	c   *codesandbox.Client
	o   Options
	db  *store
	log zerolog.Logger
	now func() time.Time // the clock of last uses (a test's in tests)

	mu     sync.Mutex
	vms    map[string]*vm // by workspace ID; kept across idle release
	closed bool
}

var _ sandbox.Backend = (*Backend)(nil)

// DefaultMaxSyncFileBytes keeps a file and its message framing below the
// agent connection's default 32 MiB read limit.
const DefaultMaxSyncFileBytes = 24 << 20

// New checks o and opens the session table. It makes no call.
func New(ctx context.Context, o Options) (*Backend, error) {
	o.API.Log = o.Log
	c, err := codesandbox.New(o.API)
	if err != nil {
		return nil, err
	}
	if !codesandbox.ValidTemplateRef(o.Template) {
		return nil, errors.New("hosted: a runner template (CSB_RUNNER_TEMPLATE) is required: a sandbox ID, tag or alias")
	}
	if o.Tier == "" {
		o.Tier = codesandbox.Tiers[0]
	}
	if !slices.Contains(codesandbox.Tiers, o.Tier) {
		return nil, fmt.Errorf("hosted: unknown tier %q", o.Tier)
	}
	switch o.Network {
	case "":
		o.Network = NetworkDeny
	case NetworkDeny, NetworkAllow:
	default:
		return nil, fmt.Errorf("hosted: network must be %s or %s", NetworkDeny, NetworkAllow)
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = 30 * time.Minute
	}
	if o.MaxSyncFileBytes <= 0 {
		o.MaxSyncFileBytes = DefaultMaxSyncFileBytes
	}
	if o.Tag == "" {
		o.Tag = DefaultTag
	}
	if o.SweepGrace <= 0 {
		o.SweepGrace = 15 * time.Minute
	}
	db, err := openStore(ctx, o.DBPath)
	if err != nil {
		return nil, err
	}
	return &Backend{c: c, o: o, db: db, log: o.Log.With().Str("component", "csb_sessions").Logger(), now: time.Now, vms: map[string]*vm{}}, nil
}

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return Name }

// Runners implements sandbox.Backend: the languages the runner template
// must provide.
func (b *Backend) Runners(context.Context) ([]sandbox.Runner, error) {
	out := make([]sandbox.Runner, 0, len(languages))
	for _, l := range slices.Sorted(maps.Keys(languages)) {
		out = append(out, sandbox.Runner{Language: l, Image: "codesandbox:" + b.o.Template})
	}
	return out, nil
}

// Ping makes the cheapest authenticated call.
func (b *Backend) Ping(ctx context.Context) error {
	_, err := b.c.MetaInfo(ctx)
	return err
}

// Close drops every agent connection. VMs stay; each hibernates at its
// own timeout, and sessions resume them.
func (b *Backend) Close(ctx context.Context) error {
	b.mu.Lock()
	b.closed = true
	vms := slices.Collect(maps.Values(b.vms))
	b.vms = map[string]*vm{}
	b.mu.Unlock()
	for _, v := range vms {
		v.disconnect()
	}
	return b.db.close()
}

// Open implements sandbox.Backend. It makes no call: the VM is forked or
// resumed by the first run. A workspace whose VM row names another
// principal is refused (a session is its principal's alone).
func (b *Backend) Open(ctx context.Context, ref sandbox.SessionRef) (sandbox.Session, error) {
	if !validWorkspaceID(ref.WorkspaceID) || ref.Dir == "" {
		return nil, brokererr.New(brokererr.InvalidInput, "invalid workspace")
	}
	sandboxID, err := b.sessionVM(ctx, ref)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, brokererr.New(brokererr.Unavailable, "the CodeSandbox backend is shutting down")
	}
	v := b.vms[ref.WorkspaceID]
	if v == nil {
		v = &vm{}
		v.sandboxID.Store(sandboxID)
		b.vms[ref.WorkspaceID] = v
	}
	return &Session{b: b, ref: ref, v: v}, nil
}

// sessionVM returns the VM the store names for ref's workspace ("" for
// none yet). A row naming another principal is refused.
func (b *Backend) sessionVM(ctx context.Context, ref sandbox.SessionRef) (string, error) {
	principal, sandboxID, err := b.db.get(ctx, ref.WorkspaceID)
	if err != nil {
		return "", brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	if sandboxID != "" && principal != ref.Principal {
		b.log.Error().Str("workspace_id", ref.WorkspaceID).Msg("codesandbox_session_principal_mismatch")
		return "", brokererr.New(brokererr.SandboxNotFound, "no such session")
	}
	return sandboxID, nil
}

func validWorkspaceID(s string) bool {
	if len(s) != 32 {
		return false
	}
	for _, c := range s {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// startOptions start a session VM: its own hibernation timeout a little
// past the broker's idle release, previews not woken by HTTP (sessions
// serve none).
func (b *Backend) startOptions() codesandbox.StartOptions {
	secs := int((b.o.IdleTimeout + 5*time.Minute) / time.Second)
	return codesandbox.StartOptions{
		Tier:                      b.o.Tier,
		HibernationTimeoutSeconds: min(max(secs, 60), 86400),
		AutomaticWakeupConfig:     &codesandbox.WakeupConfig{HTTP: false, WebSocket: false},
	}
}

// holds reports whether a live session uses VM id (the sweep spares it).
func (b *Backend) holds(id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, v := range b.vms {
		if v.id() == id {
			return true
		}
	}
	return false
}

// Sweep deletes VMs with the backend's tag that no session owns: left by
// a crash between a fork and its row. See codesandbox.SweepTagged.
func (b *Backend) Sweep(ctx context.Context) (int, error) {
	return codesandbox.SweepTagged(ctx, b.c, codesandbox.SweepOptions{
		Tag: b.o.Tag, Grace: b.o.SweepGrace, Holds: b.holds, Known: b.db.known, Destroy: b.destroyVM, Log: b.log,
	})
}

// destroyVM shuts a VM down and deletes it; missing is no error.
func (b *Backend) destroyVM(ctx context.Context, id string) error {
	if err := b.c.Shutdown(ctx, id); err != nil && brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		return err
	}
	if err := b.c.Delete(ctx, id); err != nil && brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		return err
	}
	return nil
}

func (b *Backend) forget(wid string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.vms, wid)
}
