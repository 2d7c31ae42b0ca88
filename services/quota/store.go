package quota

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// pruneEvery: one write transaction in this many also deletes old buckets,
// keeping the table bounded without paying for a DELETE on every call.
const pruneEvery = 256

// retention is how long buckets are kept; the longest window needs only the
// previous hour or the current UTC day, so two days is ample.
const retention = 48 * time.Hour

// schema is the quota tables in state.db, prefixed because the file is
// shared with other packages. Append steps; never edit released ones.
var schema = statedb.Schema{Component: "quota", Steps: []string{`
CREATE TABLE IF NOT EXISTS quota_buckets (
	principal    TEXT    NOT NULL,
	kind         TEXT    NOT NULL,
	window_start INTEGER NOT NULL, -- unix ms of the fixed window (UTC day for execution)
	count        INTEGER NOT NULL, -- requests, or ms for execution_ms
	PRIMARY KEY (principal, kind, window_start)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS quota_buckets_window_start ON quota_buckets (window_start);
CREATE TABLE IF NOT EXISTS quota_reservations (
	id         TEXT    PRIMARY KEY,
	principal  TEXT    NOT NULL,
	ms         INTEGER NOT NULL, -- execution time held
	expires_at INTEGER NOT NULL  -- unix ms; charged in full if still held then
);
CREATE INDEX IF NOT EXISTS quota_reservations_principal ON quota_reservations (principal);
`}}

const (
	// From the previous window on: normally that and the current one; a
	// later one means the wall clock was stepped back (see take).
	sqlSelectPair = `SELECT window_start, count FROM quota_buckets
		WHERE principal = ?1 AND kind = ?2 AND window_start >= ?3`
	sqlForget = `DELETE FROM quota_buckets WHERE principal = ?1 AND kind = ?2 AND window_start >= ?3`
	sqlAdd    = `INSERT INTO quota_buckets (principal, kind, window_start, count)
		VALUES (?1, ?2, ?3, ?4)
		ON CONFLICT (principal, kind, window_start) DO UPDATE SET count = quota_buckets.count + excluded.count`
	sqlPrune = `DELETE FROM quota_buckets WHERE window_start < ?1`
)

// ErrInvalidLimit is returned when a Limits field needed by a call is not
// positive: a zero limit is treated as a caller bug, not as "unlimited".
var ErrInvalidLimit = errors.New("quota: limit must be positive")

// Store holds quota counters in a SQLite database file. It is safe for
// concurrent use, and several Stores (or processes) may share one file.
type Store struct {
	db     *sql.DB
	now    func() time.Time
	writes atomic.Uint64
	// Prepared once: parsing SQL was a third of AllowCall's cost.
	selectPair, upsert *sql.Stmt
}

// Open opens the state database at path (shared with other packages; see
// statedb) and brings the quota tables up to date. now is the clock; nil means
// time.Now.
func Open(ctx context.Context, path string, now func() time.Time) (*Store, error) {
	if now == nil {
		now = time.Now
	}
	db, err := statedb.Open(ctx, path, schema)
	if err != nil {
		return nil, fmt.Errorf("quota: %w", err)
	}
	s := &Store{db: db, now: now}
	if err := s.init(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

func (s *Store) init(ctx context.Context) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("quota: init: %w", err)
	}
	defer tx.Rollback()
	if err := s.prune(ctx, tx, s.now()); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("quota: init: %w", err)
	}
	if s.selectPair, err = s.db.PrepareContext(ctx, sqlSelectPair); err != nil {
		return fmt.Errorf("quota: prepare: %w", err)
	}
	if s.upsert, err = s.db.PrepareContext(ctx, sqlAdd); err != nil {
		return fmt.Errorf("quota: prepare: %w", err)
	}
	return nil
}

// Close releases the database.
func (s *Store) Close() error {
	for _, st := range []*sql.Stmt{s.selectPair, s.upsert} {
		if st != nil {
			st.Close()
		}
	}
	if err := s.db.Close(); err != nil {
		return fmt.Errorf("quota: close: %w", err)
	}
	return nil
}

// Ping reports whether the database is reachable and the quota table is
// readable (for health checks).
func (s *Store) Ping(ctx context.Context) error {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM (SELECT 1 FROM quota_buckets LIMIT 1) AS one`).Scan(&n)
	if err != nil {
		return fmt.Errorf("quota: ping: %w", err)
	}
	return nil
}

// prune deletes old buckets and charges expired execution reservations
// (at Open this settles what a stopped broker left).
func (s *Store) prune(ctx context.Context, tx *sql.Tx, now time.Time) error {
	if _, err := tx.ExecContext(ctx, sqlPrune, now.Add(-retention).UnixMilli()); err != nil {
		return fmt.Errorf("quota: prune: %w", err)
	}
	return s.chargeExpired(ctx, tx, "", now)
}

// writeTx runs fn in a BEGIN IMMEDIATE transaction (see dsn) and commits,
// pruning old buckets on every pruneEvery-th write. The clock is read once
// the write lock is held, so time spent waiting for another writer cannot
// file an increment under a window that has already ended.
func (s *Store) writeTx(ctx context.Context, fn func(tx *sql.Tx, now time.Time) error) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("quota: begin: %w", err)
	}
	defer tx.Rollback()
	now := s.now()
	if err := fn(tx, now); err != nil {
		return err
	}
	if s.writes.Add(1)%pruneEvery == 0 {
		if err := s.prune(ctx, tx, now); err != nil {
			return err
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("quota: commit: %w", err)
	}
	return nil
}
