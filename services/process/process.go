// Package process is the bubblewrap execution engine for hosts without
// Docker: every session's code runs under a long-lived in-sandbox agent
// (services/agent) started inside bwrap with fresh user, pid, ipc, uts,
// net and cgroup namespaces, a read-only root (a runner image's exported
// file system, see services/runnerfs, or else the host's /usr), a
// synthetic /etc, rlimits and (when the host allows it) a cgroup of its
// own. Sandboxes run as an unprivileged host uid.
package process

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Options configure a Backend. Zero numeric fields take defaults.
type Options struct {
	// Root is SANDBOX_ROOT: <Root>/run holds per-sandbox run dirs and pid
	// files, <Root>/bin the agent binary, <Root>/etc-sandbox the synthetic
	// /etc. Root and its parents must be traversable by UID.
	Root string
	// AgentBinary is the host path of the agent binary; New installs a
	// copy at <Root>/bin/sandbox-agent (unless it already is that file),
	// which is bind-mounted read-only at AgentPath.
	AgentBinary string
	// UIDs leases each session's host uid (its gid is the same number)
	// when the broker is root, so RLIMIT_NPROC and kill(2) permissions are
	// per session. Required; when the broker is not root, sandboxes run as
	// the broker's own uid and gid instead.
	UIDs *uids.Allocator
	// Bwrap is the bubblewrap binary (default /usr/bin/bwrap).
	Bwrap string
	// RunnersDir holds the runner file systems (SANDBOX_RUNNERS_DIR,
	// default <Root>/runners; see services/runnerfs). Without any, the
	// host's interpreters run the code.
	RunnersDir string
	// Languages, when set, are the only languages this backend serves.
	Languages []string

	// Per-process rlimits.
	MemoryBytes int64 // cgroup memory limit (default 512 MiB)
	// RLIMIT_AS (default max(4 GiB, 2×MemoryBytes)). It is a per-process
	// backstop (the cgroup bounds memory): node reserves ~1 GiB, and the
	// agent, a Go binary, ~1.3 GiB, or ~2 GiB built with cgo (8 MiB
	// thread stacks and malloc arenas), so 2 GiB left it no room for a
	// new thread.
	AddressSpace int64
	CPUSeconds   int64 // RLIMIT_CPU (default 3600; the agent enforces each run's wall-clock timeout)
	NoFile       int64 // RLIMIT_NOFILE (default 1024)
	NProc        int64 // RLIMIT_NPROC (default 512); counted per host uid, so per session
	FSizeBytes   int64 // RLIMIT_FSIZE (default 256 MiB)
	// Cgroup limits, applied when a cgroup is available.
	PidsLimit int64 // pids.max (default 256)
	CPUMilli  int64 // cpu.max, in thousandths of a CPU (default 1000)
	// TmpBytes sizes the sandbox's /tmp tmpfs (default 64 MiB).
	TmpBytes int64

	// ReadyTimeout bounds sandbox start + agent readiness (default 30s).
	ReadyTimeout time.Duration
	// WorkspaceLimits is each session's quota; zero fields take defaults.
	WorkspaceLimits workspace.Limits
	Log             zerolog.Logger
	// IdleRelease is how long an agent keeps its language runtime (the
	// Python zygote, the Node resident) without a run (0: always).
	IdleRelease time.Duration
	// Warmups orders the runtimes' warm-ups across engines; nil runs them
	// at once.
	Warmups *sandbox.Warmups
}

const (
	defaultMemory       = 512 << 20
	minAddressSpace     = 4 << 30
	defaultCPUSeconds   = 3600
	defaultNoFile       = 1024
	defaultNProc        = 512
	defaultFSize        = 256 << 20
	defaultPidsLimit    = 256
	defaultCPUMilli     = 1000
	defaultTmpBytes     = 64 << 20
	defaultReadyTimeout = 30 * time.Second
	defaultExecTimeout  = 30 * time.Second
	hardStopMargin      = 5 * time.Second
	probeTimeout        = 15 * time.Second
	stopTimeout         = 10 * time.Second
)

// In-sandbox paths and identity (the Docker engine's, so code and tools
// see the same layout on both backends).
const (
	AgentPath     = "/opt/sandbox/broker"
	WorkspacePath = agent.WorkDir // /mnt/data
	DataAlias     = "/data"
	SandboxUID    = 1000 // uid and gid inside the user namespace
	SandboxGID    = 1000
)

// Backend is the process backend. It implements sandbox.Backend.
type Backend struct {
	o       Options
	log     zerolog.Logger
	ids     *uids.Allocator // nil when the broker is not root
	uid     int             // first host uid of sandboxes, or the broker's own
	gid     int
	etcDir  string
	agent   string             // installed agent binary
	prlimit string             // prlimit(1)
	runners map[string]*runner // language → what its sandboxes are made from
	cg      *cgroupDriver

	mu     sync.Mutex
	live   map[*sbx]bool // every started sandbox, for Close
	closed bool
	bg     sync.WaitGroup

	kernels sandbox.KernelLedgers // by workspace ID
}

var _ sandbox.Backend = (*Backend)(nil)

// New checks bwrap and user namespaces with a probe sandbox, installs the
// agent binary and the synthetic /etc, and sweeps what an earlier broker on
// the same Root left running.
func New(ctx context.Context, o Options) (*Backend, error) {
	if o.Root == "" {
		return nil, errors.New("process: Options.Root is required")
	}
	if o.AgentBinary == "" {
		return nil, errors.New("process: Options.AgentBinary is required")
	}
	if st, err := os.Stat(o.AgentBinary); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("process: agent binary is not a regular file: %v", err)
	}
	var err error
	if o.Root, err = filepath.Abs(o.Root); err != nil {
		return nil, err
	}
	if o.AgentBinary, err = filepath.Abs(o.AgentBinary); err != nil {
		return nil, err
	}
	if o.RunnersDir == "" {
		o.RunnersDir = filepath.Join(o.Root, "runners")
	}
	if o.RunnersDir, err = filepath.Abs(o.RunnersDir); err != nil {
		return nil, err
	}
	o = withDefaults(o)
	b := &Backend{
		o:    o,
		log:  o.Log.With().Str("component", "process").Logger(),
		live: map[*sbx]bool{},
	}
	if o.UIDs == nil {
		return nil, errors.New("process: Options.UIDs is required")
	}
	if os.Geteuid() == 0 {
		b.ids = o.UIDs
		b.uid, b.gid = o.UIDs.First(), o.UIDs.First()
	} else {
		b.uid, b.gid = os.Geteuid(), os.Getegid()
	}
	if st, err := os.Stat(o.Bwrap); err != nil || !st.Mode().IsRegular() {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "bubblewrap (%s) is not installed", o.Bwrap)
	} else if st.Mode()&os.ModeSetuid != 0 {
		// A setuid bwrap changes the namespace semantics this backend
		// relies on (and is a large root attack surface).
		return nil, fmt.Errorf("process: %s is setuid; use a non-setuid bubblewrap with unprivileged user namespaces", o.Bwrap)
	}
	if b.prlimit, err = exec.LookPath("/usr/bin/prlimit"); err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "prlimit(1) (util-linux) is not installed")
	}
	for _, d := range []string{o.Root, filepath.Join(o.Root, "run"), filepath.Join(o.Root, "bin")} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, fmt.Errorf("process: %w", err)
		}
		// Sandboxes (another uid) must traverse to their bind sources.
		if err := os.Chmod(d, 0o711); err != nil {
			return nil, fmt.Errorf("process: %w", err)
		}
	}
	if os.Geteuid() == 0 {
		if err := traversable(o.Root, b.uid, b.gid); err != nil {
			return nil, err
		}
	}
	b.agent = filepath.Join(o.Root, "bin", "sandbox-agent")
	if err := agent.Install(o.AgentBinary, b.agent); err != nil {
		return nil, fmt.Errorf("process: install agent: %w", err)
	}
	if b.etcDir, err = writeEtc(filepath.Join(o.Root, "etc-sandbox")); err != nil {
		return nil, fmt.Errorf("process: synthetic /etc: %w", err)
	}
	if err := b.loadRunners(); err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "the runner file systems cannot be used: %s", err)
	}
	b.cg = newCgroupDriver(rootTag(o.Root), b.log)
	b.sweepOrphans()
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	if err := b.probe(pctx); err != nil {
		return nil, err
	}
	return b, nil
}

func withDefaults(o Options) Options {
	if o.Bwrap == "" {
		o.Bwrap = "/usr/bin/bwrap"
	}
	if o.MemoryBytes <= 0 {
		o.MemoryBytes = defaultMemory
	}
	if o.AddressSpace <= 0 {
		o.AddressSpace = max(minAddressSpace, 2*o.MemoryBytes)
	}
	if o.CPUSeconds <= 0 {
		o.CPUSeconds = defaultCPUSeconds
	}
	if o.NoFile <= 0 {
		o.NoFile = defaultNoFile
	}
	if o.NProc <= 0 {
		o.NProc = defaultNProc
	}
	if o.FSizeBytes <= 0 {
		o.FSizeBytes = defaultFSize
	}
	if o.PidsLimit <= 0 {
		o.PidsLimit = defaultPidsLimit
	}
	if o.CPUMilli <= 0 {
		o.CPUMilli = defaultCPUMilli
	}
	if o.TmpBytes <= 0 {
		o.TmpBytes = defaultTmpBytes
	}
	if o.ReadyTimeout <= 0 {
		o.ReadyTimeout = defaultReadyTimeout
	}
	return o
}

// rootTag names this Root's cgroups: two brokers on different roots never
// sweep each other's sandboxes.
func rootTag(root string) string {
	h := sha256.Sum256([]byte(root))
	return "sandbox-broker-" + hex.EncodeToString(h[:6])
}

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return "process" }

// Runners implements sandbox.Backend: each language with the runner
// image whose file system it runs on, or the host interpreter.
func (b *Backend) Runners(ctx context.Context) ([]sandbox.Runner, error) {
	return b.listRunners(), nil
}

// Ping implements sandbox.Backend: bwrap must still be there.
func (b *Backend) Ping(ctx context.Context) error {
	b.mu.Lock()
	closed := b.closed
	b.mu.Unlock()
	if closed {
		return brokererr.New(brokererr.Unavailable, "the process sandbox backend is shut down")
	}
	if _, err := os.Stat(b.o.Bwrap); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "bubblewrap is not available")
	}
	return nil
}

// traversable checks that uid:gid can search every directory above root
// (the sandbox's bind sources live below it). The error names no path: it
// reaches logs, which never carry host paths.
func traversable(root string, uid, gid int) error {
	for d := filepath.Dir(root); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil {
			return fmt.Errorf("process: %w", err)
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		perm := fi.Mode().Perm()
		var bit os.FileMode = 0o001
		switch {
		case !ok:
		case int(st.Uid) == uid:
			bit = 0o100
		case int(st.Gid) == gid:
			bit = 0o010
		}
		if perm&bit == 0 {
			return brokererr.New(brokererr.Unavailable,
				"SANDBOX_ROOT is below a directory that uid %d cannot traverse; use a SANDBOX_ROOT such as /var/lib/sandbox-broker, or give its parents o+x", uid)
		}
		if d == "/" {
			return nil
		}
	}
}

// probe starts a throw-away sandbox of each runner, with every mount a
// session uses, and runs /usr/bin/true in it: user namespaces, bwrap, the
// runner file systems and the path permissions of Root are checked once,
// at start.
func (b *Backend) probe(ctx context.Context) error {
	rs := b.sandboxRunners()
	if len(rs) == 0 {
		rs = []*runner{{}}
	}
	for _, r := range rs {
		if err := b.probeRunner(ctx, r); err != nil {
			return err
		}
	}
	return nil
}

func (b *Backend) probeRunner(ctx context.Context, r *runner) error {
	id := sandbox.NewID()
	runDir := filepath.Join(b.o.Root, "run", "p-"+id)
	ws := runDir + ".probe"
	for _, d := range []string{runDir, ws} {
		if err := b.prepareDir(d, b.uid, b.gid); err != nil {
			return fmt.Errorf("process: probe: %w", err)
		}
	}
	defer func() {
		for _, d := range []string{runDir, ws} {
			_ = os.RemoveAll(d)
		}
	}()
	args := b.bwrapArgs(r, ws, runDir, []string{"/usr/bin/true"})
	cmd := exec.CommandContext(ctx, b.o.Bwrap, args...)
	cmd.SysProcAttr = b.sysProcAttr(b.uid, b.gid)
	cmd.Env = []string{}
	cmd.Dir = "/"
	out, err := cmd.CombinedOutput()
	if err != nil {
		msg := b.redact(strings.TrimSpace(string(out)), "")
		if len(msg) > 300 {
			msg = msg[:300]
		}
		return brokererr.Wrap(fmt.Errorf("%w: %s", err, msg), brokererr.Unavailable,
			"bubblewrap cannot start a sandbox (are unprivileged user namespaces enabled, and is the sandbox root traversable by uid %d?)", b.uid)
	}
	return nil
}

// sessionIDs returns the host uid and gid of workspace id's sandboxes.
func (b *Backend) sessionIDs(ctx context.Context, id string) (uid, gid int, err error) {
	if b.ids == nil {
		return b.uid, b.gid, nil
	}
	uid, err = b.ids.Lease(ctx, id)
	return uid, uid, err
}

// prepareDir makes dir (if needed) owned by uid:gid, mode 0700.
func (b *Backend) prepareDir(dir string, uid, gid int) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if os.Geteuid() == 0 {
		if err := os.Lchown(dir, uid, gid); err != nil {
			return err
		}
	}
	return os.Chmod(dir, 0o700)
}

// Close implements sandbox.Backend: every running sandbox is stopped (the
// sessions' files stay). Sessions opened before stay usable only for files.
func (b *Backend) Close(ctx context.Context) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	live := make([]*sbx, 0, len(b.live))
	for s := range b.live {
		live = append(live, s)
	}
	b.mu.Unlock()
	var wg sync.WaitGroup
	errs := make([]error, len(live))
	for i, s := range live {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = b.stop(ctx, s)
		}()
	}
	wg.Wait()
	b.bg.Wait()
	return errors.Join(errs...)
}
