package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/docker"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/process"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/projects/local"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// openSigner sets up signed download links from FILE_SECRET (or a secret
// generated into SANDBOX_ROOT) and returns the key material to redact.
func (b *Broker) openSigner(cfg config.Config) ([]string, error) {
	active := []byte(cfg.FileSecret.Reveal())
	if len(active) == 0 {
		var err error
		if active, err = files.LoadOrCreateSecret(cfg.Root); err != nil {
			return nil, fmt.Errorf("file URL secret: %w", err)
		}
	}
	var prev [][]byte
	if p := cfg.FileSecretPrev.Reveal(); p != "" {
		prev = append(prev, []byte(p))
	}
	ring, err := files.NewKeyring(active, prev...)
	if err != nil {
		return nil, fmt.Errorf("FILE_SECRET: %w", err)
	}
	b.signer = &files.Signer{Keys: ring, BaseURL: cfg.PublicBaseURL, TTL: time.Duration(cfg.FileURLTTLS) * time.Second}
	return []string{string(active), hex.EncodeToString(active)}, nil
}

// openEngine starts the sandbox backend, the session and job stores and
// the project provider. A backend the operator named (docker, process)
// must start, or the broker does not; with auto, a missing backend is not
// fatal: the broker serves its other tools, the sandbox tools are not
// listed, and /readyz reports the backend as failing.
func (b *Broker) openEngine(ctx context.Context, cfg config.Config) error {
	if cfg.Backend == "none" { // hosted project sandboxes still work
		return b.openProjects(ctx, cfg, "", false)
	}
	agentBin, alone, err := installAgent(cfg.Root)
	if err != nil {
		return fmt.Errorf("install the sandbox agent: %w", err)
	}
	// Without the agent built alone, sandboxes start tens of milliseconds
	// slower (`make build` builds both).
	b.log.Info().Bool("built_alone", alone).Msg("sandbox_agent_installed")
	if b.uids, err = uids.Open(ctx, cfg.StatePath(), cfg.SandboxUID, cfg.SandboxUIDs); err != nil {
		return fmt.Errorf("SANDBOX_UID/SANDBOX_UIDS: %w", err)
	}
	b.slots = sandbox.NewSlots(cfg.MaxContainers)
	// Preloads (a CPU-second each) yield to sandbox starts and use at most
	// half the CPUs.
	b.warmups = sandbox.NewWarmups(runtime.NumCPU()/2, 500*time.Millisecond)
	eng, dockerOK, err := b.openBackend(ctx, cfg, agentBin)
	if err != nil && cfg.Backend != "auto" {
		return fmt.Errorf("SANDBOX_BACKEND=%s cannot be used (set SANDBOX_BACKEND=auto to start without it): %s", cfg.Backend, causeText(b.redactor, err, 300))
	}
	if err != nil {
		b.log.Error().Str("backend", cfg.Backend).Str("cause", causeText(b.redactor, err, 300)).Msg("sandbox_backend_unavailable")
		b.checks = append(b.checks, check{"sandbox_backend", func(context.Context) error { return err }})
		return b.openProjects(ctx, cfg, agentBin, false)
	}
	b.backend = eng
	b.checks = append(b.checks, check{"sandbox_backend", eng.Ping})
	b.sandboxes, err = sessions.Open(ctx, sessions.Options{
		DBPath:      cfg.StatePath(),
		Root:        cfg.Root,
		Backend:     eng,
		IdleTimeout: time.Duration(cfg.IdleTimeoutMS) * time.Millisecond,
		MaxAge:      time.Duration(cfg.MaxAgeS) * time.Second,
		OnCreate:    b.reserveSandbox,
		OnReap:      b.decisions.reaped,
		Log:         logging.Component(b.log, "sessions"),
	})
	if err != nil {
		return fmt.Errorf("open sessions: %w", err)
	}
	b.checks = append(b.checks, check{"sessions", b.sandboxes.Ping})
	if b.jobs, err = jobs.Open(ctx, jobs.Options{
		DBPath:        cfg.StatePath(),
		Dir:           filepath.Join(cfg.Root, "jobs"),
		MaxConcurrent: cfg.MaxConcurrent,
		MaxPerSession: cfg.MaxPerSession,
		LogMaxBytes:   cfg.JobLogMaxBytes,
		Log:           logging.Component(b.log, "jobs"),
		Presence:      b.presence,
	}); err != nil {
		return fmt.Errorf("open jobs: %w", err)
	}
	b.checks = append(b.checks, check{"jobs", b.jobs.Ping})
	b.lead(time.Hour, b.jobs.Prune)
	reap := reapEvery(time.Duration(cfg.IdleTimeoutMS) * time.Millisecond)
	b.every(reap, b.sandboxes.ReleaseIdle)
	b.lead(reap, b.sandboxes.Expire)
	return b.openProjects(ctx, cfg, agentBin, dockerOK)
}

// loop runs fn in the background until Close.
func (b *Broker) loop(fn func(context.Context)) {
	if b.stop == nil {
		b.loopCtx, b.stop = context.WithCancel(context.Background())
	}
	b.loops.Add(1)
	go func() {
		defer b.loops.Done()
		fn(b.loopCtx)
	}()
}

// presenceEvery is how often a replica re-checks (and after a PostgreSQL
// restart, re-takes) the lock that tells the others it is running.
const presenceEvery = 10 * time.Second

// openPresence announces this broker to its replicas on PostgreSQL, so the
// leader closes out a replica's jobs only once that replica is gone.
func (b *Broker) openPresence(ctx context.Context, cfg config.Config) error {
	if !statedb.IsPostgresURL(cfg.StatePath()) {
		return nil
	}
	p, err := statedb.NewPresence(cfg.StatePath(), instanceID())
	if err != nil {
		return err
	}
	if !p.Keep(ctx) {
		p.Close()
		return errors.New("cannot take this replica's presence lock")
	}
	b.presence = p
	b.every(presenceEvery, func(ctx context.Context) {
		if !p.Keep(ctx) {
			b.log.Warn().Msg("replica_presence_lost")
		}
	})
	return nil
}

// lead runs fn each interval, in the background, until Close, on the
// replica that leads: work on the shared state that one replica does for
// all (with SQLite, every broker leads).
func (b *Broker) lead(interval time.Duration, fn func(context.Context)) {
	b.every(interval, b.ifLeading(fn))
}

// sweep is lead for a sweep that also runs once at start.
func (b *Broker) sweep(interval time.Duration, fn func(context.Context)) {
	b.loop(b.ifLeading(fn))
	b.lead(interval, fn)
}

// ifLeading is fn, run only while this replica leads.
func (b *Broker) ifLeading(fn func(context.Context)) func(context.Context) {
	return func(ctx context.Context) {
		if b.leader == nil || b.leader.Lead(ctx) {
			fn(ctx)
		}
	}
}

// every runs fn each interval, in the background, until Close.
func (b *Broker) every(interval time.Duration, fn func(context.Context)) {
	b.loop(func(ctx context.Context) {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				fn(ctx)
			}
		}
	})
}

// openBackend starts the configured backend; "auto" prefers Docker and
// falls back to the process sandbox when no daemon answers, so a fresh
// machine works out of the box. dockerOK says Docker is the backend.
func (b *Broker) openBackend(ctx context.Context, cfg config.Config, agentBin string) (sandbox.Backend, bool, error) {
	if cfg.Backend == "kubernetes" {
		eng, err := b.openKube(ctx, cfg)
		if err != nil {
			return nil, false, err
		}
		return eng, false, nil
	}
	if cfg.Backend == "codesandbox" {
		return b.openHosted(ctx, cfg, agentBin)
	}
	if cfg.Backend == "docker" || cfg.Backend == "auto" {
		eng, err := b.openDocker(ctx, cfg, agentBin)
		if err == nil {
			b.poolStats = func() map[string]int { return eng.Stats().PoolReady }
			return eng, true, nil
		}
		if cfg.Backend == "docker" {
			return nil, false, err
		}
		b.log.Warn().Str("cause", causeText(b.redactor, err, 300)).Msg("docker_unavailable_using_process_backend")
	}
	eng, err := process.New(ctx, process.Options{
		Root:        cfg.Root,
		RunnersDir:  cfg.RunnersDir,
		Languages:   agent.RunLanguages,
		AgentBinary: agentBin,
		UIDs:        b.uids,
		MemoryBytes: cfg.MemoryMB << 20,
		PidsLimit:   cfg.PidsLimit,
		CPUMilli:    int64(cfg.CPUs),
		IdleRelease: time.Duration(cfg.IdleReleaseMS) * time.Millisecond,
		Warmups:     b.warmups,
		Log:         b.log, // the backend names its component
		WorkspaceLimits: workspace.Limits{MaxFiles: cfg.MaxFiles, MaxBytes: cfg.MaxWorkspaceMB << 20,
			MaxFileBytes: min(cfg.MaxWorkspaceMB<<20, 64<<20)},
	})
	return eng, false, err
}

// openDocker starts the Docker engine.
func (b *Broker) openDocker(ctx context.Context, cfg config.Config, agentBin string) (*docker.Engine, error) {
	o := docker.Options{
		Root:            cfg.Root,
		AgentBinary:     agentBin,
		PoolSize:        cfg.PoolSize,
		Memory:          cfg.MemoryMB << 20,
		NanoCPUs:        int64(cfg.CPUs) * 1_000_000,
		PidsLimit:       cfg.PidsLimit,
		Runtime:         cfg.Runtime,
		InstanceID:      instanceID(),
		Languages:       agent.RunLanguages,
		UIDs:            b.uids,
		Slots:           b.slots,
		IdleTimeout:     time.Duration(cfg.IdleTimeoutMS) * time.Millisecond,
		IdleRelease:     time.Duration(cfg.IdleReleaseMS) * time.Millisecond,
		Warmups:         b.warmups,
		OnAcquire:       b.pm.acquired,
		Log:             b.log, // the engine names its component
		WorkspaceLimits: workspaceLimits(cfg),
	}
	agentEngineOptions(cfg, &o)
	return docker.New(ctx, o)
}

func workspaceLimits(cfg config.Config) workspace.Limits {
	return workspace.Limits{MaxFiles: cfg.MaxFiles, MaxBytes: cfg.MaxWorkspaceMB << 20, MaxFileBytes: min(cfg.MaxWorkspaceMB<<20, 64<<20)}
}

// installAgent copies the agent binary (agent.Binary: the agent built alone
// beside the broker's executable, else the broker's own binary, whose agent
// command is the same agent) to <root>/bin/sandbox-agent and returns that
// path, and whether it is the agent built alone. Bind mounts are
// resolved by the Docker daemon on the host, so when the broker itself runs
// in a container with SANDBOX_ROOT mounted at the same path, this path is
// valid on both sides while the broker's own executable path is not.
func installAgent(root string) (dst string, alone bool, err error) {
	exe, err := os.Executable()
	if err == nil {
		exe, err = filepath.EvalSymlinks(exe)
	}
	if err != nil {
		return "", false, err
	}
	dst = filepath.Join(root, "bin", agent.BinaryName)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return "", false, err
	}
	src := agent.Binary(exe)
	return dst, src != exe, agent.Install(src, dst)
}

// reapEvery checks often enough that a session is released within about a
// tenth of its idle timeout, but at most once a second.
func reapEvery(idle time.Duration) time.Duration {
	d := idle / 10
	if d < time.Second {
		d = time.Second
	}
	if d > time.Minute {
		d = time.Minute
	}
	return d
}

// reserveSandbox applies the sandboxes-per-hour quota to a new session.
func (b *Broker) reserveSandbox(ctx context.Context, principal string) error {
	p, ok := identity.FromContext(ctx)
	if !ok || p.ID != principal {
		return brokererr.New(brokererr.Unauthenticated, "the call carries no authenticated principal")
	}
	dec, err := b.quota.ReserveSandbox(ctx, principal, b.limits(p))
	if err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "quota store unavailable")
	}
	if !dec.Allowed {
		return brokererr.New(brokererr.QuotaExceeded, "sandbox quota of %d per hour is used up", dec.Limit).WithRetryAfter(dec.RetryAfter)
	}
	return nil
}

func (b *Broker) engine(cfg config.Config) *tools.Engine {
	e := &tools.Engine{URLs: b.signer, Exec: b.quota, Limits: b.limits, Redact: b.redactor.String, Metrics: b.sandboxMetrics,
		DefaultTimeout: time.Duration(cfg.TimeoutS) * time.Second, MaxTimeout: time.Duration(cfg.MaxTimeoutS) * time.Second,
		MaxLinkBytes: linkCap(cfg)}
	if b.sandboxes != nil {
		e.Sessions, e.Backend = b.sandboxes, b.backend
	}
	return e
}

// filesHandler serves signed downloads and uploads under /files/.
func (b *Broker) filesHandler() *files.Handler {
	log := logging.Component(b.log, "files")
	h := &files.Handler{Signer: b.signer, Root: b.cfg.Root, Log: func(event string, kv ...any) {
		var ev *zerolog.Event
		if event == "files.denied" { // anyone can cause these: throttled
			ev = b.refusalLog(event, log.Info)
		} else {
			ev = log.Info()
		}
		for i := 0; i+1 < len(kv); i += 2 {
			ev = ev.Interface(fmt.Sprint(kv[i]), kv[i+1])
		}
		ev.Msg(strings.ReplaceAll(event, ".", "_"))
	}}
	h.Limits = workspace.Limits{MaxFiles: b.cfg.MaxFiles, MaxBytes: b.cfg.MaxWorkspaceMB << 20}
	h.MaxFileBytes = linkCap(b.cfg)
	h.UploadGrace, h.UploadMinRate = time.Duration(b.cfg.BodyTimeoutS)*time.Second, b.cfg.FileUploadMinKBps<<10
	h.Audit = b.auditUpload
	return h
}

// linkCap is FILE_URL_MAX_MB, or the workspace quota when unset.
func linkCap(cfg config.Config) int64 {
	if cfg.FileURLMaxMB > 0 {
		return cfg.FileURLMaxMB << 20
	}
	return cfg.MaxWorkspaceMB << 20
}

func instanceID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// openProjects picks the project provider: CodeSandbox with CSB_API_KEY,
// else the local Docker engine; with neither, the project tools are not
// listed.
func (b *Broker) openProjects(ctx context.Context, cfg config.Config, agentBin string, dockerOK bool) error {
	var p projects.Provider
	var err error
	switch {
	case cfg.CSBAPIKey.Reveal() != "":
		var tpl map[string]codesandbox.Template
		if tpl, err = codesandbox.ParseTemplates(cfg.CSBTemplates); err != nil {
			return err
		}
		p, err = codesandbox.NewProvider(codesandbox.ProviderOptions{
			API:       b.csbAPI(cfg),
			Templates: tpl,
			Log:       b.log,
		})
	case dockerOK:
		p, err = local.New(ctx, local.Options{
			Root:        filepath.Join(cfg.Root, "projects"),
			AgentBinary: agentBin,
			Link:        b.previewLink,
			Runtime:     cfg.Runtime,
			UIDs:        b.uids,
			Slots:       b.slots,
			Log:         b.log, // the provider names its component
		})
	default:
		return nil
	}
	if err != nil {
		b.log.Error().Str("cause", causeText(b.redactor, err, 300)).Msg("project_provider_unavailable")
		b.checks = append(b.checks, check{"projects", func(context.Context) error { return err }})
		return nil
	}
	if b.projects, err = projects.Open(ctx, projects.Options{
		DBPath: cfg.StatePath(), Provider: p, Log: logging.Component(b.log, "projects"),
	}); err != nil {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		_ = p.Close(cctx)
		cancel()
		return fmt.Errorf("open projects: %w", err)
	}
	b.checks = append(b.checks, check{"projects", b.projects.Ping})
	b.lead(time.Minute, b.projects.Reap)
	// Hosted sandboxes with the broker's tag but no row: at start, then
	// now and then (a no-op for providers that cannot sweep).
	b.sweep(30*time.Minute, b.projects.Sweep)
	return nil
}
