// Package mcpsessions keeps MCP Streamable HTTP session IDs and the
// principal each belongs to in the shared state store, so any broker
// replica can serve any session: a client may reach a different replica on
// every request. A session ID is useless to anyone but its owner, is
// forgotten once idle past the TTL, and a principal holds at most
// PerPrincipal of them (its own least recently used goes first).
//
// A replica answers a session's checks from its own successful check of it
// for up to checkFresh: a session its owner ended through another replica
// can still be used by that owner on this one for that long. What a check
// compares (the ID and its principal) is never taken from anywhere but
// the store.
package mcpsessions

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

const (
	// IdleTTL is how long an unused session stays valid.
	IdleTTL = time.Hour
	// PerPrincipal caps one principal's sessions.
	PerPrincipal = 100
	// touchEvery limits last-seen writes to one a minute per session.
	touchEvery = time.Minute
	// checkFresh is how long a successful check answers for the same
	// session and principal on this replica: each request checks its
	// session, and one read of the store per second per session is enough
	// for expiry (IdleTTL) and for ends made on other replicas.
	checkFresh = time.Second
	// maxChecked bounds the remembered checks; past it, stale ones go.
	maxChecked = 4096
	// opTimeout bounds each store operation.
	opTimeout = 5 * time.Second
	// idPrefix starts every ID.
	idPrefix = "mcp-session-"
)

var schema = statedb.Schema{Component: "mcp_sessions", Steps: []string{`
CREATE TABLE IF NOT EXISTS mcp_sessions (
	id         TEXT    PRIMARY KEY,
	principal  TEXT    NOT NULL, -- '' until the initialize response binds it
	last_seen  INTEGER NOT NULL, -- unix ms
	terminated INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS mcp_sessions_principal ON mcp_sessions (principal, last_seen);
CREATE INDEX IF NOT EXISTS mcp_sessions_last_seen ON mcp_sessions (last_seen)`}}

// ErrNotFound is an ID that is unknown, idle past the TTL, or not the
// caller's.
var ErrNotFound = errors.New("session not found")

// Store is the session table. It is safe for concurrent use.
type Store struct {
	db  *sql.DB
	now func() time.Time
	st  statements

	mu      sync.Mutex
	checked map[string]check // successful checks by session ID
	epoch   uint64           // counts forgets: a check begun before one is not remembered
}

// check is a successful Touch: the session's principal and when.
type check struct {
	principal string
	at        time.Time
}

// statements are prepared once: Touch and Validate run on every request.
type statements struct {
	all                            statedb.Stmts
	insert, validate, terminate    *sql.Stmt
	seen, touch, bind, trim, prune *sql.Stmt
}

// Open opens the store at loc (a state.db path or a DATABASE_URL); now
// may be nil.
func Open(ctx context.Context, loc string, now func() time.Time) (*Store, error) {
	if now == nil {
		now = time.Now
	}
	db, err := statedb.Open(ctx, loc, schema)
	if err != nil {
		return nil, fmt.Errorf("mcp sessions: %w", err)
	}
	s := &Store{db: db, now: now, checked: map[string]check{}}
	st := &s.st
	st.all, err = statedb.Prepare(ctx, db,
		statedb.Query{Dst: &st.insert, SQL: `INSERT INTO mcp_sessions (id, principal, last_seen) VALUES (?, '', ?)`},
		statedb.Query{Dst: &st.validate, SQL: `SELECT terminated FROM mcp_sessions WHERE id = ? AND last_seen >= ?`},
		statedb.Query{Dst: &st.terminate, SQL: `UPDATE mcp_sessions SET terminated = 1 WHERE id = ?`},
		statedb.Query{Dst: &st.seen, SQL: `SELECT last_seen FROM mcp_sessions WHERE id = ? AND principal = ? AND terminated = 0 AND last_seen >= ?`},
		statedb.Query{Dst: &st.touch, SQL: `UPDATE mcp_sessions SET last_seen = ? WHERE id = ?`},
		statedb.Query{Dst: &st.bind, SQL: `UPDATE mcp_sessions SET principal = ?, last_seen = ? WHERE id = ? AND principal = ''`},
		statedb.Query{Dst: &st.trim, SQL: `DELETE FROM mcp_sessions WHERE principal = ?1 AND id NOT IN
		(SELECT id FROM mcp_sessions WHERE principal = ?1 ORDER BY last_seen DESC, id LIMIT ?2)`},
		statedb.Query{Dst: &st.prune, SQL: `DELETE FROM mcp_sessions WHERE last_seen < ?`})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("mcp sessions: %w", err)
	}
	return s, nil
}

// Close closes the store.
func (s *Store) Close() error { return errors.Join(s.st.all.Close(), s.db.Close()) }

// Generate returns a new 128-bit random session ID, live and unowned.
func (s *Store) Generate() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	id := idPrefix + hex.EncodeToString(b[:])
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	// A failed insert leaves an ID that Validate rejects: the client's
	// next request gets 404 and initializes again.
	_, _ = s.st.insert.ExecContext(ctx, id, s.now().UnixMilli())
	return id
}

// Validate reports whether id was terminated; an unknown or expired id is
// an error (the MCP transport answers 404). The broker calls Touch on the
// same request first, which answers for the store being unreachable;
// Validate then lets the request through rather than have the transport
// tell the client its session is gone.
func (s *Store) Validate(id string) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var terminated int
	err := s.st.validate.QueryRowContext(ctx, id, s.now().Add(-IdleTTL).UnixMilli()).Scan(&terminated)
	if errors.Is(err, sql.ErrNoRows) {
		return false, ErrNotFound
	}
	return terminated != 0, nil
}

// Terminate ends a live session.
func (s *Store) Terminate(id string) (bool, error) {
	defer s.forget(id)
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	_, err := s.st.terminate.ExecContext(ctx, id)
	return false, statedb.Classify(err)
}

// Bind makes principal the owner of the just-generated id, dropping the
// principal's least recently used sessions beyond PerPrincipal.
func (s *Store) Bind(ctx context.Context, id, principal string) error {
	defer s.forget("") // the sessions it drops may have been checked
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return statedb.Classify(err)
	}
	defer tx.Rollback()
	if _, err := tx.StmtContext(ctx, s.st.bind).ExecContext(ctx, principal, s.now().UnixMilli(), id); err != nil {
		return statedb.Classify(err)
	}
	if _, err := tx.StmtContext(ctx, s.st.trim).ExecContext(ctx, principal, PerPrincipal); err != nil {
		return statedb.Classify(err)
	}
	return statedb.Classify(tx.Commit())
}

// Touch checks that id is principal's live session and refreshes it.
// Within checkFresh of its last successful check on this Store it answers
// from that check.
func (s *Store) Touch(ctx context.Context, id, principal string) error {
	now := s.now()
	epoch, fresh := s.recall(id, principal, now)
	if fresh {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	var seen int64
	err := s.st.seen.QueryRowContext(ctx, id, principal, now.Add(-IdleTTL).UnixMilli()).Scan(&seen)
	if errors.Is(err, sql.ErrNoRows) {
		return ErrNotFound
	}
	if err != nil {
		return statedb.Classify(err)
	}
	if now.UnixMilli()-seen >= touchEvery.Milliseconds() {
		if _, err := s.st.touch.ExecContext(ctx, now.UnixMilli(), id); err != nil {
			return statedb.Classify(err)
		}
	}
	s.remember(id, principal, now, epoch)
	return nil
}

// recall reports whether id was checked as principal's within checkFresh
// of now, and the epoch a check begun now must find unchanged to be
// remembered.
func (s *Store) recall(id, principal string, now time.Time) (uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, ok := s.checked[id]
	// A clock stepped back does not extend a check.
	return s.epoch, ok && c.principal == principal && !now.Before(c.at) && now.Sub(c.at) < checkFresh
}

// remember records a successful check made at now, unless a forget came
// after it began (it may have read the row before the change).
func (s *Store) remember(id, principal string, now time.Time, epoch uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.epoch != epoch {
		return
	}
	if len(s.checked) >= maxChecked {
		for k, c := range s.checked {
			if now.Sub(c.at) >= checkFresh || now.Before(c.at) {
				delete(s.checked, k)
			}
		}
		if len(s.checked) >= maxChecked {
			clear(s.checked)
		}
	}
	s.checked[id] = check{principal: principal, at: now}
}

// forget drops the check of id, or all of them for "", once a change that
// may end sessions is made; a check that began before it and read the row
// before the change is not remembered.
func (s *Store) forget(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.epoch++
	if id == "" {
		clear(s.checked)
	} else {
		delete(s.checked, id)
	}
}

// Prune forgets sessions idle past the TTL (the leading replica calls it
// periodically).
func (s *Store) Prune(ctx context.Context) {
	defer s.forget("")
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_, _ = s.st.prune.ExecContext(ctx, s.now().Add(-IdleTTL).UnixMilli())
}

// Ping checks the store.
func (s *Store) Ping(ctx context.Context) error { return s.db.PingContext(ctx) }
