package jobs

import (
	"context"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Owned is a job with the principal it belongs to, for operators.
type Owned struct {
	Principal string `json:"principal"`
	Info
}

// All lists the jobs of every principal with the given status ("" for
// any), newest first. It is for operators; tools only ever see their
// caller's own jobs.
func (m *Manager) All(ctx context.Context, status string, limit int) ([]Owned, error) {
	q := `SELECT principal, id, session_id, command, status, exit_code, signal, error, interactive, network, started_at, ended_at FROM jobs`
	var args []any
	if status != "" {
		q += ` WHERE status = ?`
		args = append(args, status)
	}
	q += ` ORDER BY started_at DESC, id LIMIT ?`
	args = append(args, limit)
	rows, err := m.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "job store unavailable")
	}
	defer rows.Close()
	out := []Owned{}
	for rows.Next() {
		var o Owned
		info, err := scanInfo(func(dest ...any) error { return rows.Scan(append([]any{&o.Principal}, dest...)...) })
		if err != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "job store unavailable")
		}
		o.Info = info
		out = append(out, o)
	}
	return out, rows.Err()
}
