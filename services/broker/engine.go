package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/docker"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
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

// openEngine starts the sandbox backend. A missing Docker daemon is not
// fatal: the broker serves its other tools, sandbox tools answer
// UNAVAILABLE, and /readyz reports the backend as failing.
func (b *Broker) openEngine(ctx context.Context, cfg config.Config) error {
	if cfg.Backend == "none" {
		return nil
	}
	agentBin, err := installAgent(cfg.Root)
	if err != nil {
		return fmt.Errorf("install the sandbox agent: %w", err)
	}
	eng, err := docker.New(ctx, docker.Options{
		Root:        cfg.Root,
		AgentBinary: agentBin,
		PoolSize:    cfg.PoolSize,
		Memory:      cfg.MemoryMB << 20,
		NanoCPUs:    int64(cfg.CPUs) * 1_000_000,
		PidsLimit:   cfg.PidsLimit,
		Runtime:     cfg.Runtime,
		InstanceID:  instanceID(),
		Log:         logging.Component(b.log, "docker"),
		WorkspaceLimits: workspace.Limits{MaxFiles: cfg.MaxFiles, MaxBytes: cfg.MaxWorkspaceMB << 20,
			MaxFileBytes: min(cfg.MaxWorkspaceMB<<20, 64<<20)},
	})
	if err != nil {
		b.log.Error().Str("backend", cfg.Backend).Str("cause", b.redactor.Message(err.Error(), 300)).Msg("sandbox_backend_unavailable")
		b.checks = append(b.checks, check{"sandbox_backend", func(context.Context) error { return err }})
		return nil
	}
	b.backend = eng
	b.poolStats = func() map[string]int { return eng.Stats().PoolReady }
	b.checks = append(b.checks, check{"sandbox_backend", eng.Ping})
	b.sandboxes, err = sessions.Open(ctx, sessions.Options{
		DBPath:      filepath.Join(cfg.Root, "state.db"),
		Root:        cfg.Root,
		Backend:     eng,
		IdleTimeout: time.Duration(cfg.IdleTimeoutMS) * time.Millisecond,
		MaxAge:      time.Duration(cfg.MaxAgeS) * time.Second,
		OnCreate:    b.reserveSandbox,
		Log:         logging.Component(b.log, "sessions"),
	})
	if err != nil {
		return fmt.Errorf("open sessions: %w", err)
	}
	b.checks = append(b.checks, check{"sessions", b.sandboxes.Ping})
	loops, stop := context.WithCancel(context.Background())
	b.stop = stop
	b.loops.Add(1)
	go func() {
		defer b.loops.Done()
		b.sandboxes.RunReaper(loops, reapEvery(time.Duration(cfg.IdleTimeoutMS)*time.Millisecond))
	}()
	return nil
}

// installAgent copies the broker's own binary (it doubles as the in-sandbox
// agent) to <root>/bin/sandbox-agent and returns that path. Bind mounts are
// resolved by the Docker daemon on the host, so when the broker itself runs
// in a container with SANDBOX_ROOT mounted at the same path, this path is
// valid on both sides while the broker's own executable path is not.
func installAgent(root string) (string, error) {
	exe, err := os.Executable()
	if err == nil {
		exe, err = filepath.EvalSymlinks(exe)
	}
	if err != nil {
		return "", err
	}
	dst := filepath.Join(root, "bin", "sandbox-agent")
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return "", err
	}
	src, err := os.Open(exe)
	if err != nil {
		return "", err
	}
	defer src.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".agent-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, src); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Chmod(0o755); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	// Rename keeps containers that still mount the old inode working.
	return dst, os.Rename(tmp.Name(), dst)
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
	e := &tools.Engine{URLs: b.signer, Exec: b.quota, Limits: b.limits,
		DefaultTimeout: time.Duration(cfg.TimeoutS) * time.Second, MaxTimeout: time.Duration(cfg.MaxTimeoutS) * time.Second}
	if b.sandboxes != nil {
		e.Sessions, e.Backend = b.sandboxes, b.backend
	}
	return e
}

// filesHandler serves signed downloads under /files/.
func (b *Broker) filesHandler() *files.Handler {
	log := logging.Component(b.log, "files")
	return &files.Handler{Signer: b.signer, Root: b.cfg.Root, Log: func(event string, kv ...any) {
		ev := log.Info()
		for i := 0; i+1 < len(kv); i += 2 {
			ev = ev.Interface(fmt.Sprint(kv[i]), kv[i+1])
		}
		ev.Msg(strings.ReplaceAll(event, ".", "_"))
	}}
}

func instanceID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
