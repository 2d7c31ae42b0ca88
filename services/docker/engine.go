// Package docker is the local Docker execution engine: every session's code
// runs in a hardened container (security-cases.md §1.2) whose in-container
// agent (services/agent) runs one request at a time. A warm pool of started
// containers per language hides container start-up latency.
package docker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/api/types/mount"
	"github.com/docker/docker/client"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Labels on images and containers.
const (
	LabelRunner    = "sandbox.runner"    // image: "true"
	LabelLanguage  = "sandbox.language"  // image and container
	LabelBroker    = "sandbox.broker"    // container: "1"
	LabelInstance  = "sandbox.instance"  // container: Options.InstanceID
	LabelWorkspace = "sandbox.workspace" // container: workspace ID or "pool"
	LabelID        = "sandbox.id"        // container: our ID (names its run dir)
	LabelRoot      = "sandbox.root"      // container: Options.Root
)

// In-container paths.
const (
	AgentPath     = "/opt/sandbox/broker"
	WorkspacePath = agent.WorkDir // /mnt/data
	DataAlias     = "/data"
)

// Options configure an Engine.
type Options struct {
	Root        string // SANDBOX_ROOT; <Root>/run/<id> socket dirs, <Root>/pool/<id> pool workspaces
	AgentBinary string // host path of the agent binary (agent.Binary), bind-mounted read-only at /opt/sandbox/broker
	PoolSize    int    // warm containers per language (the config default is 1; 0 or less disables the pool)
	Memory      int64  // bytes; default 512 MiB; MemorySwap = Memory
	NanoCPUs    int64  // default 1 CPU
	PidsLimit   int64  // default 256
	Runtime     string // "" → runc; "runsc" optional
	InstanceID  string // label value identifying this broker process
	Log         zerolog.Logger
	// ReadyTimeout bounds container start + agent readiness (default 30s).
	ReadyTimeout time.Duration
	// WorkspaceLimits is each session's quota; zero fields take defaults.
	WorkspaceLimits workspace.Limits
	// Languages, when set, are the only runner languages this engine
	// serves (the project engine serves only the Node runner, run_code
	// every other one).
	Languages []string
	// JobLanguages are served too, but only to jobs that name them
	// (JobSpec.Language): runs refuse them and Runners does not list them.
	// The agent runner, which only execute_task uses, is one.
	JobLanguages []string
	// Resources overrides Memory and NanoCPUs for the containers of some
	// languages (the agent runner gets more than a run).
	Resources map[string]Resources
	// UIDs leases the host uid (and gid) each session's containers run as,
	// so an escape from one container is not every container's uid; warm
	// containers start under a uid of their own that a claim hands to the
	// session. Required.
	UIDs *uids.Allocator
	// Slots caps live containers across engines (SANDBOX_MAX_CONTAINERS);
	// nil means no cap.
	Slots *sandbox.Slots
	// IdleTimeout is how long the session manager lets a session keep
	// unused containers; it only dates the retry hint of a refusal at the
	// cap (0: no hint).
	IdleTimeout time.Duration
	// IdleRelease is how long an agent keeps its language runtime (the
	// Python zygote, the Node resident) without a run (0: always).
	IdleRelease time.Duration
	// Warmups orders the runtimes' warm-ups across engines; nil runs them
	// at once.
	Warmups *sandbox.Warmups
	// OnAcquire, when set, hears how long each session waited for its
	// container, and whether it came warm from the pool or cold (metrics).
	OnAcquire func(language, source string, wait time.Duration)
}

// Resources are one language's container limits; zero fields keep the
// engine's.
type Resources struct {
	Memory   int64 // bytes
	NanoCPUs int64
}

const (
	defaultMemory       = 512 << 20
	defaultNanoCPUs     = 1_000_000_000
	defaultPidsLimit    = 256
	defaultReadyTimeout = 30 * time.Second
	defaultExecTimeout  = 30 * time.Second
	hardStopMargin      = 5 * time.Second
	connectTimeout      = 10 * time.Second
	removeTimeout       = 30 * time.Second
)

// Engine is the Docker backend. It implements sandbox.Backend.
type Engine struct {
	o    Options
	cli  *client.Client
	log  zerolog.Logger
	seco string

	mu       sync.Mutex
	runners  map[string]runnerImage // language → image
	dataLink map[string]bool        // image ID → /data already reaches /mnt/data
	closed   bool

	pools  map[string]*pool
	live   map[string]*ctr // started containers by Docker ID (see watch)
	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	bg     sync.WaitGroup // pool fillers and background removals
	st     stats

	kernels sandbox.KernelLedgers // by workspace ID
}

type runnerImage struct {
	Language string
	Ref      string // human tag, e.g. sandbox-broker/runner-python:latest
	ID       string // sha256:… (what containers are created from)
	Created  int64
}

var _ sandbox.Backend = (*Engine)(nil)

// New connects to the daemon (FromEnv, API negotiation), discovers runner
// images, removes orphans of earlier broker processes and starts the pool.
func New(ctx context.Context, o Options) (*Engine, error) {
	if o.Root == "" {
		return nil, errors.New("docker: Options.Root is required")
	}
	if o.AgentBinary == "" {
		return nil, errors.New("docker: Options.AgentBinary is required")
	}
	if o.UIDs == nil {
		return nil, errors.New("docker: Options.UIDs is required")
	}
	if st, err := os.Stat(o.AgentBinary); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("docker: agent binary %q is not a regular file: %v", o.AgentBinary, err)
	}
	root, err := filepath.Abs(o.Root)
	if err != nil {
		return nil, err
	}
	o.Root = root
	if o.AgentBinary, err = filepath.Abs(o.AgentBinary); err != nil {
		return nil, err
	}
	if o.PoolSize < 0 {
		o.PoolSize = 0
	}
	if o.Memory <= 0 {
		o.Memory = defaultMemory
	}
	if o.NanoCPUs <= 0 {
		o.NanoCPUs = defaultNanoCPUs
	}
	if o.PidsLimit <= 0 {
		o.PidsLimit = defaultPidsLimit
	}
	if o.ReadyTimeout <= 0 {
		o.ReadyTimeout = defaultReadyTimeout
	}
	if o.InstanceID == "" {
		o.InstanceID = sandbox.NewID()
	}
	for _, d := range []string{o.Root, filepath.Join(o.Root, "run"), filepath.Join(o.Root, "pool")} {
		if err := os.MkdirAll(d, 0o711); err != nil {
			return nil, fmt.Errorf("docker: %w", err)
		}
	}

	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "the Docker engine is not available")
	}
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	_, err = cli.Ping(pctx)
	cancel()
	if err != nil {
		_ = cli.Close()
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "the Docker daemon is not reachable")
	}

	e := &Engine{
		o:        o,
		cli:      cli,
		log:      o.Log.With().Str("component", "docker").Logger(),
		seco:     SeccompProfileJSON(o.Runtime),
		dataLink: map[string]bool{},
		pools:    map[string]*pool{},
		live:     map[string]*ctr{},
	}
	e.ctx, e.cancel = context.WithCancel(context.WithoutCancel(ctx))
	if err := e.checkRuntime(ctx); err != nil {
		_ = cli.Close()
		return nil, err
	}
	if _, err := e.discover(ctx); err != nil {
		_ = cli.Close()
		return nil, err
	}
	if err := e.sweepOrphans(ctx); err != nil {
		_ = cli.Close()
		return nil, err
	}
	e.bg.Add(1)
	go e.watch()
	if o.PoolSize > 0 {
		e.mu.Lock()
		for lang := range e.runners {
			e.pools[lang] = e.startPool(lang)
		}
		e.mu.Unlock()
	}
	return e, nil
}

// Name implements sandbox.Backend.
func (e *Engine) Name() string { return "docker" }

// Ping implements sandbox.Backend.
func (e *Engine) Ping(ctx context.Context) error {
	if _, err := e.cli.Ping(ctx); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "the Docker daemon is not reachable")
	}
	return nil
}

// Runners implements sandbox.Backend; it re-reads the image list.
// The map discovered at start is used; it is refreshed only when it is empty
// or a run names a language it lacks, so this sits off the Docker API on
// every call's path.
func (e *Engine) Runners(ctx context.Context) ([]sandbox.Runner, error) {
	e.mu.Lock()
	m := e.runners
	e.mu.Unlock()
	if len(m) == 0 {
		var err error
		if m, err = e.discover(ctx); err != nil {
			return nil, err
		}
	}
	out := make([]sandbox.Runner, 0, len(m))
	for _, r := range m {
		if !slices.Contains(e.o.JobLanguages, r.Language) {
			out = append(out, sandbox.Runner{Language: r.Language, Image: r.Ref})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Language < out[j].Language })
	return out, nil
}

// discover lists images labelled sandbox.runner=true. Per language it
// prefers a tagged image over a dangling one, then the newest.
func (e *Engine) discover(ctx context.Context) (map[string]runnerImage, error) {
	imgs, err := e.cli.ImageList(ctx, image.ListOptions{
		Filters: filters.NewArgs(filters.Arg("label", LabelRunner+"=true")),
	})
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "cannot list runner images")
	}
	m := map[string]runnerImage{}
	better := func(a, b runnerImage) bool { // a better than b
		at, bt := a.Ref != a.ID, b.Ref != b.ID
		if at != bt {
			return at
		}
		return a.Created > b.Created
	}
	for _, im := range imgs {
		lang := im.Labels[LabelLanguage]
		if lang == "" || !validLanguage(lang) ||
			(len(e.o.Languages) > 0 && !slices.Contains(e.o.Languages, lang) && !slices.Contains(e.o.JobLanguages, lang)) {
			continue
		}
		r := runnerImage{Language: lang, ID: im.ID, Ref: im.ID, Created: im.Created}
		for _, t := range im.RepoTags {
			if t != "<none>:<none>" {
				r.Ref = t
				break
			}
		}
		if old, ok := m[lang]; !ok || better(r, old) {
			m[lang] = r
		}
	}
	e.mu.Lock()
	e.runners = m
	e.mu.Unlock()
	return m, nil
}

func validLanguage(s string) bool {
	if len(s) == 0 || len(s) > 32 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// runner returns the image for lang, re-reading the image list once if it is
// unknown.
func (e *Engine) runner(ctx context.Context, lang string) (runnerImage, error) {
	e.mu.Lock()
	r, ok := e.runners[lang]
	e.mu.Unlock()
	if ok {
		return r, nil
	}
	m, err := e.discover(ctx)
	if err != nil {
		return runnerImage{}, err
	}
	if r, ok := m[lang]; ok {
		return r, nil
	}
	return runnerImage{}, agent.UnknownLanguage(lang, maps.Keys(m))
}

// sweepOrphans removes every container labelled sandbox.broker=1 that belongs
// to this Root (or carries no root label), and their run dirs, plus stale
// pool workspaces.
func (e *Engine) sweepOrphans(ctx context.Context) error {
	list, err := e.cli.ContainerList(ctx, container.ListOptions{
		All:     true,
		Filters: filters.NewArgs(filters.Arg("label", LabelBroker+"=1")),
	})
	if err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "cannot list containers")
	}
	for _, c := range list {
		if r, ok := c.Labels[LabelRoot]; ok && r != e.o.Root {
			continue // another broker's root: not ours to sweep
		}
		rctx, cancel := context.WithTimeout(ctx, removeTimeout)
		err := e.cli.ContainerRemove(rctx, c.ID, container.RemoveOptions{Force: true, RemoveVolumes: true})
		cancel()
		if err != nil && !isNotFound(err) {
			e.log.Warn().Err(err).Str("container", shortID(c.ID)).Msg("orphan removal failed")
			continue
		}
		if id := c.Labels[LabelID]; sandbox.ValidID(id) {
			_ = os.RemoveAll(filepath.Join(e.o.Root, "run", id))
		}
		e.log.Info().Str("container", shortID(c.ID)).Str("instance", c.Labels[LabelInstance]).Msg("removed orphan sandbox container")
	}
	// Nothing of a previous process under run/ and pool/ is in use any more.
	for _, sub := range []string{"run", "pool"} {
		ents, _ := os.ReadDir(filepath.Join(e.o.Root, sub))
		for _, de := range ents {
			if sandbox.ValidID(de.Name()) {
				_ = os.RemoveAll(filepath.Join(e.o.Root, sub, de.Name()))
			}
		}
	}
	if err := e.o.UIDs.FreePrefix(ctx, e.poolKey("")); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "cannot release the uids of old warm containers")
	}
	return nil
}

// Close implements sandbox.Backend: it stops the pool fillers and removes
// pooled containers. Session containers are left to their sessions (and to
// the next start's orphan sweep).
func (e *Engine) Close(ctx context.Context) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	pools := e.pools
	e.mu.Unlock()
	e.cancel()
	e.bg.Wait()
	var errs []error
	for _, p := range pools {
		for _, c := range p.drain() {
			if err := p.discard(ctx, c); err != nil {
				errs = append(errs, err)
			}
		}
	}
	errs = append(errs, e.cli.Close())
	return errors.Join(errs...)
}

// ---------------------------------------------------------------------------
// Containers

// ctr is one sandbox container.
type ctr struct {
	id       string // our ID: container name suffix, run dir name
	dockerID string
	lang     string
	img      string // image ID
	runDir   string // host <Root>/run/<id>
	poolDir  string // host <Root>/pool/<id> while pooled, "" otherwise
	uid      int    // host uid and gid it runs as
	slot     *sandbox.Slot

	// jobs counts live jobs: while any runs, the container is neither
	// released nor replaced after a run (only Destroy, a lost agent or the
	// quota watcher end it).
	jobs atomic.Int32
	// gone is set when a job's quota watcher removed the container or the
	// container died; the session drops it on its next use.
	gone atomic.Bool
	// Under gVisor: monitor lists the sandbox's sessions, and sessions is
	// what the last stray check found (see sessionsBefore), guarded by the
	// owning session's mu.
	monitor  *sessionMonitor
	sessions agent.Sessions
	// died is closed when the watcher learns the container died.
	died     chan struct{}
	diedOnce sync.Once
	// kernelSID is the session ID of its notebook kernel (see
	// agent.Strays), as the stray check reads it: a host ID under runc, the
	// sandbox's own under gVisor. Guarded by the owning session's mu.
	kernelSID int
	// known is what the last stray check read (under runc; see
	// sessionsBefore), guarded by the owning session's mu.
	known agent.SessionCache
	// groups is the process of each thread the last read of the host's
	// /proc saw (see hostThread), guarded by the owning session's mu.
	groups threadGroups
	// warming is set while a warm-up is pending (see warmAsync); used is
	// when a session last used it (UnixNano; 0 while pooled).
	warming atomic.Bool
	used    atomic.Int64
}

// markDied records that the container is dead.
func (c *ctr) markDied() {
	c.gone.Store(true)
	c.diedOnce.Do(func() { close(c.died) })
}

// untilDied is ctx with a timeout that also ends when c dies.
func (c *ctr) untilDied(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	go func() {
		select {
		case <-c.died:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

func (c *ctr) socket() string { return filepath.Join(c.runDir, agent.SocketName) }

func shortID(s string) string {
	if len(s) > 12 {
		return s[:12]
	}
	return s
}

// prepareDir makes dir (if needed) owned by the sandbox uid, mode 0700.
func prepareDir(dir string, uid int) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	if err := os.Lchown(dir, uid, uid); err != nil {
		// Not root: let the sandbox user write through the mode bits.
		return os.Chmod(dir, 0o777)
	}
	return os.Chmod(dir, 0o700)
}

// specFor returns the container configuration: exactly security-cases.md
// §1.2, plus the agent command and the three bind mounts.
func (e *Engine) specFor(r runnerImage, id, workspaceDir, runDir, workspaceLabel string, uid int, dataIsLink bool) (*container.Config, *container.HostConfig) {
	yes := true
	pids := e.o.PidsLimit
	mem, cpus := e.o.Memory, e.o.NanoCPUs
	if res, ok := e.o.Resources[r.Language]; ok {
		mem, cpus = cmp.Or(res.Memory, mem), cmp.Or(res.NanoCPUs, cpus)
	}
	cfg := &container.Config{
		Image:           r.ID,
		User:            fmt.Sprintf("%d:%d", uid, uid),
		Env:             []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/tmp", "LANG=C.UTF-8"},
		WorkingDir:      WorkspacePath,
		Hostname:        "sandbox",
		NetworkDisabled: true,
		StopSignal:      "SIGKILL",
		Entrypoint:      []string{},
		Cmd: []string{AgentPath, "agent", "--socket", agent.SocketDir + "/" + agent.SocketName, "--language", r.Language,
			"--warm-on-request", "--idle-release", e.o.IdleRelease.String()},
		Labels: map[string]string{
			LabelBroker:    "1",
			LabelInstance:  e.o.InstanceID,
			LabelLanguage:  r.Language,
			LabelWorkspace: workspaceLabel,
			LabelID:        id,
			LabelRoot:      e.o.Root,
		},
	}
	mounts := []mount.Mount{
		{
			Type: mount.TypeBind, Source: workspaceDir, Target: WorkspacePath,
			BindOptions: &mount.BindOptions{Propagation: mount.PropagationRPrivate, NonRecursive: true},
		},
		{
			Type: mount.TypeBind, Source: runDir, Target: agent.SocketDir,
			BindOptions: &mount.BindOptions{Propagation: mount.PropagationRPrivate, NonRecursive: true},
		},
		{
			Type: mount.TypeBind, Source: e.o.AgentBinary, Target: AgentPath, ReadOnly: true,
			BindOptions: &mount.BindOptions{Propagation: mount.PropagationRPrivate, NonRecursive: true},
		},
	}
	if !dataIsLink {
		mounts = append(mounts, mount.Mount{
			Type: mount.TypeBind, Source: workspaceDir, Target: DataAlias,
			BindOptions: &mount.BindOptions{Propagation: mount.PropagationRPrivate, NonRecursive: true},
		})
	}
	hc := &container.HostConfig{
		Runtime:        e.o.Runtime,
		NetworkMode:    "none",
		ReadonlyRootfs: true,
		CapDrop:        []string{"ALL"},
		SecurityOpt:    []string{"no-new-privileges:true", "seccomp=" + e.seco},
		Privileged:     false,
		IpcMode:        "private",
		PidMode:        "",
		UTSMode:        "",
		CgroupnsMode:   "private",
		Init:           &yes,
		ShmSize:        16 << 20,
		Tmpfs:          map[string]string{"/tmp": "rw,noexec,nosuid,nodev,size=64m,mode=1777"},
		LogConfig: container.LogConfig{Type: "json-file",
			Config: map[string]string{"max-size": "1m", "max-file": "1"}},
		Resources: container.Resources{
			Memory:     mem,
			MemorySwap: mem,
			NanoCPUs:   cpus,
			PidsLimit:  &pids,
			Ulimits: []*container.Ulimit{
				{Name: "nofile", Soft: 1024, Hard: 1024},
				{Name: "fsize", Soft: 256 << 20, Hard: 256 << 20},
				{Name: "core", Soft: 0, Hard: 0},
			},
		},
		Mounts: mounts,
	}
	e.applyRuntimeLimits(hc)
	return cfg, hc
}

// dataIsLink reports whether the image's /data is a symlink to /mnt/data
// (the runner images have one); it is checked once per image on a created,
// never started container.
func (e *Engine) dataIsLink(ctx context.Context, r runnerImage) bool {
	e.mu.Lock()
	v, ok := e.dataLink[r.ID]
	e.mu.Unlock()
	if ok {
		return v
	}
	// Not cancellable: a create cancelled mid-flight can still leave the
	// container behind with no ID to remove it by.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), removeTimeout)
	defer cancel()
	resp, err := e.cli.ContainerCreate(ctx, &container.Config{
		Image: r.ID, Entrypoint: []string{}, Cmd: []string{"/nonexistent"}, NetworkDisabled: true,
		Labels: map[string]string{LabelBroker: "1", LabelInstance: e.o.InstanceID, LabelRoot: e.o.Root, LabelWorkspace: "probe"},
	}, &container.HostConfig{NetworkMode: "none"}, nil, nil, "")
	if err != nil {
		return false
	}
	defer func() { _ = e.cli.ContainerRemove(ctx, resp.ID, container.RemoveOptions{Force: true}) }()
	st, err := e.cli.ContainerStatPath(ctx, resp.ID, DataAlias)
	v = err == nil && st.Mode&os.ModeSymlink != 0 && strings.TrimSuffix(st.LinkTarget, "/") == WorkspacePath
	e.mu.Lock()
	e.dataLink[r.ID] = v
	e.mu.Unlock()
	return v
}

// startContainer creates and starts a container for lang with workspaceDir
// mounted, running as uid, in slot (which it releases if it fails), and
// waits for its agent.
func (e *Engine) startContainer(ctx context.Context, r runnerImage, workspaceDir, workspaceLabel string, uid int, slot *sandbox.Slot) (*ctr, error) {
	c := &ctr{id: sandbox.NewID(), lang: r.Language, img: r.ID, uid: uid, slot: slot, died: make(chan struct{})}
	c.runDir = filepath.Join(e.o.Root, "run", c.id)
	if err := prepareDir(c.runDir, uid); err != nil {
		slot.Release()
		return nil, fmt.Errorf("docker: run dir: %w", err)
	}
	cfg, hc := e.specFor(r, c.id, workspaceDir, c.runDir, workspaceLabel, uid, e.dataIsLink(ctx, r))
	// The create itself is not cancellable (a cancelled create can leave a
	// container the daemon made but whose ID we never learn); ctx is
	// checked right after it.
	cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), removeTimeout)
	resp, err := e.cli.ContainerCreate(cctx, cfg, hc, nil, nil, "sandbox-"+c.id)
	ccancel()
	if err == nil && ctx.Err() != nil {
		c.dockerID = resp.ID
		_ = e.removeContainer(ctx, c)
		return nil, ctx.Err()
	}
	if err != nil {
		_ = os.RemoveAll(c.runDir)
		slot.Release()
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "cannot create a %s sandbox", r.Language)
	}
	c.dockerID = resp.ID
	e.track(c)
	fail := func(err error) (*ctr, error) {
		_ = e.removeContainer(ctx, c)
		return nil, err
	}
	if err := e.cli.ContainerStart(ctx, c.dockerID, container.StartOptions{}); err != nil {
		return fail(brokererr.Wrap(err, brokererr.Unavailable, "cannot start a %s sandbox", r.Language))
	}
	// Waits end early if the container dies (see watch).
	rctx, cancel := c.untilDied(ctx, e.o.ReadyTimeout)
	err = agentWaitReady(rctx, c.socket())
	cancel()
	if err != nil {
		st := ""
		if ins, ierr := e.cli.ContainerInspect(context.WithoutCancel(ctx), c.dockerID); ierr == nil && ins.State != nil {
			st = fmt.Sprintf("status=%s exit=%d error=%q", ins.State.Status, ins.State.ExitCode, ins.State.Error)
		}
		e.log.Warn().Err(err).Str("container", shortID(c.dockerID)).Str("state", st).Msg("sandbox agent not ready")
		return fail(brokererr.Wrap(err, brokererr.Unavailable, "the %s sandbox did not become ready", r.Language))
	}
	// The language runtime warms up in the background, in its turn: the
	// first run does not wait for it (and it lives in the agent's session,
	// which every stray check counts as existing, see agent/infra.go).
	if c.gone.Load() {
		return fail(brokererr.New(brokererr.Unavailable, "the %s sandbox stopped while starting", r.Language))
	}
	if e.o.Runtime == RuntimeRunsc {
		m, err := e.startSessionMonitor(ctx, c)
		if err != nil {
			return fail(brokererr.Wrap(err, brokererr.Unavailable, "cannot watch the %s sandbox's processes", r.Language))
		}
		c.monitor = m
		e.sessionsBefore(c) // the first stray-check snapshot, off a pooled container's first run
	}
	e.warmAsync(c)
	return c, nil
}

// removeContainer force-removes c and its run dir (not its workspace), and
// gives back its slot (even if removal failed: the orphan sweep of the next
// start removes what is left).
func (e *Engine) removeContainer(ctx context.Context, c *ctr) error {
	c.monitor.close()
	var err error
	if c.dockerID != "" {
		e.untrack(c)
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), removeTimeout)
		err = e.cli.ContainerRemove(rctx, c.dockerID, container.RemoveOptions{Force: true, RemoveVolumes: true})
		cancel()
		if isNotFound(err) {
			err = nil
		}
		if err != nil {
			// The daemon is away: the watcher removes c once it is back.
			c.gone.Store(true)
			e.track(c)
		}
	}
	_ = os.RemoveAll(c.runDir)
	c.slot.Release()
	return err
}

// removeAsync removes c in the background (Close waits for it).
func (e *Engine) removeAsync(c *ctr) {
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		if err := e.removeContainer(context.Background(), c); err != nil {
			e.log.Warn().Err(err).Str("container", shortID(c.dockerID)).Msg("container removal failed")
		}
	}()
}

func isNotFound(err error) bool {
	if err == nil {
		return false
	}
	if cerrdefs.IsNotFound(err) {
		return true
	}
	s := err.Error()
	return strings.Contains(s, "No such container") || strings.Contains(s, "is already in progress")
}

// cgroup v1 paths (cgroupfs driver: /sys/fs/cgroup/<ctrl>/docker/<id>).
var cgroupRoot = "/sys/fs/cgroup"

// oomKills returns the memory cgroup's oom_kill counter, or -1.
func (e *Engine) oomKills(c *ctr) int64 {
	b, err := agent.ReadProcFile(filepath.Join(cgroupRoot, "memory", "docker", c.dockerID, "memory.oom_control"))
	if err != nil {
		return -1
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
			var n int64
			if _, err := fmt.Sscan(v, &n); err == nil {
				return n
			}
		}
	}
	return -1
}
