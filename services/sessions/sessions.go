// Package sessions maps (principal, session_id) to a sandbox session. A
// session belongs to the principal that created it: any other principal
// asking for the same ID is treated exactly as if it did not exist. Sessions
// persist in SQLite so workspaces survive a broker restart.
package sessions

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// IDPattern is what a client-chosen session ID must match.
var IDPattern = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// workspaceIDPattern is the shape of internal workspace IDs.
var workspaceIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

// Options configure a Manager.
type Options struct {
	DBPath      string // state.db
	Root        string // SANDBOX_ROOT; workspaces live in <Root>/workspaces/<workspace_id>
	Backend     sandbox.Backend
	IdleTimeout time.Duration // idle sessions lose their containers (files stay); default 30 min
	MaxAge      time.Duration // sessions older than this are deleted with their files; default 24 h
	// OnCreate runs before a new session is created (the sandboxes/hour quota).
	OnCreate func(ctx context.Context, principal string) error
	// OnReap hears each of the reaper's decisions (the operator view).
	OnReap func(Reaped)
	Now    func() time.Time
	Log    zerolog.Logger
}

// Manager owns every session.
type Manager struct {
	o    Options
	db   *sql.DB
	st   statements
	mu   sync.Mutex
	live map[string]*live // by workspace ID
}

// statements are the Manager's prepared statements for what every call
// does.
type statements struct {
	lookup, owner, insert, touch *sql.Stmt
	all                          statedb.Stmts
}

type live struct {
	mu      sync.Mutex // serialises calls within one session
	sess    sandbox.Session
	lastUse time.Time
	gone    bool  // released or destroyed while someone waited on mu
	pins    int   // live jobs: the session is not idle while any runs
	stored  int64 // last_used_at as last written (unix seconds)
}

// Lease is exclusive use of one session until Release.
type Lease struct {
	ID          string
	WorkspaceID string
	Created     bool
	Session     sandbox.Session
	m           *Manager
	l           *live
}

// Release ends the lease and marks the session used.
func (l *Lease) Release() {
	l.m.touch(l.WorkspaceID)
	l.l.mu.Unlock()
}

// Pin keeps the session from being released as idle until the returned
// func is called (once); a job pins its session for its lifetime without
// holding the lease, so run_code can still use the session meanwhile.
func (l *Lease) Pin() (unpin func()) {
	m, lv, wid := l.m, l.l, l.WorkspaceID
	m.mu.Lock()
	lv.pins++
	m.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			m.mu.Lock()
			lv.pins--
			m.mu.Unlock()
			m.touch(wid)
		})
	}
}

// schema is the session table in state.db. Append steps; never edit
// released ones.
var schema = statedb.Schema{Component: "sessions", Steps: []string{`CREATE TABLE IF NOT EXISTS sessions(
		principal TEXT NOT NULL,
		session_id TEXT NOT NULL,
		workspace_id TEXT NOT NULL UNIQUE,
		created_at INTEGER NOT NULL,
		last_used_at INTEGER NOT NULL,
		PRIMARY KEY (principal, session_id))`}}

// Open opens the session table.
func Open(ctx context.Context, o Options) (*Manager, error) {
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = 30 * time.Minute
	}
	if o.MaxAge <= 0 {
		o.MaxAge = 24 * time.Hour
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	db, err := statedb.Open(ctx, o.DBPath, schema)
	if err != nil {
		return nil, fmt.Errorf("sessions: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(o.Root, "workspaces"), 0o711); err != nil {
		db.Close()
		return nil, err
	}
	m := &Manager{o: o, db: db, live: map[string]*live{}}
	st := &m.st
	st.all, err = statedb.Prepare(ctx, db,
		statedb.Query{Dst: &st.lookup, SQL: `SELECT workspace_id FROM sessions WHERE principal = ? AND session_id = ?`},
		statedb.Query{Dst: &st.owner, SQL: `SELECT principal, session_id FROM sessions WHERE workspace_id = ?`},
		statedb.Query{Dst: &st.insert, SQL: `INSERT INTO sessions(principal, session_id, workspace_id, created_at, last_used_at) VALUES(?,?,?,?,?)`},
		statedb.Query{Dst: &st.touch, SQL: `UPDATE sessions SET last_used_at = ? WHERE workspace_id = ?`})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("sessions: %w", err)
	}
	return m, nil
}

// Close releases every live session's compute and closes the table.
func (m *Manager) Close(ctx context.Context) error {
	m.mu.Lock()
	all := m.live
	m.live = map[string]*live{}
	m.mu.Unlock()
	for _, l := range all {
		l.mu.Lock()
		_ = l.sess.Release(ctx)
		m.mu.Lock()
		l.gone = true
		m.mu.Unlock()
		l.mu.Unlock()
	}
	return errors.Join(m.st.all.Close(), m.db.Close())
}

// Ping checks the table.
func (m *Manager) Ping(ctx context.Context) error { return m.db.PingContext(ctx) }

// WorkspaceDir is where a workspace lives on the host.
func (m *Manager) WorkspaceDir(workspaceID string) string {
	return filepath.Join(m.o.Root, "workspaces", workspaceID)
}

// NewID returns a generated session ID, sess_<12 hex>.
func NewID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "sess_" + hex.EncodeToString(b[:])
}

// Acquire returns the caller's session, creating it when create is true and
// it does not exist (an empty id generates one). Another principal's session
// is indistinguishable from a missing one.
func (m *Manager) Acquire(ctx context.Context, principal, id string, create bool) (*Lease, error) {
	if id == "" {
		if !create {
			return nil, brokererr.New(brokererr.InvalidInput, "session_id is required")
		}
		id = NewID()
	}
	if !IDPattern.MatchString(id) {
		return nil, brokererr.New(brokererr.InvalidInput, "session_id must match %s", IDPattern)
	}
	// A session released or destroyed while we waited for it is looked up
	// again, so no call ever runs in a sandbox the manager has let go of.
	for attempt := 0; attempt < 3; attempt++ {
		lease, err := m.acquireOnce(ctx, principal, id, create)
		if err != errStale {
			return lease, err
		}
	}
	return nil, brokererr.New(brokererr.Unavailable, "the session is changing; try again")
}

var errStale = errors.New("session entry went away while waiting")

func (m *Manager) acquireOnce(ctx context.Context, principal, id string, create bool) (*Lease, error) {
	wid, err := m.lookup(ctx, principal, id)
	created := false
	switch {
	case errors.Is(err, sql.ErrNoRows) && create:
		if m.o.OnCreate != nil {
			if err := m.o.OnCreate(ctx, principal); err != nil {
				return nil, err
			}
		}
		if wid, err = m.insert(ctx, principal, id); err != nil {
			return nil, err
		}
		created = true
	case errors.Is(err, sql.ErrNoRows):
		return nil, notFound(id)
	case err != nil:
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	l, err := m.attach(ctx, principal, wid)
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	m.mu.Lock()
	current := m.live[wid] == l && !l.gone
	m.mu.Unlock()
	if !current {
		l.mu.Unlock()
		return nil, errStale
	}
	if ctx.Err() != nil {
		l.mu.Unlock()
		return nil, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "the call was cancelled")
	}
	return &Lease{ID: id, WorkspaceID: wid, Created: created, Session: l.sess, m: m, l: l}, nil
}

func notFound(id string) error {
	return brokererr.New(brokererr.SandboxNotFound, "no session %q", id)
}

func (m *Manager) lookup(ctx context.Context, principal, id string) (string, error) {
	var wid string
	err := m.st.lookup.QueryRowContext(ctx, principal, id).Scan(&wid)
	return wid, err
}

// Owner returns the principal and session ID workspace wid belongs to:
// SandboxNotFound when it belongs to none (for signed uploads, whose link
// names only the workspace).
func (m *Manager) Owner(ctx context.Context, wid string) (principal, sessionID string, err error) {
	err = m.st.owner.QueryRowContext(ctx, wid).Scan(&principal, &sessionID)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return "", "", brokererr.New(brokererr.SandboxNotFound, "no session owns this workspace")
	case err != nil:
		return "", "", brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	return principal, sessionID, nil
}

func (m *Manager) insert(ctx context.Context, principal, id string) (string, error) {
	wid := files.NewWorkspaceID()
	now := m.o.Now().Unix()
	_, err := m.st.insert.ExecContext(ctx, principal, id, wid, now, now)
	if err != nil {
		// A concurrent create of the same ID won; use its row.
		if existing, lerr := m.lookup(ctx, principal, id); lerr == nil {
			return existing, nil
		}
		return "", brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	return wid, nil
}

// attach returns the live session for wid, opening it on the backend.
func (m *Manager) attach(ctx context.Context, principal, wid string) (*live, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if l, ok := m.live[wid]; ok {
		return l, nil
	}
	if !workspaceIDPattern.MatchString(wid) {
		return nil, fmt.Errorf("corrupt workspace id in session table")
	}
	sess, err := m.o.Backend.Open(ctx, sandbox.SessionRef{WorkspaceID: wid, Dir: m.WorkspaceDir(wid), Principal: principal})
	if err != nil {
		return nil, err
	}
	l := &live{sess: sess, lastUse: m.o.Now()}
	m.live[wid] = l
	return l, nil
}

// Active counts the sessions with a live sandbox (attached and not yet
// released as idle), for the active-sessions gauge.
func (m *Manager) Active() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.live)
}

// touch marks the session used now, in memory and in the table; the
// table keeps whole seconds, so a second call within the same second
// writes nothing.
func (m *Manager) touch(wid string) {
	now := m.o.Now()
	m.mu.Lock()
	l, ok := m.live[wid]
	if ok {
		l.lastUse = now
	}
	stored := ok && l.stored == now.Unix()
	m.mu.Unlock()
	if stored {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := m.st.touch.ExecContext(ctx, now.Unix(), wid); err != nil {
		m.o.Log.Warn().Str("workspace_id", wid).Msg("session_touch_failed")
		return
	}
	if ok {
		m.mu.Lock()
		l.stored = now.Unix()
		m.mu.Unlock()
	}
}

// Remove destroys the caller's session: containers and files.
func (m *Manager) Remove(ctx context.Context, principal, id string) error {
	if !IDPattern.MatchString(id) {
		return brokererr.New(brokererr.InvalidInput, "session_id must match %s", IDPattern)
	}
	wid, err := m.lookup(ctx, principal, id)
	if errors.Is(err, sql.ErrNoRows) {
		return notFound(id)
	}
	if err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	return m.destroy(ctx, principal, wid, true)
}

// destroy deletes a session. With wait false (the reaper) a session in use
// is skipped, so one long run cannot stall reaping for everyone.
func (m *Manager) destroy(ctx context.Context, principal, wid string, wait bool) error {
	l, err := m.attach(ctx, principal, wid)
	if err != nil {
		return err
	}
	if wait {
		l.mu.Lock()
	} else if !l.mu.TryLock() {
		return nil
	}
	defer l.mu.Unlock()
	if err := l.sess.Destroy(ctx); err != nil {
		return err
	}
	m.mu.Lock()
	l.gone = true
	delete(m.live, wid)
	m.mu.Unlock()
	if _, err := m.db.ExecContext(ctx, `DELETE FROM sessions WHERE workspace_id = ?`, wid); err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	m.o.Log.Info().Str("workspace_id", wid).Msg("session_destroyed")
	return nil
}

// Reap releases the compute of idle sessions and deletes expired ones.
func (m *Manager) Reap(ctx context.Context) {
	m.ReleaseIdle(ctx)
	m.Expire(ctx)
}

// ReleaseIdle releases the sandboxes this broker holds for sessions idle
// past IdleTimeout (each broker replica holds its own).
func (m *Manager) ReleaseIdle(ctx context.Context) {
	now := m.o.Now()
	m.mu.Lock()
	var idle []string
	for wid, l := range m.live {
		if l.pins == 0 && now.Sub(l.lastUse) >= m.o.IdleTimeout {
			idle = append(idle, wid)
		}
	}
	m.mu.Unlock()
	for _, wid := range idle {
		m.releaseIdle(ctx, wid, now)
	}
}

// Expire deletes sessions older than MaxAge (the store is shared: with
// replicas, the leading one does it).
func (m *Manager) Expire(ctx context.Context) {
	now := m.o.Now()
	// A creation time after now means the wall clock was stepped back:
	// such a session's age counts from now, so it lives at most MaxAge
	// past the step, not MaxAge plus the step.
	if _, err := m.db.ExecContext(ctx, `UPDATE sessions SET created_at = ?1 WHERE created_at > ?1`, now.Unix()); err != nil {
		m.o.Log.Warn().Msg("session_clock_fix_failed")
	}
	rows, err := m.db.QueryContext(ctx, `SELECT principal, session_id, workspace_id FROM sessions WHERE created_at <= ?`, now.Add(-m.o.MaxAge).Unix())
	if err != nil {
		m.o.Log.Warn().Msg("session_reap_query_failed")
		return
	}
	type expired struct{ principal, id, wid string }
	var old []expired
	for rows.Next() {
		var e expired
		if rows.Scan(&e.principal, &e.id, &e.wid) == nil {
			old = append(old, e)
		}
	}
	rows.Close()
	for _, e := range old {
		if err := m.destroy(ctx, e.principal, e.wid, false); err != nil {
			m.o.Log.Warn().Str("workspace_id", e.wid).Msg("session_expire_failed")
			continue
		}
		m.reapedExpired(ctx, e.principal, e.id, e.wid)
	}
}

func (m *Manager) releaseIdle(ctx context.Context, wid string, now time.Time) {
	m.mu.Lock()
	l, ok := m.live[wid]
	m.mu.Unlock()
	if !ok || !l.mu.TryLock() {
		return // in use: not idle after all
	}
	defer l.mu.Unlock()
	m.mu.Lock()
	busy := l.pins > 0 || now.Sub(l.lastUse) < m.o.IdleTimeout
	m.mu.Unlock()
	if busy {
		return
	}
	if err := l.sess.Release(ctx); err != nil {
		m.o.Log.Warn().Str("workspace_id", wid).Msg("session_release_failed")
		return
	}
	m.mu.Lock()
	l.gone = true
	delete(m.live, wid)
	m.mu.Unlock()
	m.o.Log.Info().Str("workspace_id", wid).Msg("session_idle_released")
	m.reapedWorkspace(ctx, ReapIdleReleased, wid)
}
