package codesandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// UniversalTemplate is the SDK's default template, the universal image
// ("Universal template created 2025-06-05", codesandbox-api.md §2.4).
const UniversalTemplate = "pcz35m"

// agentPort is the in-VM agent's own port; it is never a preview.
const agentPort = 57468

// DefaultWorkspacePath is where project files live in a VM when the start
// response does not say (§2.3 user_workspace_path).
const DefaultWorkspacePath = "/project/workspace"

// Template says which CodeSandbox template a project template forks and
// which port its dev server listens on.
type Template struct {
	ID   string `json:"id"` // sandbox ID, template tag (pt_…) or alias (namespace@alias)
	Port int    `json:"port"`
}

// ParseTemplates reads CSB_TEMPLATES: a JSON object from project template
// name to Template. Unknown names and fields are refused; NewProvider
// checks the values.
func ParseTemplates(s string) (map[string]Template, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	var m map[string]Template
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("CSB_TEMPLATES: %w", err)
	}
	for name := range m {
		if !slices.Contains(projects.Templates, name) {
			return nil, fmt.Errorf("CSB_TEMPLATES: unknown project template %q (have %s)", name, strings.Join(projects.Templates, ", "))
		}
	}
	return m, nil
}

// DefaultTemplates: the reference documents no per-framework template IDs,
// so every project forks the universal image and the broker writes the
// files. Operators should build their own templates (with a dev task and
// installed dependencies) and set them in ProviderOptions.Templates.
var DefaultTemplates = map[string]Template{
	"react": {ID: UniversalTemplate, Port: 5173},
	"next":  {ID: UniversalTemplate, Port: 3000},
	"vue":   {ID: UniversalTemplate, Port: 5173},
	"node":  {ID: UniversalTemplate, Port: 3000},
}

// BuildCommand is what Build runs in the workspace.
const BuildCommand = "npm run build"

// ProviderOptions configure the CodeSandbox provider.
type ProviderOptions struct {
	API Options // API.Log is replaced by Log
	// Templates override DefaultTemplates per project template.
	Templates map[string]Template
	// Tier of new VMs. Default "Pico", the smallest tier (1–2 vCPU and
	// 1–2 GiB depending on the source, §6.2): the closest CodeSandbox has
	// to projects.MemoryBytes (512 MiB) and projects.NanoCPUs (half a CPU).
	Tier string
	// HibernationTimeout is the VM's idle timeout (default 10 minutes).
	HibernationTimeout time.Duration
	// PreviewDomain is the preview host suffix (default "csb.app";
	// "csb.dev" on staging).
	PreviewDomain string
	// PublicPreviews makes previews reachable without a token. Default
	// false: sandboxes are private with private previews (§2.5).
	PublicPreviews bool
	// Tag marks the broker's sandboxes; Open refuses untagged ones and
	// Sweep deletes tagged ones the broker does not know. Default
	// "sandbox-broker".
	Tag string
	// SweepGrace is how old a sandbox must be before Sweep may delete it
	// (default 15 minutes).
	SweepGrace time.Duration
	// MaxOutputBytes bounds a build's output (default 1 MiB).
	MaxOutputBytes int
	Pitcher        PitcherOptions
	Log            zerolog.Logger
}

// Provider is projects.Provider on hosted CodeSandbox VMs.
type Provider struct {
	c   *Client
	o   ProviderOptions
	log zerolog.Logger

	mu     sync.Mutex
	vms    map[string]*vm
	closed bool
}

var (
	_ projects.Provider = (*Provider)(nil)
	_ projects.Sandbox  = (*sandbox)(nil)
)

// NewProvider checks o and returns the provider. It makes no call.
func NewProvider(o ProviderOptions) (*Provider, error) {
	o.API.Log = o.Log // one logger for the provider and its client
	c, err := New(o.API)
	if err != nil {
		return nil, err
	}
	tpl := maps.Clone(DefaultTemplates)
	maps.Copy(tpl, o.Templates)
	for name, t := range tpl {
		if !ValidTemplateRef(t.ID) || t.Port < 1 || t.Port > 65535 {
			return nil, fmt.Errorf("codesandbox: template %q: invalid ID or port", name)
		}
	}
	o.Templates = tpl
	if o.Tier == "" {
		o.Tier = Tiers[0]
	}
	if !slices.Contains(Tiers, o.Tier) {
		return nil, fmt.Errorf("codesandbox: unknown tier %q", o.Tier)
	}
	if o.HibernationTimeout <= 0 {
		o.HibernationTimeout = 10 * time.Minute
	}
	if s := int(o.HibernationTimeout / time.Second); s < 1 || s > 86400 {
		return nil, errors.New("codesandbox: HibernationTimeout must be 1s–24h")
	}
	if o.PreviewDomain == "" {
		o.PreviewDomain = "csb.app"
	}
	if o.Tag == "" {
		o.Tag = "sandbox-broker"
	}
	if o.SweepGrace <= 0 {
		o.SweepGrace = defaultSweepGrace
	}
	if o.MaxOutputBytes <= 0 {
		o.MaxOutputBytes = defaultMaxShellOutput
	}
	return &Provider{c: c, o: o, log: o.Log.With().Str("component", "codesandbox").Logger(), vms: map[string]*vm{}}, nil
}

// Client is the provider's management API client.
func (p *Provider) Client() *Client { return p.c }

// Name is the provider's name.
func (p *Provider) Name() string { return "codesandbox" }

// Ping makes the cheapest authenticated call.
func (p *Provider) Ping(ctx context.Context) error {
	_, err := p.c.MetaInfo(ctx)
	return err
}

func (p *Provider) startOptions() StartOptions {
	return StartOptions{
		Tier:                      p.o.Tier,
		HibernationTimeoutSeconds: int(p.o.HibernationTimeout / time.Second),
		AutomaticWakeupConfig:     &WakeupConfig{HTTP: true, WebSocket: false},
	}
}

func (p *Provider) templateTag(name string) string { return p.o.Tag + "-template-" + name }

// Create forks the template with the VM started in the same call, joins
// the agent and writes the files. A half-made sandbox is deleted.
func (p *Provider) Create(ctx context.Context, req projects.CreateRequest) (projects.Sandbox, error) {
	tpl, ok := p.o.Templates[req.Template]
	if !ok {
		return nil, brokererr.New(brokererr.InvalidInput, "unknown template %q (have %s)", req.Template, strings.Join(slices.Sorted(maps.Keys(p.o.Templates)), ", "))
	}
	for rel := range req.Files {
		if _, err := workspace.ValidatePath(rel, projects.ForbiddenPrefixes...); err != nil {
			return nil, err
		}
	}
	if err := p.checkOpen(); err != nil {
		return nil, err
	}
	privacy, privatePreview := PrivacyPrivate, !p.o.PublicPreviews
	so := p.startOptions()
	fr, err := p.c.Fork(ctx, tpl.ID, ForkRequest{
		Title:          cleanText(req.ProjectName, 255),
		Privacy:        &privacy,
		PrivatePreview: &privatePreview,
		Path:           "/" + p.o.Tag,
		Tags:           []string{p.o.Tag, p.templateTag(req.Template)},
		StartOptions:   &so,
	})
	if err != nil {
		return nil, err
	}
	v := &vm{id: fr.ID, template: req.Template}
	done := false
	defer func() {
		if !done {
			p.cleanup(ctx, fr.ID)
		}
	}()
	start := fr.StartResponse
	if start == nil {
		if start, err = p.c.Start(ctx, fr.ID, so); err != nil {
			return nil, err
		}
	}
	conn, err := p.dial(ctx, start)
	if err != nil {
		return nil, err
	}
	v.conn, v.workspace = conn, start.Workspace()
	if err := p.register(v); err != nil {
		_ = conn.Close()
		return nil, err
	}
	s := &sandbox{p: p, v: v}
	if err := s.WriteFiles(ctx, req.Files); err != nil {
		return nil, err
	}
	done = true
	p.log.Info().Str("sandbox_id", fr.ID).Str("template", req.Template).Str("bootup_type", start.BootupType).
		Int("files", len(req.Files)).Msg("csb_sandbox_created")
	return s, nil
}

// cleanup deletes a sandbox whose creation failed, even if ctx ended.
func (p *Provider) cleanup(ctx context.Context, id string) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	if err := p.Destroy(cctx, id); err != nil {
		p.log.Error().Err(err).Str("sandbox_id", id).Msg("csb_cleanup_failed")
	}
}

// Open returns a sandbox this provider created. It makes one call (GET
// /sandbox/{id}) unless the sandbox is cached, and refuses sandboxes
// without the broker's tag, so a guessed public sandbox ID is "not found".
func (p *Provider) Open(ctx context.Context, id string) (projects.Sandbox, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	if err := p.checkOpen(); err != nil {
		return nil, err
	}
	p.mu.Lock()
	v := p.vms[id]
	p.mu.Unlock()
	if v != nil {
		return &sandbox{p: p, v: v}, nil
	}
	sb, err := p.c.GetSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	if sb.ID != id || !slices.Contains(sb.Tags, p.o.Tag) {
		return nil, brokererr.New(brokererr.SandboxNotFound, "no sandbox with that ID")
	}
	v = &vm{id: id}
	for name := range p.o.Templates {
		if slices.Contains(sb.Tags, p.templateTag(name)) {
			v.template = name
		}
	}
	if err := p.register(v); err != nil {
		return nil, err
	}
	p.mu.Lock()
	v = p.vms[id] // a concurrent Open may have won
	p.mu.Unlock()
	return &sandbox{p: p, v: v}, nil
}

// Destroy shuts the VM down and deletes the sandbox; missing is no error.
func (p *Provider) Destroy(ctx context.Context, id string) error {
	if !ValidSandboxID(id) {
		return nil
	}
	p.mu.Lock()
	v := p.vms[id]
	delete(p.vms, id)
	p.mu.Unlock()
	if v != nil {
		v.close()
	}
	if err := p.c.Shutdown(ctx, id); err != nil && brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		return err
	}
	if err := p.c.Delete(ctx, id); err != nil && brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		return err
	}
	p.log.Info().Str("sandbox_id", id).Msg("csb_sandbox_destroyed")
	return nil
}

// Close drops every agent connection. Sandboxes stay; their TTL is the
// projects layer's business.
func (p *Provider) Close(ctx context.Context) error {
	p.mu.Lock()
	p.closed = true
	vms := slices.Collect(maps.Values(p.vms))
	p.vms = map[string]*vm{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	for _, v := range vms {
		wg.Go(v.close)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *Provider) checkOpen() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return brokererr.New(brokererr.Unavailable, "the CodeSandbox provider is shutting down")
	}
	return nil
}

func (p *Provider) register(v *vm) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return brokererr.New(brokererr.Unavailable, "the CodeSandbox provider is shutting down")
	}
	if _, ok := p.vms[v.id]; !ok {
		p.vms[v.id] = v
	}
	return nil
}

func (p *Provider) dial(ctx context.Context, start *StartResponse) (*Pitcher, error) {
	o := p.o.Pitcher
	// From the caller's logger: DialPitcher adds its own component, and
	// p.log's would give every event two "component" keys.
	o.Log = p.o.Log.With().Str("sandbox_id", start.ID).Logger()
	conn, err := DialPitcher(ctx, start.PitcherURL, start.PitcherToken, o)
	if err != nil {
		return nil, AgentError(err)
	}
	p.log.Debug().Str("sandbox_id", start.ID).Str("bootup_type", start.BootupType).Msg("csb_agent_connected")
	return conn, nil
}

// Workspace is the VM's workspace directory: user_workspace_path when it
// is a clean absolute path other than /, else DefaultWorkspacePath.
func (s *StartResponse) Workspace() string {
	ws := s.UserWorkspacePath
	if ws == "" || !path.IsAbs(ws) || path.Clean(ws) != ws || ws == "/" {
		return DefaultWorkspacePath
	}
	return ws
}

// vm is the provider's state for one sandbox: its cached agent
// connection and preview token.
type vm struct {
	id       string
	template string // "" when unknown (opened without a template tag)

	connMu    sync.Mutex // held while (re)connecting
	conn      *Pitcher
	workspace string

	tokMu    sync.Mutex
	token    Secret
	tokenExp time.Time
}

func (v *vm) close() {
	v.connMu.Lock()
	defer v.connMu.Unlock()
	if v.conn != nil {
		_ = v.conn.Close()
		v.conn = nil
	}
}

// agent returns a live connection, starting the VM and joining again
// when the cached one has ended (hibernation, network).
func (p *Provider) agent(ctx context.Context, v *vm) (*Pitcher, string, error) {
	v.connMu.Lock()
	defer v.connMu.Unlock()
	if v.conn != nil {
		select {
		case <-v.conn.Done():
			_ = v.conn.Close()
			v.conn = nil
		default:
			return v.conn, v.workspace, nil
		}
	}
	start, err := p.c.Start(ctx, v.id, p.startOptions())
	if err != nil {
		return nil, "", err
	}
	conn, err := p.dial(ctx, start)
	if err != nil {
		return nil, "", err
	}
	v.conn, v.workspace = conn, start.Workspace()
	return conn, v.workspace, nil
}

// withAgent runs fn on a live connection, once more on a fresh one if the
// connection ended under it.
func (p *Provider) withAgent(ctx context.Context, v *vm, fn func(*Pitcher, string) error) error {
	for attempt := 0; ; attempt++ {
		conn, ws, err := p.agent(ctx, v)
		if err != nil {
			return err
		}
		err = fn(conn, ws)
		if err == nil || attempt > 0 || !errors.Is(err, ErrPitcherClosed) || ctx.Err() != nil {
			return AgentError(err)
		}
		p.log.Info().Str("sandbox_id", v.id).Msg("csb_agent_reconnect")
	}
}

// AgentError turns agent errors into codes the model can act on.
func AgentError(err error) error {
	if err == nil || brokererr.As(err) != nil || errors.Is(err, context.Canceled) {
		return err
	}
	var pe *PitcherError
	if errors.As(err, &pe) {
		switch {
		case pe.NotFound():
			return brokererr.Wrap(err, brokererr.FileNotFound, "no such file in the sandbox")
		case pe.Exists():
			return brokererr.Wrap(err, brokererr.FileExists, "a file is in the way of that path in the sandbox")
		case pe.Code == PitcherNoAccess:
			return brokererr.Wrap(err, brokererr.PermissionDenied, "the sandbox agent refused the operation")
		case pe.Code == PitcherRateLimit:
			return brokererr.Wrap(err, brokererr.RateLimitExceeded, "the sandbox agent is rate limiting").WithRetryAfter(5 * time.Second)
		case pe.Code == PitcherInvalidPath:
			return brokererr.Wrap(err, brokererr.InvalidInput, "the sandbox agent refused the path")
		}
		return brokererr.Wrap(err, brokererr.InternalError, "the sandbox agent failed the operation")
	}
	if errors.Is(err, ErrPitcherClosed) {
		return brokererr.Wrap(err, brokererr.Unavailable, "lost the connection to the sandbox; try again")
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "the sandbox agent failed")
}

// sandbox is one project sandbox (projects.Sandbox).
type sandbox struct {
	p *Provider
	v *vm
}

func (s *sandbox) ID() string { return s.v.id }

// WriteFiles writes validated workspace-relative paths under the VM's
// workspace, creating parent directories first.
func (s *sandbox) WriteFiles(ctx context.Context, files map[string][]byte) error {
	if len(files) == 0 {
		return nil
	}
	for rel := range files {
		if _, err := workspace.ValidatePath(rel, projects.ForbiddenPrefixes...); err != nil {
			return err
		}
	}
	rels := slices.Sorted(maps.Keys(files))
	return s.p.withAgent(ctx, s.v, func(c *Pitcher, ws string) error {
		made := map[string]bool{}
		for _, rel := range rels {
			if dir := path.Dir(rel); dir != "." && !made[dir] {
				if err := c.Mkdir(ctx, path.Join(ws, dir), true); err != nil {
					return err
				}
				made[dir] = true
			}
			if err := c.WriteFile(ctx, path.Join(ws, rel), files[rel]); err != nil {
				return err
			}
		}
		return nil
	})
}

// ReadFile reads one validated path, refusing files over max bytes
// before transferring them.
func (s *sandbox) ReadFile(ctx context.Context, rel string, max int64) ([]byte, error) {
	if _, err := workspace.ValidatePath(rel, projects.ForbiddenPrefixes...); err != nil {
		return nil, err
	}
	var out []byte
	err := s.p.withAgent(ctx, s.v, func(c *Pitcher, ws string) error {
		full := path.Join(ws, rel)
		st, err := c.Stat(ctx, full)
		if err != nil {
			return err
		}
		if st.Type != 0 {
			return brokererr.New(brokererr.InvalidInput, "%s is not a regular file", rel)
		}
		if st.Size > max {
			return brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", rel, max)
		}
		b, err := c.ReadFile(ctx, full)
		if err != nil {
			return err
		}
		if int64(len(b)) > max { // it grew since the stat
			return brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", rel, max)
		}
		out = b
		return nil
	})
	return out, err
}

// Build runs BuildCommand in the workspace within projects.CommandTimeout.
func (s *sandbox) Build(ctx context.Context) ([]byte, int, error) {
	ctx, cancel := context.WithTimeout(ctx, projects.CommandTimeout)
	defer cancel()
	var res *RunResult
	err := s.p.withAgent(ctx, s.v, func(c *Pitcher, ws string) error {
		r, err := c.Run(ctx, BuildCommand, ws, s.p.o.MaxOutputBytes)
		res = r
		return err
	})
	if res == nil {
		return nil, -1, err
	}
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			err = brokererr.New(brokererr.SandboxTimeout, "the build did not finish within %s", projects.CommandTimeout)
		}
		return res.Output, -1, err
	}
	return res.Output, res.ExitCode, nil
}

// ConsoleLog is the tail of the dev task's terminal: task/list names the
// task shells (tasks.json, §5.1), shell/open returns a shell's buffer. The
// task with a preview port wins, else one that runs at start. No such
// task yet means no log, not an error.
func (s *sandbox) ConsoleLog(ctx context.Context, max int) ([]byte, error) {
	if max <= 0 {
		return []byte{}, nil
	}
	var out []byte
	err := s.p.withAgent(ctx, s.v, func(c *Pitcher, _ string) error {
		tasks, err := c.ListTasks(ctx)
		if err != nil {
			return err
		}
		shellID := devShell(tasks)
		if shellID == "" {
			out = []byte{}
			return nil
		}
		sh, err := c.OpenShell(ctx, shellID)
		if err != nil {
			return err
		}
		buf := tailBuffer{max: max * 2}
		for _, chunk := range sh.Buffer {
			if !strings.HasPrefix(chunk, "[CODESANDBOX]") {
				buf.write([]byte(chunk))
			}
		}
		out = tail(CleanOutput(buf.b), max)
		return nil
	})
	return out, err
}

func devShell(tasks map[string]Task) string {
	ids := slices.Sorted(maps.Keys(tasks))
	for _, pass := range []func(Task) bool{
		func(t Task) bool { return t.Preview != nil && t.Preview.Port > 0 },
		func(t Task) bool { return t.RunAtStart },
	} {
		for _, id := range ids {
			if t := tasks[id]; t.Shell != nil && t.Shell.ShellID != "" && pass(t) {
				return t.Shell.ShellID
			}
		}
	}
	return ""
}

// PreviewURL is https://{id}-{port}.{domain}/ (§3), built from the ID and
// a port number only: the agent's own URLs come from an untrusted VM. A
// private preview gets a preview token, cached until shortly before it
// expires.
func (s *sandbox) PreviewURL(ctx context.Context) (string, error) {
	want := 0
	if t, ok := s.p.o.Templates[s.v.template]; ok {
		want = t.Port
	}
	var port int
	err := s.p.withAgent(ctx, s.v, func(c *Pitcher, _ string) error {
		ports, err := c.ListPorts(ctx)
		if err != nil {
			return err
		}
		port = pickPort(ports, want)
		return nil
	})
	if err != nil {
		return "", err
	}
	if port == 0 {
		return "", brokererr.New(brokererr.InvalidInput, "the app is not listening on any port yet; start its dev server and try again")
	}
	u := fmt.Sprintf("https://%s-%d.%s/", s.v.id, port, s.p.o.PreviewDomain)
	if s.p.o.PublicPreviews {
		return u, nil
	}
	tok, err := s.previewToken(ctx)
	if err != nil {
		return "", err
	}
	return u + "?preview_token=" + url.QueryEscape(tok.Reveal()), nil
}

// pickPort prefers the template's port, else the lowest open one; when
// nothing is open yet the template's port is where the app will be.
func pickPort(ports []Port, want int) int {
	best := 0
	for _, p := range ports {
		if p.Port < 1 || p.Port > 65535 || p.Port == agentPort {
			continue
		}
		if p.Port == want {
			return want
		}
		if best == 0 || p.Port < best {
			best = p.Port
		}
	}
	if best == 0 {
		return want
	}
	return best
}

// tokenMargin: a cached token must outlive the link we hand out by this much.
const tokenMargin = 5 * time.Minute

func (s *sandbox) previewToken(ctx context.Context) (Secret, error) {
	s.v.tokMu.Lock()
	defer s.v.tokMu.Unlock()
	if s.v.token != "" && time.Until(s.v.tokenExp) > tokenMargin {
		return s.v.token, nil
	}
	exp := time.Now().Add(projects.TTL).Truncate(time.Second)
	t, err := s.p.c.CreatePreviewToken(ctx, s.v.id, exp)
	if err != nil {
		return "", err
	}
	if t.ExpiresAt != nil {
		exp = *t.ExpiresAt
	}
	s.v.token, s.v.tokenExp = t.Token, exp
	return t.Token, nil
}
