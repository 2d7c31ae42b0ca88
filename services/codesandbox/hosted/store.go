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
// session belongs to. Table csb_sessions in state.db.
type store struct{ db *sql.DB }

// schema is the table's migration steps (services/migrate).
var schema = statedb.Schema{Component: "csb_sessions", Steps: []string{`CREATE TABLE IF NOT EXISTS csb_sessions(
		workspace_id TEXT PRIMARY KEY,
		principal TEXT NOT NULL,
		sandbox_id TEXT NOT NULL UNIQUE,
		created_at INTEGER NOT NULL)`}}

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

func (s *store) put(ctx context.Context, wid, principal, sandboxID string) error {
	_, err := s.db.ExecContext(ctx, `INSERT INTO csb_sessions(workspace_id, principal, sandbox_id, created_at) VALUES(?,?,?,?)`,
		wid, principal, sandboxID, time.Now().Unix())
	return err
}

func (s *store) remove(ctx context.Context, wid string) error {
	_, err := s.db.ExecContext(ctx, `DELETE FROM csb_sessions WHERE workspace_id = ?`, wid)
	return err
}

// known reports whether a VM belongs to a session (the orphan sweep).
func (s *store) known(ctx context.Context, sandboxID string) (bool, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM csb_sessions WHERE sandbox_id = ?`, sandboxID).Scan(&n)
	return n > 0, err
}
