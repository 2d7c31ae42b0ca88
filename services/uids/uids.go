// Package uids hands out the host uids sandboxes run as: one per workspace
// (so per session), from a configured range, recorded in state.db so no two
// live workspaces ever share one and a workspace keeps its uid across broker
// restarts. Both sandbox backends draw from the same table, and so from the
// same range.
package uids

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// MaxID is the largest usable uid ((uid_t)-1 means "no change" to chown).
const MaxID = 4294967294

// schema is the uid tables in state.db. Append steps; never edit released
// ones.
var schema = statedb.Schema{Component: "uids", Steps: []string{`
CREATE TABLE IF NOT EXISTS sandbox_uids (
	uid   INTEGER PRIMARY KEY,
	owner TEXT    NOT NULL UNIQUE -- a workspace ID, or a warm-pool container's key
);
CREATE TABLE IF NOT EXISTS sandbox_uid_cursor (
	one  INTEGER PRIMARY KEY CHECK (one = 1),
	next INTEGER NOT NULL -- where the next search for a free uid starts
);
`}}

// firstFree is the lowest free uid in [?1, ?2): ?1 itself, or one past a
// leased uid whose successor is free. The CAST types ?1 for PostgreSQL,
// which cannot infer a bare parameter's type in a select list.
const firstFree = `SELECT CAST(?1 AS BIGINT) WHERE ?1 < ?2 AND NOT EXISTS (SELECT 1 FROM sandbox_uids WHERE uid = ?1)
	UNION ALL
	SELECT uid + 1 FROM sandbox_uids t WHERE uid >= ?1 AND uid + 1 < ?2
		AND NOT EXISTS (SELECT 1 FROM sandbox_uids WHERE uid = t.uid + 1)
	ORDER BY 1 LIMIT 1`

// Allocator leases uids in [First, First+Size). It is safe for concurrent
// use, also by several processes sharing the database file.
type Allocator struct {
	db          *sql.DB
	first, size int
}

// Open opens the table in the state database at path.
func Open(ctx context.Context, path string, first, size int) (*Allocator, error) {
	if first < 1 || size < 1 || int64(first)+int64(size)-1 > MaxID {
		return nil, fmt.Errorf("uids: range %d+%d must lie within 1..%d", first, size, MaxID)
	}
	db, err := statedb.Open(ctx, path, schema)
	if err != nil {
		return nil, fmt.Errorf("uids: %w", err)
	}
	return &Allocator{db: db, first: first, size: size}, nil
}

// Close releases the database.
func (a *Allocator) Close() error { return a.db.Close() }

// First is the lowest uid of the range.
func (a *Allocator) First() int { return a.first }

// Size is the number of uids in the range.
func (a *Allocator) Size() int { return a.size }

// Lease returns owner's uid, leasing a free one if it has none (or its
// old one lies outside the current range). Free uids are handed out in
// rotation, so a uid just freed is the last to be reused.
func (a *Allocator) Lease(ctx context.Context, owner string) (int, error) {
	var uid int
	err := a.tx(ctx, func(tx *sql.Tx) error {
		var err error
		uid, err = a.leaseTx(ctx, tx, owner)
		return err
	})
	return uid, err
}

// Move gives to the uid from holds (to's own uid, if any, is freed) and
// returns it: a warm container started under a pool key becomes a
// workspace's.
func (a *Allocator) Move(ctx context.Context, from, to string) (int, error) {
	var uid int
	err := a.tx(ctx, func(tx *sql.Tx) error {
		if err := tx.QueryRowContext(ctx, `SELECT uid FROM sandbox_uids WHERE owner = ?1`, from).Scan(&uid); err != nil {
			return fmt.Errorf("uids: %s holds no uid: %w", from, err)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM sandbox_uids WHERE owner = ?1`, to); err != nil {
			return fmt.Errorf("uids: free: %w", err)
		}
		if _, err := tx.ExecContext(ctx, `UPDATE sandbox_uids SET owner = ?1 WHERE uid = ?2`, to, uid); err != nil {
			return fmt.Errorf("uids: move: %w", err)
		}
		return nil
	})
	return uid, err
}

// Free returns owner's uid to the range (no-op if it has none). Call it
// only once nothing runs as that uid and no file of the owner remains.
func (a *Allocator) Free(ctx context.Context, owner string) error {
	if _, err := a.db.ExecContext(ctx, `DELETE FROM sandbox_uids WHERE owner = ?1`, owner); err != nil {
		return fmt.Errorf("uids: free: %w", err)
	}
	return nil
}

// FreePrefix frees every uid whose owner starts with prefix (the keys of a
// warm pool whose containers are gone).
func (a *Allocator) FreePrefix(ctx context.Context, prefix string) error {
	if prefix == "" {
		return errors.New("uids: empty prefix")
	}
	_, err := a.db.ExecContext(ctx, `DELETE FROM sandbox_uids WHERE substr(owner, 1, length(?1)) = ?1`, prefix)
	if err != nil {
		return fmt.Errorf("uids: free: %w", err)
	}
	return nil
}

func (a *Allocator) leaseTx(ctx context.Context, tx *sql.Tx, owner string) (int, error) {
	end := int64(a.first) + int64(a.size)
	var uid int64
	err := tx.QueryRowContext(ctx, `SELECT uid FROM sandbox_uids WHERE owner = ?1`, owner).Scan(&uid)
	switch {
	case err == nil && uid >= int64(a.first) && uid < end:
		return int(uid), nil
	case err == nil: // leased under an older range
		if _, err := tx.ExecContext(ctx, `DELETE FROM sandbox_uids WHERE owner = ?1`, owner); err != nil {
			return 0, fmt.Errorf("uids: free: %w", err)
		}
	case !errors.Is(err, sql.ErrNoRows):
		return 0, fmt.Errorf("uids: read: %w", err)
	}
	var next int64
	switch err := tx.QueryRowContext(ctx, `SELECT next FROM sandbox_uid_cursor`).Scan(&next); {
	case errors.Is(err, sql.ErrNoRows):
		// A new database starts its rotation at a random point of the range,
		// so brokers (or test runs) that were given overlapping ranges by
		// mistake rarely hand out the same uid and share its RLIMIT_NPROC.
		next = int64(a.first) + rand.Int64N(int64(a.size))
	case err != nil:
		return 0, fmt.Errorf("uids: read: %w", err)
	}
	if next < int64(a.first) || next >= end {
		next = int64(a.first)
	}
	err = tx.QueryRowContext(ctx, firstFree, next, end).Scan(&uid)
	if errors.Is(err, sql.ErrNoRows) && next > int64(a.first) {
		err = tx.QueryRowContext(ctx, firstFree, a.first, next).Scan(&uid)
	}
	if errors.Is(err, sql.ErrNoRows) {
		return 0, brokererr.New(brokererr.Unavailable, "all %d sandbox uids are in use; try again once sessions have expired", a.size)
	}
	if err != nil {
		return 0, fmt.Errorf("uids: search: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO sandbox_uids (uid, owner) VALUES (?1, ?2)`, uid, owner); err != nil {
		return 0, fmt.Errorf("uids: lease: %w", err)
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO sandbox_uid_cursor (one, next) VALUES (1, ?1)
		ON CONFLICT (one) DO UPDATE SET next = excluded.next`, uid+1)
	if err != nil {
		return 0, fmt.Errorf("uids: lease: %w", err)
	}
	return int(uid), nil
}

// tx runs fn in a write transaction (BEGIN IMMEDIATE, see statedb).
func (a *Allocator) tx(ctx context.Context, fn func(*sql.Tx) error) error {
	tx, err := a.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("uids: begin: %w", err)
	}
	defer tx.Rollback()
	if err := fn(tx); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("uids: commit: %w", err)
	}
	return nil
}
