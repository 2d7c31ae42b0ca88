// Package broker assembles the MCP server: configuration, stores, the
// middleware chain, the enabled toolsets, and the stdio and HTTP transports.
package broker

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mark3labs/mcp-go/server"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/mcpsessions"
	"github.com/sandbox-broker/sandbox-broker/services/modelgw"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
	"github.com/sandbox-broker/sandbox-broker/services/rootfs"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// Broker is one running sandbox-broker.
type Broker struct {
	cfg         config.Config
	version     string
	started     time.Time
	log         zerolog.Logger
	redactor    *redact.Redactor
	audit       *audit.Log
	auditKeys   audit.Keys // the web console's "verify now"
	quota       *quota.Store
	leader      *statedb.Leader   // which replica runs the background loops
	presence    *statedb.Presence // replicas on PostgreSQL only: this one is running
	metrics     *middleware.Metrics
	pm          *productMetrics
	tokens      *identity.Registry // nil on stdio
	oauth       *brokerOAuth       // nil unless OAuth is on (HTTP only)
	mcp         *server.MCPServer
	tools       []tools.ServerTool
	resources   []tools.ServerResource
	mcpSessions *mcpsessions.Store // MCP session IDs and their owners
	checks      []check
	// Sandbox engine; backend and sandboxes are nil when none is available.
	backend   sandbox.Backend
	sandboxes *sessions.Manager
	jobs      *jobs.Manager
	projects  *projects.Manager // nil without a project provider
	github    *github.Manager   // nil without GITHUB_REPOS_FILE
	signer    *files.Signer
	uids      *uids.Allocator  // sandbox host uids, shared by the engines
	slots     *sandbox.Slots   // the live-container cap, shared likewise
	warmups   *sandbox.Warmups // the sandboxes' background warm-ups, shared likewise
	// Where previews are served, once ListenPreviews bound their listener;
	// previewOff says why there is none.
	preview    atomic.Pointer[previewSite]
	previewOff string
	loopCtx    context.Context
	stop       context.CancelFunc // ends background loops
	loops      sync.WaitGroup     // background loops, waited for on Close
	poolStats  func() map[string]int
	health     healthCache
	egress     egressQuotas
	refusals   *httpRefusals
	decisions  decisionLog // the reaper's and egress proxies', for the operator view

	// Agent tasks: the model gateway's budget store (nil without tasks);
	// the sandbox metrics.
	modelBudget    *modelgw.Budget
	sandboxMetrics *middleware.SandboxMetrics
}

// Options are what the caller supplies besides Config.
type Options struct {
	Version string
	LogOut  io.Writer // stderr by default; never stdout on stdio
	// Notice receives operator messages (where a generated token is kept).
	Notice io.Writer
}

// New opens the stores and builds the server. Close releases them.
func New(ctx context.Context, cfg config.Config, opts Options) (b *Broker, err error) {
	if opts.LogOut == nil {
		opts.LogOut = os.Stderr
	}
	if opts.Notice == nil {
		opts.Notice = os.Stderr
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return nil, fmt.Errorf("create SANDBOX_ROOT: %w", err)
	}
	// Bind mounts and redaction need the absolute path.
	if cfg.Root, err = filepath.Abs(cfg.Root); err != nil {
		return nil, fmt.Errorf("SANDBOX_ROOT: %w", err)
	}
	// Before anything opens a file there: sandboxes must not read Root's
	// host path from their mount table.
	rootView, err := rootfs.Ensure(cfg.Root, cfg.RootOverlay == "auto")
	if err != nil {
		return nil, fmt.Errorf("SANDBOX_ROOT: %w", err)
	}
	nb := &Broker{cfg: cfg, version: opts.Version, started: time.Now(), refusals: newHTTPRefusals(),
		egress: egressQuotas{maxAge: time.Duration(cfg.MaxAgeS) * time.Second}}
	b = nb
	defer func() {
		if err != nil { // b is nil by now: close what was opened
			nb.Close()
		}
	}()

	secrets := cfg.SecretValues()
	repos, ghTokens, err := loadGitHubRepos(cfg)
	if err != nil {
		return nil, err
	}
	secrets = append(secrets, ghTokens...)
	agentKeys, err := loadAgentKeys(cfg)
	if err != nil {
		return nil, err
	}
	for _, k := range agentKeys {
		secrets = append(secrets, k)
	}
	if cfg.Transport == "http" {
		var token string
		if b.tokens, token, err = loadTokens(cfg, opts.Notice); err != nil {
			return nil, err
		}
		secrets = append(secrets, token)
	}
	keys, err := audit.LoadKeys(audit.KeyConfig{Root: cfg.Root, HMACKey: cfg.AuditHMACKey.Reveal(), HMACKeyFile: cfg.AuditHMACKeyFile})
	if err != nil {
		return nil, fmt.Errorf("audit keys: %w", err)
	}
	secrets = append(secrets, string(keys.HMACKey), hex.EncodeToString(keys.HMACKey))
	b.auditKeys = keys
	fileKeys, err := b.openSigner(cfg)
	if err != nil {
		return nil, err
	}
	secrets = append(secrets, fileKeys...)
	b.redactor = redact.New(secrets, hostRoots(cfg.Root))
	b.log = logging.New(opts.LogOut, cfg.LogLevel, b.redactor)
	if rootView.Private {
		b.log.Info().Bool("mounted_now", rootView.Mounted).Msg("sandbox_root_private")
	} else if cfg.Backend != "none" {
		b.log.Warn().Str("reason", rootView.Exposed).Msg("sandbox_root_exposed")
	}

	if b.audit, err = audit.Open(ctx, audit.Options{
		Path: cfg.AuditPath(), CheckpointPath: filepath.Join(cfg.Root, "audit.checkpoints"), Keys: keys,
	}); err != nil {
		return nil, fmt.Errorf("open audit log: %w", err)
	}
	if b.quota, err = quota.Open(ctx, cfg.StatePath(), nil); err != nil {
		return nil, fmt.Errorf("open state store: %w", err)
	}
	if b.leader, err = statedb.NewLeader(cfg.StatePath()); err != nil {
		return nil, fmt.Errorf("open state store: %w", err)
	}
	if err := b.openPresence(ctx, cfg); err != nil {
		return nil, fmt.Errorf("open state store: %w", err)
	}
	if b.mcpSessions, err = mcpsessions.Open(ctx, cfg.StatePath(), nil); err != nil {
		return nil, fmt.Errorf("open state store: %w", err)
	}
	b.lead(10*time.Minute, b.mcpSessions.Prune)
	b.metrics = middleware.NewMetrics()
	b.sandboxMetrics = b.metrics.NewSandboxMetrics(func() int {
		if b.sandboxes == nil {
			return 0
		}
		return b.sandboxes.Active()
	})
	b.pm = b.registerMetrics(b.metrics.Registry)
	b.checks = []check{{"audit_log", b.audit.Ping}, {"state_store", b.quota.Ping}, {"storage", storageCheck(cfg.Root)}}
	if err := b.openOAuth(ctx, cfg); err != nil {
		return nil, fmt.Errorf("oauth: %w", err)
	}
	if err := b.openEngine(ctx, cfg); err != nil {
		return nil, err
	}

	if err := b.openGitHub(ctx, cfg, repos); err != nil {
		return nil, err
	}
	eng := b.engine(cfg)
	runs := &tools.Jobs{Engine: eng, Jobs: b.jobs, Egress: b.egressFor}
	gh, sf := b.githubDeps()
	tasks, err := b.openTasks(ctx, cfg, runs, agentKeys, b.backend != nil && b.backend.Name() == "docker")
	if err != nil {
		return nil, err
	}
	deps := tools.Deps{Usage: b.quota, Limits: b.limits, Engine: eng,
		Jobs: runs, Projects: &tools.Projects{Manager: b.projects, Runs: runs, BuildWait: time.Duration(cfg.BuildWaitS) * time.Second, Redact: b.redactor.String},
		GitHub: gh, SessionFiles: sf, Tasks: tasks}
	group := tools.DefaultGroup(deps)
	b.markUnconfigured(group, cfg, tasks)
	if b.tools, err = group.Enable(cfg.Toolsets, cfg.ReadOnly); err != nil {
		return nil, err
	}
	b.resources = group.Resources(cfg.Toolsets)
	b.mcp = b.newMCPServer()
	b.log.Info().Str("transport", cfg.Transport).Int("tools", len(b.tools)).Bool("read_only", cfg.ReadOnly).Msg("broker_ready")
	return b, nil
}

func (b *Broker) limits(p identity.Principal) quota.Limits {
	return quota.LimitsFor(p.Tier, b.cfg.RateLimitPerMinute)
}

func (b *Broker) newMCPServer() *server.MCPServer {
	specs := map[string]middleware.ArgSpec{}
	for _, t := range b.tools {
		specs[t.Tool.Name] = t.Args
	}
	for _, r := range b.resources {
		specs[r.Read.Tool.Name] = r.Read.Args
	}
	chain := b.toolChain(specs)
	opts := []server.ServerOption{
		server.WithToolCapabilities(false),
		server.WithResourceCapabilities(false, false),
		// Execution output streams as log messages at the client's level.
		server.WithLogging(),
		server.WithInstructions("sandbox-broker runs code in hardened sandboxes. Call get_usage to see your limits."),
	}
	// Outermost, as a last resort: a panic in the chain itself becomes a
	// JSON-RPC error, not a crash (handler panics are caught inside).
	opts = append(opts, server.WithRecovery())
	for _, mw := range chain {
		opts = append(opts, server.WithToolHandlerMiddleware(mw))
	}
	s := server.NewMCPServer("sandbox-broker", b.version, opts...)
	for _, t := range b.tools {
		s.AddTool(t.Tool, t.Handler)
	}
	// Resource reads get the tool chain too; mcp-go applies tool middleware
	// only to tools, so it is composed here, outermost first.
	for _, r := range b.resources {
		h := r.Read.Handler
		for i := len(chain) - 1; i >= 0; i-- {
			h = chain[i](h)
		}
		s.AddResourceTemplate(r.Template, r.Handler(h))
	}
	b.addHealthResource(s)
	return s
}

// toolChain is the middleware every tool call goes through, for tools
// with the given argument specs.
func (b *Broker) toolChain(specs map[string]middleware.ArgSpec) []server.ToolHandlerMiddleware {
	return middleware.Chain(middleware.Deps{
		Specs:    func(name string) (middleware.ArgSpec, bool) { s, ok := specs[name]; return s, ok },
		Limits:   b.limits,
		Limiter:  b.quota,
		Audit:    b.auditor(),
		Metrics:  b.metrics,
		Redactor: b.redactor,
		Log:      logging.Component(b.log, "tools"),
		// 5 rows/s with a burst of 50 per principal keeps every refusal of
		// normal clients while bounding a flood.
		Rejections: middleware.NewRejectionThrottle(5, 50),
	})
}

// MCPServer exposes the assembled server, for in-process clients in tests.
func (b *Broker) MCPServer() *server.MCPServer { return b.mcp }

// Close stops sandboxes, flushes a final audit checkpoint and closes the stores.
func (b *Broker) Close() error {
	var errs []error
	if b.stop != nil {
		b.stop()
	}
	b.loops.Wait() // the reaper must not touch stores being closed
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// Jobs first: they run in the sessions' sandboxes.
	if b.jobs != nil {
		errs = append(errs, b.jobs.Close(ctx))
	}
	if b.sandboxes != nil {
		errs = append(errs, b.sandboxes.Close(ctx))
	}
	if b.projects != nil {
		errs = append(errs, b.projects.Provider().Close(ctx), b.projects.Close())
	}
	if b.backend != nil {
		errs = append(errs, b.backend.Close(ctx))
	}
	if b.uids != nil { // after the engines, which free warm containers' uids
		errs = append(errs, b.uids.Close())
	}
	errs = append(errs, b.closeOAuth())
	if b.audit != nil {
		errs = append(errs, b.audit.Close())
	}
	if b.quota != nil {
		errs = append(errs, b.quota.Close())
	}
	if b.modelBudget != nil {
		errs = append(errs, b.modelBudget.Close())
	}
	if b.mcpSessions != nil {
		errs = append(errs, b.mcpSessions.Close())
	}
	if b.leader != nil {
		errs = append(errs, b.leader.Close())
	}
	if b.presence != nil {
		errs = append(errs, b.presence.Close())
	}
	return errors.Join(errs...)
}

// loadTokens builds the HTTP token registry from MCP_TOKENS_FILE and
// MCP_API_TOKEN, or generates a token on first start.
func loadTokens(cfg config.Config, notice io.Writer) (*identity.Registry, string, error) {
	var entries []identity.TokenEntry
	if cfg.TokensFile != "" {
		e, err := identity.LoadTokensFile(cfg.TokensFile)
		if err != nil {
			return nil, "", fmt.Errorf("MCP_TOKENS_FILE: %w", err)
		}
		entries = e
	}
	token := cfg.APIToken.Reveal()
	if token == "" && len(entries) == 0 {
		t, created, err := identity.LoadOrCreateToken(cfg.Root)
		if err != nil {
			return nil, "", fmt.Errorf("generated API token: %w", err)
		}
		token = t
		verb := "Using the"
		if created {
			verb = "Generated an"
		}
		fmt.Fprintf(notice, "sandbox-broker: %s API token, kept in %s (mode 0600). Send it as 'Authorization: Bearer <token>'.\n",
			verb, filepath.Join(cfg.Root, identity.TokenFileName))
	}
	if token != "" {
		entries = append(entries, identity.TokenEntry{Principal: cfg.APIPrincipal, Tier: cfg.APITier, TokenSHA256: identity.HashToken(token)})
	}
	r, err := identity.NewRegistry(entries)
	if err != nil {
		return nil, "", fmt.Errorf("tokens: %w", err)
	}
	return r, token, nil
}

// hostRoots are the host paths error messages must never reveal.
func hostRoots(root string) []string {
	out := []string{root}
	if wd, err := os.Getwd(); err == nil {
		out = append(out, wd)
	}
	if home, err := os.UserHomeDir(); err == nil {
		out = append(out, home)
	}
	return out
}
