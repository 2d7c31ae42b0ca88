package quota

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
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
`,
	// 2: a generation every write to the quota tables bumps, so a Store
	// knows whether its in-memory view still matches the file.
	`CREATE TABLE quota_generation (
	one INTEGER PRIMARY KEY CHECK (one = 1),
	gen INTEGER NOT NULL
);
INSERT INTO quota_generation (one, gen) VALUES (1, 0);`,
}}

const (
	sqlGeneration = `SELECT gen FROM quota_generation`
	sqlBump       = `UPDATE quota_generation SET gen = gen + 1`
	sqlForget     = `DELETE FROM quota_buckets WHERE principal = ?1 AND kind = ?2 AND window_start >= ?3`
	sqlAdd        = `INSERT INTO quota_buckets (principal, kind, window_start, count)
		VALUES (?1, ?2, ?3, ?4)
		ON CONFLICT (principal, kind, window_start) DO UPDATE SET count = quota_buckets.count + excluded.count`
	sqlPrune = `DELETE FROM quota_buckets WHERE window_start < ?1`
)

// ErrInvalidLimit is returned when a Limits field needed by a call is not
// positive: a zero limit is treated as a caller bug, not as "unlimited".
var ErrInvalidLimit = errors.New("quota: limit must be positive")

// Store holds quota counters in a SQLite database file, the truth, and an
// in-memory view of the principals it has seen. It is safe for concurrent
// use, and several Stores (or processes) may share one file.
//
// Decisions are taken from the view inside a write transaction that first
// checks the file's generation: another writer since this Store's last
// write (a second Store or process) means the view is dropped and read
// again, so admission stays exact however many share the file. Usage reads
// only the view: exact with one Store (one broker process) per state.db;
// with several, it shows this Store's view as of its last write.
type Store struct {
	db  *sql.DB
	now func() time.Time
	st  statements

	// wmu serialises this Store's write transactions; the view changes
	// only under it (and mu).
	wmu    sync.Mutex
	gen    int64  // the file's generation after this Store's last write; -1 unknown
	writes uint64 // write transactions, for pruneEvery

	mu   sync.Mutex // guards view for readers
	view map[string]*account

	tmu     sync.Mutex // guards takers and leading (writeTogether)
	takers  []*taker
	leading bool
}

// statements are the Store's prepared statements.
type statements struct {
	generation, bump, loadBuckets, loadHeld, add, forget, prune *sql.Stmt
	reserve, renew, settle, chargeExpired, deleteExpired, ping  *sql.Stmt
	all                                                         statedb.Stmts
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
	s := &Store{db: db, now: now, gen: -1, view: map[string]*account{}}
	st := &s.st
	st.all, err = statedb.Prepare(ctx, db,
		statedb.Query{Dst: &st.generation, SQL: sqlGeneration},
		statedb.Query{Dst: &st.bump, SQL: sqlBump},
		statedb.Query{Dst: &st.loadBuckets, SQL: sqlLoadBuckets},
		statedb.Query{Dst: &st.loadHeld, SQL: sqlLoadHeld},
		statedb.Query{Dst: &st.add, SQL: sqlAdd},
		statedb.Query{Dst: &st.forget, SQL: sqlForget},
		statedb.Query{Dst: &st.prune, SQL: sqlPrune},
		statedb.Query{Dst: &st.reserve, SQL: sqlReserve},
		statedb.Query{Dst: &st.renew, SQL: sqlRenew},
		statedb.Query{Dst: &st.settle, SQL: sqlSettle},
		statedb.Query{Dst: &st.chargeExpired, SQL: sqlChargeExpired},
		statedb.Query{Dst: &st.deleteExpired, SQL: sqlDeleteExpired},
		statedb.Query{Dst: &st.ping, SQL: `SELECT count(*) FROM (SELECT 1 FROM quota_buckets LIMIT 1) AS one`})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("quota: %w", err)
	}
	// Settle what a stopped broker left.
	if err := s.writeTx(ctx, func(w *write) error { return s.pruneIn(w) }); err != nil {
		s.Close()
		return nil, fmt.Errorf("quota: init: %w", err)
	}
	return s, nil
}

// Close releases the database.
func (s *Store) Close() error {
	err := s.st.all.Close()
	if cerr := s.db.Close(); cerr != nil {
		err = errors.Join(err, fmt.Errorf("quota: close: %w", cerr))
	}
	return err
}

// Ping reports whether the database is reachable and the quota table is
// readable (for health checks).
func (s *Store) Ping(ctx context.Context) error {
	var n int
	if err := s.st.ping.QueryRowContext(ctx).Scan(&n); err != nil {
		return fmt.Errorf("quota: ping: %w", err)
	}
	return nil
}

// write is one write transaction. What it changes in the file it also
// queues for the view, which takes the changes only once they commit.
type write struct {
	ctx     context.Context
	tx      *sql.Tx
	now     time.Time
	changed bool     // bump the generation
	apply   []func() // view changes, run under mu after the commit
	applied bool     // some were run before it (see applyNow)
	pruned  bool     // other principals changed: drop the view
}

// exec runs a prepared statement that changes the file.
func (w *write) exec(st *sql.Stmt, args ...any) (sql.Result, error) {
	w.changed = true
	return w.tx.StmtContext(w.ctx, st).ExecContext(w.ctx, args...)
}

// then queues a view change for after the commit.
func (w *write) then(f func()) { w.apply = append(w.apply, f) }

// applyNow runs the view changes queued so far, before the commit, so that
// later decisions in the same transaction see them; if the transaction
// then fails, writeTx drops the whole view (the file is the truth).
func (s *Store) applyNow(w *write) {
	s.mu.Lock()
	for _, f := range w.apply {
		f()
	}
	s.mu.Unlock()
	w.apply = w.apply[:0]
	w.applied = true
}

// writeTx runs fn in a BEGIN IMMEDIATE transaction (see statedb) and
// commits, pruning old buckets on every pruneEvery-th write. The clock is
// read once the write lock is held, so time spent waiting for another
// writer cannot file an increment under a window that has already ended.
// A generation other than this Store's last drops the view first.
func (s *Store) writeTx(ctx context.Context, fn func(w *write) error) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	// Once begun it runs to the end: waiting for another process's lock
	// is bounded by busy_timeout, and a ctx the driver could cancel costs
	// a goroutine per statement.
	ctx = context.WithoutCancel(ctx)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("quota: begin: %w", err)
	}
	defer tx.Rollback()
	var gen int64
	if err := tx.StmtContext(ctx, s.st.generation).QueryRowContext(ctx).Scan(&gen); err != nil {
		return fmt.Errorf("quota: read generation: %w", err)
	}
	if gen != s.gen {
		s.mu.Lock()
		clear(s.view)
		s.mu.Unlock()
		s.gen = gen
	}
	w := &write{ctx: ctx, tx: tx, now: s.now()}
	committed := false
	defer func() {
		if w.applied && !committed {
			s.mu.Lock()
			clear(s.view)
			s.mu.Unlock()
		}
	}()
	if err := fn(w); err != nil {
		return err
	}
	if s.writes++; s.writes%pruneEvery == 0 {
		if err := s.pruneIn(w); err != nil {
			return err
		}
	}
	if w.changed {
		if _, err := w.exec(s.st.bump); err != nil {
			return fmt.Errorf("quota: bump generation: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		s.gen = -1 // the outcome is unknown: read the file again next time
		return fmt.Errorf("quota: commit: %w", err)
	}
	committed = true
	if w.changed {
		s.gen++
	}
	s.mu.Lock()
	for _, f := range w.apply {
		f()
	}
	if w.pruned {
		clear(s.view)
	}
	s.mu.Unlock()
	return nil
}

// pruneIn deletes old buckets and charges expired execution reservations
// of every principal (at Open this settles what a stopped broker left).
func (s *Store) pruneIn(w *write) error {
	if _, err := w.exec(s.st.prune, w.now.Add(-retention).UnixMilli()); err != nil {
		return fmt.Errorf("quota: prune: %w", err)
	}
	w.pruned = true
	return s.chargeExpired(w, "")
}
