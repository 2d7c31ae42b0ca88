package hosted

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// store maps a session's workspace to its VM: the only place a VM ID
// comes from (never a tool argument), kept with the principal the
// session belongs to. Table csb_sessions in the state store (shared by
// replicas on DATABASE_URL).
type store struct{ db *sql.DB }

// schema is the table's migration steps (services/migrate). Append
// steps; never edit released ones. last_used (unix milliseconds) is when
// a replica last used the VM: the idle release goes by it (a row from
// before the column reads as long idle).
var schema = statedb.Schema{Component: "csb_sessions", Steps: []string{`CREATE TABLE IF NOT EXISTS csb_sessions(
		workspace_id TEXT PRIMARY KEY,
		principal TEXT NOT NULL,
		sandbox_id TEXT NOT NULL UNIQUE,
		created_at INTEGER NOT NULL)`,
	`ALTER TABLE csb_sessions ADD COLUMN last_used INTEGER NOT NULL DEFAULT 0`}}

func openStore(ctx context.Context, path string) (*store, error) {
	db, err := statedb.Open(ctx, path, schema)
	if err != nil {
		return nil, err
	}
	return &store{db: db}, nil
}

func (s *store) close() error { return s.db.Close() }

// get returns the workspace's VM and its principal ("" when it has none).
func (s *store) get(ctx context.Context, wid string) (principal, sandboxID string, err error) {
	err = s.db.QueryRowContext(ctx, `SELECT principal, sandbox_id FROM csb_sessions WHERE workspace_id = ?`, wid).Scan(&principal, &sandboxID)
	if errors.Is(err, sql.ErrNoRows) {
		return "", "", nil
	}
	return principal, sandboxID, err
}

// put records a new VM, used at now. It fails when the workspace has a
// row already (another replica's fork).
func (s *store) put(ctx context.Context, wid, principal, sandboxID string, now time.Time) error {
	_, err := s.db.ExecContext(ctx, `INSERT INTO csb_sessions(workspace_id, principal, sandbox_id, created_at, last_used) VALUES(?,?,?,?,?)`,
		wid, principal, sandboxID, time.Now().Unix(), now.UnixMilli())
	return err
}

func (s *store) remove(ctx context.Context, wid string) error {
	_, err := s.db.ExecContext(ctx, `DELETE FROM csb_sessions WHERE workspace_id = ?`, wid)
	return err
}

// removeVM deletes the workspace's row if it still names sandboxID (not
// a VM another replica has put in its place).
func (s *store) removeVM(ctx context.Context, wid, sandboxID string) error {
	_, err := s.db.ExecContext(ctx, `DELETE FROM csb_sessions WHERE workspace_id = ? AND sandbox_id = ?`, wid, sandboxID)
	return err
}

// touch records a use of the workspace's VM sandboxID at t. It never
// moves last_used back (a replica whose write comes late, or whose clock
// is behind).
func (s *store) touch(ctx context.Context, wid, sandboxID string, t time.Time) error {
	_, err := s.db.ExecContext(ctx, `UPDATE csb_sessions SET last_used = ?1 WHERE workspace_id = ?2 AND sandbox_id = ?3 AND last_used < ?1`,
		t.UnixMilli(), wid, sandboxID)
	return err
}

// lastUsed returns when any replica last used the workspace's VM
// sandboxID; ok is false when the row names no such VM.
func (s *store) lastUsed(ctx context.Context, wid, sandboxID string) (t time.Time, ok bool, err error) {
	var ms int64
	err = s.db.QueryRowContext(ctx, `SELECT last_used FROM csb_sessions WHERE workspace_id = ? AND sandbox_id = ?`, wid, sandboxID).Scan(&ms)
	if errors.Is(err, sql.ErrNoRows) {
		return time.Time{}, false, nil
	}
	return time.UnixMilli(ms), err == nil, err
}

// known reports whether a VM belongs to a session (the orphan sweep).
func (s *store) known(ctx context.Context, sandboxID string) (bool, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM csb_sessions WHERE sandbox_id = ?`, sandboxID).Scan(&n)
	return n > 0, err
}
