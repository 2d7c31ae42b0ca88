// Package local is the project provider used without CSB_API_KEY: every
// project is a container of the Node runner image (runners/node) on the
// local Docker engine, started from one of the starters baked into that
// image, with its files in a host workspace under Options.Root. The broker
// serves previews itself, on their own origin (see Preview).
package local

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/docker"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Language is the runner language of project containers: a shell in the
// Node runner image, which carries the starters.
const Language = agent.LangNode

// Options configure a Provider.
type Options struct {
	// Root is a directory of its own (e.g. <SANDBOX_ROOT>/projects): the
	// provider's Docker engine sweeps orphans by this root, so it must not
	// be the main engine's.
	Root string
	// AgentBinary is the agent binary mounted into containers.
	AgentBinary string
	// Link returns the broker's signed preview link for a project ID.
	Link func(id string) (string, error)
	Log  zerolog.Logger
	// PoolSize is passed to the engine (0 or 1; the engine warms one
	// container per runner language, so 0 is the default).
	PoolSize   int
	InstanceID string // engine label; default random
	Runtime    string // "" → runc
	// WorkspaceLimits bound each project's files; zero fields take
	// DefaultLimits' values.
	WorkspaceLimits workspace.Limits
	// UIDs and Slots are the broker's sandbox uid leases and live-container
	// cap, shared with the session engine (see docker.Options).
	UIDs  *uids.Allocator
	Slots *sandbox.Slots
}

// DefaultLimits leave room for a Next.js build (.next holds a few hundred
// files) and its output.
func DefaultLimits() workspace.Limits {
	return workspace.Limits{MaxFiles: 5000, MaxBytes: 256 << 20, MaxFileBytes: 32 << 20}
}

const (
	createTimeout = 90 * time.Second // container start + starter copy
	stopTimeout   = 30 * time.Second
	metaMaxBytes  = 4 << 10
)

// Provider implements projects.Provider and projects.PreviewServer.
type Provider struct {
	o   Options
	eng *docker.Engine
	log zerolog.Logger

	mu       sync.Mutex
	projects map[string]*project
	closed   bool
}

var (
	_ projects.Provider      = (*Provider)(nil)
	_ projects.PreviewServer = (*Provider)(nil)
	_ projects.Sandbox       = (*project)(nil)
	_ projects.JobBuilder    = (*project)(nil)
)

// New starts the provider's own Docker engine on o.Root and checks that the
// Node runner image exists.
func New(ctx context.Context, o Options) (*Provider, error) {
	if o.Root == "" {
		return nil, errors.New("local projects: Options.Root is required")
	}
	if o.Link == nil {
		return nil, errors.New("local projects: Options.Link is required")
	}
	root, err := filepath.Abs(o.Root)
	if err != nil {
		return nil, err
	}
	o.Root = filepath.Clean(root)
	d := DefaultLimits()
	if o.WorkspaceLimits.MaxFiles <= 0 {
		o.WorkspaceLimits.MaxFiles = d.MaxFiles
	}
	if o.WorkspaceLimits.MaxBytes <= 0 {
		o.WorkspaceLimits.MaxBytes = d.MaxBytes
	}
	if o.WorkspaceLimits.MaxFileBytes <= 0 {
		o.WorkspaceLimits.MaxFileBytes = d.MaxFileBytes
	}
	if o.PoolSize > 1 {
		o.PoolSize = 1
	}
	for _, dir := range []string{o.Root, o.workspaces(), o.metaDir()} {
		if err := os.MkdirAll(dir, 0o711); err != nil {
			return nil, fmt.Errorf("local projects: %w", err)
		}
	}
	// Metadata is the broker's own: the sandbox never sees it.
	if err := os.Chmod(o.metaDir(), 0o700); err != nil {
		return nil, fmt.Errorf("local projects: %w", err)
	}
	eng, err := docker.New(ctx, docker.Options{
		Root:            o.Root,
		AgentBinary:     o.AgentBinary,
		PoolSize:        o.PoolSize,
		Memory:          projects.MemoryBytes,
		NanoCPUs:        projects.NanoCPUs,
		Runtime:         o.Runtime,
		InstanceID:      o.InstanceID,
		Languages:       []string{Language},
		Log:             o.Log,
		WorkspaceLimits: o.WorkspaceLimits,
		UIDs:            o.UIDs,
		Slots:           o.Slots,
	})
	if err != nil {
		return nil, err
	}
	p := &Provider{
		o:        o,
		eng:      eng,
		log:      o.Log.With().Str("component", "projects_local").Logger(),
		projects: map[string]*project{},
	}
	if err := p.checkRunner(ctx); err != nil {
		_ = eng.Close(context.WithoutCancel(ctx))
		return nil, err
	}
	return p, nil
}

func (o Options) workspaces() string { return filepath.Join(o.Root, "workspaces") }
func (o Options) metaDir() string    { return filepath.Join(o.Root, "meta") }

// Name implements projects.Provider.
func (p *Provider) Name() string { return "local" }

// Ping implements projects.Provider.
func (p *Provider) Ping(ctx context.Context) error {
	if err := p.eng.Ping(ctx); err != nil {
		return err
	}
	return p.checkRunner(ctx)
}

func (p *Provider) checkRunner(ctx context.Context) error {
	rs, err := p.eng.Runners(ctx)
	if err != nil {
		return err
	}
	for _, r := range rs {
		if r.Language == Language {
			return nil
		}
	}
	return brokererr.New(brokererr.NotConfigured, "the Node runner image is missing (build it with runners/build.sh node)")
}

// Close implements projects.Provider: it stops every project's containers
// (their files stay, for Open after a restart) and the engine.
func (p *Provider) Close(ctx context.Context) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	list := make([]*project, 0, len(p.projects))
	for _, pr := range p.projects {
		list = append(list, pr)
	}
	p.projects = map[string]*project{}
	p.mu.Unlock()
	var errs []error
	for _, pr := range list {
		if err := pr.release(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, p.eng.Close(ctx))
	return errors.Join(errs...)
}

func notFound() error {
	return brokererr.New(brokererr.SandboxNotFound, "no such project sandbox")
}

// meta is what the broker remembers of a project, outside its workspace.
type meta struct {
	Template string    `json:"template"`
	Name     string    `json:"name"`
	Created  time.Time `json:"created"`
}

func (p *Provider) metaPath(id string) string { return filepath.Join(p.o.metaDir(), id+".json") }

func (p *Provider) writeMeta(id string, m meta) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	tmp := p.metaPath(id) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, p.metaPath(id))
}

func (p *Provider) readMeta(id string) (meta, error) {
	var m meta
	f, err := os.Open(p.metaPath(id))
	if err != nil {
		return m, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, metaMaxBytes))
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, err
	}
	if !slices.Contains(projects.Templates, m.Template) {
		return m, fmt.Errorf("bad template %q in metadata", m.Template)
	}
	return m, nil
}

// Create implements projects.Provider.
func (p *Provider) Create(ctx context.Context, req projects.CreateRequest) (projects.Sandbox, error) {
	if !slices.Contains(projects.Templates, req.Template) {
		return nil, brokererr.New(brokererr.InvalidInput, "unknown template; use one of react, next, vue, node")
	}
	for path := range req.Files {
		if _, err := workspace.ValidatePath(path, projects.ForbiddenPrefixes...); err != nil {
			return nil, err
		}
	}
	id := files.NewWorkspaceID()
	start := time.Now()
	pr, err := p.newProject(ctx, id, req.Template, true)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (projects.Sandbox, error) {
		if derr := pr.destroy(context.WithoutCancel(ctx)); derr != nil {
			p.log.Warn().Err(derr).Str("project", id).Msg("project_cleanup_failed")
		}
		_ = os.Remove(p.metaPath(id))
		return nil, err
	}
	if err := p.writeMeta(id, meta{Template: req.Template, Name: truncate(req.ProjectName, 200), Created: time.Now().UTC()}); err != nil {
		return fail(brokererr.Wrap(err, brokererr.InternalError, "cannot record the project"))
	}
	if err := pr.seed(ctx); err != nil {
		return fail(err)
	}
	if len(req.Files) > 0 {
		if err := pr.WriteFiles(ctx, req.Files); err != nil {
			return fail(err)
		}
	}
	if err := p.add(pr); err != nil {
		return fail(err)
	}
	p.log.Info().Str("project", id).Str("template", req.Template).Int("files", len(req.Files)).
		Int64("duration_ms", time.Since(start).Milliseconds()).Msg("project_created")
	return pr, nil
}

// add registers pr unless the provider was closed meanwhile.
func (p *Provider) add(pr *project) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return brokererr.New(brokererr.Unavailable, "the project provider is shut down")
	}
	p.projects[pr.id] = pr
	return nil
}

// Open implements projects.Provider. A project created before a broker
// restart is found from its metadata and workspace; its container starts on
// the next command.
func (p *Provider) Open(ctx context.Context, id string) (projects.Sandbox, error) {
	return p.open(ctx, id)
}

func (p *Provider) open(ctx context.Context, id string) (*project, error) {
	if !files.ValidWorkspaceID(id) {
		return nil, notFound()
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, brokererr.New(brokererr.Unavailable, "the project provider is shut down")
	}
	pr := p.projects[id]
	p.mu.Unlock()
	if pr != nil {
		return pr, nil
	}
	m, err := p.readMeta(id)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			p.log.Warn().Err(err).Str("project", id).Msg("project_meta_unreadable")
		}
		return nil, notFound()
	}
	fi, err := os.Lstat(filepath.Join(p.o.workspaces(), id))
	if err != nil || !fi.IsDir() {
		return nil, notFound()
	}
	pr, err = p.newProject(ctx, id, m.Template, false)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, brokererr.New(brokererr.Unavailable, "the project provider is shut down")
	}
	if old := p.projects[id]; old != nil { // a concurrent Open won
		return old, nil
	}
	p.projects[id] = pr
	return pr, nil
}

// Destroy implements projects.Provider: the container, the workspace and the
// metadata go; a missing project is no error.
func (p *Provider) Destroy(ctx context.Context, id string) error {
	if !files.ValidWorkspaceID(id) {
		return nil
	}
	pr, err := p.open(ctx, id)
	if brokererr.CodeOf(err) == brokererr.SandboxNotFound {
		// No metadata: remove a workspace a failed Create may have left.
		return p.removeWorkspace(id)
	}
	if err != nil {
		return err
	}
	if err := pr.destroy(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	delete(p.projects, id)
	p.mu.Unlock()
	if err := os.Remove(p.metaPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot delete the project record")
	}
	p.log.Info().Str("project", id).Msg("project_destroyed")
	return nil
}

func (p *Provider) removeWorkspace(id string) error {
	if err := os.RemoveAll(filepath.Join(p.o.workspaces(), id)); err != nil {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot delete the workspace")
	}
	return nil
}

// newProject opens the engine session of project id; create makes its
// workspace directory.
func (p *Provider) newProject(ctx context.Context, id, tpl string, create bool) (*project, error) {
	dir := filepath.Join(p.o.workspaces(), id)
	if create {
		w, err := workspace.Create(dir, workspace.WithLimits(p.o.WorkspaceLimits))
		if err != nil {
			return nil, err
		}
		_ = w.Close()
	}
	sess, err := p.eng.Open(ctx, sandbox.SessionRef{WorkspaceID: id, Dir: dir, Principal: "project"})
	if err != nil {
		if create {
			_ = os.RemoveAll(dir)
		}
		return nil, err
	}
	return &project{
		p:        p,
		id:       id,
		template: tpl,
		dir:      dir,
		sess:     sess,
		owner:    sess.(*docker.Session).WorkspaceOwner,
		console:  newRing(consoleMaxBytes),
		requests: newLineRing(requestLogLines),
	}, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
