package projects

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Per-principal bound on live project sandboxes.
const MaxPerPrincipal = 10

// Record is one project sandbox as its owner sees it.
type Record struct {
	ID          string `json:"sandbox_id"`
	ProjectName string `json:"project_name"`
	Template    string `json:"template"`
	Provider    string `json:"provider"`
	CreatedAt   string `json:"created_at"`
	ExpiresAt   string `json:"expires_at"`
}

// Manager binds project sandboxes to the principals that made them and
// destroys them after TTL.
type Manager struct {
	p   Provider
	db  *sql.DB
	ttl time.Duration
	now func() time.Time
	log zerolog.Logger

	mu      sync.Mutex
	pending map[string]int // creations under way, per principal
}

// Options configure a Manager.
type Options struct {
	DBPath   string
	Provider Provider
	TTL      time.Duration // default TTL
	Now      func() time.Time
	Log      zerolog.Logger
}

// schema is the project table in state.db. Append steps; never edit
// released ones.
var schema = statedb.Schema{Component: "projects", Steps: []string{`CREATE TABLE IF NOT EXISTS projects(
		id TEXT PRIMARY KEY,
		principal TEXT NOT NULL,
		provider TEXT NOT NULL,
		project_name TEXT NOT NULL,
		template TEXT NOT NULL,
		created_at INTEGER NOT NULL,
		expires_at INTEGER NOT NULL);
		CREATE INDEX IF NOT EXISTS projects_by_principal ON projects(principal)`}}

// Open opens the project table.
func Open(ctx context.Context, o Options) (*Manager, error) {
	if o.TTL <= 0 {
		o.TTL = TTL
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	db, err := statedb.Open(ctx, o.DBPath, schema)
	if err != nil {
		return nil, fmt.Errorf("projects: %w", err)
	}
	return &Manager{p: o.Provider, db: db, ttl: o.TTL, now: o.Now, log: o.Log, pending: map[string]int{}}, nil
}

// Provider returns the provider behind the manager.
func (m *Manager) Provider() Provider { return m.p }

// Close closes the table (not the provider).
func (m *Manager) Close() error { return m.db.Close() }

// Ping checks the table and the provider.
func (m *Manager) Ping(ctx context.Context) error {
	if err := m.db.PingContext(ctx); err != nil {
		return err
	}
	return m.p.Ping(ctx)
}

// FileLimits bound one call's files.
type FileLimits struct {
	MaxFiles     int
	MaxFileBytes int
}

// Files validates a files argument: every path through the one path
// validator with the project prefixes refused, counts and sizes bounded.
func Files(files map[string]string, l FileLimits) (map[string][]byte, error) {
	if len(files) > l.MaxFiles {
		return nil, brokererr.New(brokererr.InvalidInput, "at most %d files per call", l.MaxFiles)
	}
	out := make(map[string][]byte, len(files))
	names := make([]string, 0, len(files))
	for p := range files {
		names = append(names, p)
	}
	sort.Strings(names) // the first bad path reported is stable
	for _, p := range names {
		if _, err := workspace.ValidatePath(p, ForbiddenPrefixes...); err != nil {
			return nil, err
		}
		if len(files[p]) > l.MaxFileBytes {
			return nil, brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", p, l.MaxFileBytes)
		}
		out[p] = []byte(files[p])
	}
	return out, nil
}

// ProjectName is create_sandbox_for_project's project_name rule.
var ProjectName = regexp.MustCompile(`^[A-Za-z0-9_-]{1,50}$`)

// Create makes a sandbox for principal; req is already validated.
func (m *Manager) Create(ctx context.Context, principal string, req CreateRequest) (Record, Sandbox, error) {
	// Creations under way count too: a provider takes seconds, and
	// parallel calls must not all pass the check.
	m.mu.Lock()
	var n int
	var oldest int64
	if err := m.db.QueryRowContext(ctx, `SELECT COUNT(*), COALESCE(MIN(expires_at), 0) FROM projects WHERE principal = ?`, principal).Scan(&n, &oldest); err != nil {
		m.mu.Unlock()
		return Record{}, nil, brokererr.Wrap(err, brokererr.Unavailable, "project store unavailable")
	}
	if n += m.pending[principal]; n >= MaxPerPrincipal {
		m.mu.Unlock()
		// A slot frees when the oldest expires (the reaper removes it).
		wait := max(time.Unix(oldest, 0).Sub(m.now()), time.Second)
		return Record{}, nil, brokererr.New(brokererr.QuotaExceeded, "you have %d project sandboxes; each is destroyed %s after creation", n, m.ttl).WithRetryAfter(wait)
	}
	m.pending[principal]++
	m.mu.Unlock()
	sb, err := m.p.Create(ctx, req)
	if err != nil {
		m.mu.Lock()
		m.unreserveLocked(principal)
		m.mu.Unlock()
		return Record{}, nil, err
	}
	now := m.now()
	rec := Record{ID: sb.ID(), ProjectName: req.ProjectName, Template: req.Template, Provider: m.p.Name(),
		CreatedAt: now.UTC().Format(time.RFC3339), ExpiresAt: now.Add(m.ttl).UTC().Format(time.RFC3339)}
	// The row replaces the reservation under the check's lock, so no check
	// counts both or neither.
	m.mu.Lock()
	_, err = m.db.ExecContext(ctx, `INSERT INTO projects(id, principal, provider, project_name, template, created_at, expires_at) VALUES(?,?,?,?,?,?,?)`,
		rec.ID, principal, rec.Provider, rec.ProjectName, rec.Template, now.Unix(), now.Add(m.ttl).Unix())
	m.unreserveLocked(principal)
	m.mu.Unlock()
	if err != nil {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		_ = m.p.Destroy(dctx, rec.ID)
		cancel()
		return Record{}, nil, brokererr.Wrap(err, brokererr.Unavailable, "project store unavailable")
	}
	m.log.Info().Str("sandbox_id", rec.ID).Str("template", rec.Template).Str("provider", rec.Provider).Msg("project_created")
	return rec, sb, nil
}

// unreserveLocked ends one creation of principal's; the caller holds m.mu.
func (m *Manager) unreserveLocked(principal string) {
	if m.pending[principal]--; m.pending[principal] == 0 {
		delete(m.pending, principal)
	}
}

func notFound(id string) error {
	return brokererr.New(brokererr.SandboxNotFound, "no sandbox %q; list_sandboxes shows yours", id)
}

// Owns reports whether principal owns the live sandbox id.
func (m *Manager) Owns(ctx context.Context, principal, id string) error {
	var exp int64
	err := m.db.QueryRowContext(ctx, `SELECT expires_at FROM projects WHERE id = ? AND principal = ?`, id, principal).Scan(&exp)
	if errors.Is(err, sql.ErrNoRows) || (err == nil && m.now().Unix() >= exp) {
		return notFound(id)
	}
	if err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "project store unavailable")
	}
	return nil
}

// Exists reports whether id is a live sandbox of anyone's (for preview links).
func (m *Manager) Exists(ctx context.Context, id string) bool {
	var exp int64
	err := m.db.QueryRowContext(ctx, `SELECT expires_at FROM projects WHERE id = ?`, id).Scan(&exp)
	return err == nil && m.now().Unix() < exp
}

// Get opens the caller's sandbox.
func (m *Manager) Get(ctx context.Context, principal, id string) (Sandbox, error) {
	if err := m.Owns(ctx, principal, id); err != nil {
		return nil, err
	}
	return m.p.Open(ctx, id)
}

// List returns the caller's live sandboxes, newest first.
func (m *Manager) List(ctx context.Context, principal string) ([]Record, error) {
	rows, err := m.db.QueryContext(ctx, `SELECT id, provider, project_name, template, created_at, expires_at FROM projects
		WHERE principal = ? AND expires_at > ? ORDER BY created_at DESC, id`, principal, m.now().Unix())
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "project store unavailable")
	}
	defer rows.Close()
	out := []Record{}
	for rows.Next() {
		var r Record
		var c, e int64
		if err := rows.Scan(&r.ID, &r.Provider, &r.ProjectName, &r.Template, &c, &e); err != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "project store unavailable")
		}
		r.CreatedAt = time.Unix(c, 0).UTC().Format(time.RFC3339)
		r.ExpiresAt = time.Unix(e, 0).UTC().Format(time.RFC3339)
		out = append(out, r)
	}
	return out, rows.Err()
}

// Reap destroys expired sandboxes (shut down and deleted at the provider);
// a row stays until its sandbox is gone, so a failed destroy is retried.
func (m *Manager) Reap(ctx context.Context) {
	now := m.now()
	// An expiry more than a TTL away means the wall clock was stepped
	// back: the sandbox still ends at most a TTL from now.
	if _, err := m.db.ExecContext(ctx, `UPDATE projects SET expires_at = ?1 WHERE expires_at > ?1`, now.Add(m.ttl).Unix()); err != nil {
		m.log.Warn().Msg("project_clock_fix_failed")
	}
	rows, err := m.db.QueryContext(ctx, `SELECT id FROM projects WHERE expires_at <= ?`, now.Unix())
	if err != nil {
		m.log.Warn().Msg("project_reap_query_failed")
		return
	}
	var ids []string
	for rows.Next() {
		var id string
		if rows.Scan(&id) == nil {
			ids = append(ids, id)
		}
	}
	rows.Close()
	for _, id := range ids {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		err := m.p.Destroy(dctx, id)
		cancel()
		if err != nil {
			m.log.Warn().Str("sandbox_id", id).Msg("project_destroy_failed")
			continue
		}
		if _, err := m.db.ExecContext(ctx, `DELETE FROM projects WHERE id = ?`, id); err != nil {
			m.log.Warn().Str("sandbox_id", id).Msg("project_row_delete_failed")
			continue
		}
		m.log.Info().Str("sandbox_id", id).Msg("project_expired")
	}
}

// Sweep has the provider delete sandboxes with no row here, if it can
// (Sweeper). A row counts until Reap removes it, so expired sandboxes stay
// Reap's business.
func (m *Manager) Sweep(ctx context.Context) {
	sw, ok := m.p.(Sweeper)
	if !ok {
		return
	}
	n, err := sw.Sweep(ctx, func(ctx context.Context, id string) (bool, error) {
		var one int
		err := m.db.QueryRowContext(ctx, `SELECT 1 FROM projects WHERE id = ?`, id).Scan(&one)
		if errors.Is(err, sql.ErrNoRows) {
			return false, nil
		}
		return err == nil, err
	})
	if err != nil {
		m.log.Warn().Str("error_code", string(brokererr.CodeOf(err))).Int("deleted", n).Msg("project_sweep_failed")
		return
	}
	if n > 0 {
		m.log.Info().Int("deleted", n).Msg("project_orphans_deleted")
	}
}
