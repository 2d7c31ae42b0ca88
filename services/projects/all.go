package projects

import (
	"context"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Owned is a project sandbox with the principal it belongs to.
type Owned struct {
	Principal string `json:"principal"`
	Record
}

// All lists the live sandboxes of every principal, newest first. It is
// for operators; tools only ever see their caller's own.
func (m *Manager) All(ctx context.Context, limit int) ([]Owned, error) {
	rows, err := m.db.QueryContext(ctx, `SELECT principal, id, provider, project_name, template, created_at, expires_at FROM projects
		WHERE expires_at > ? ORDER BY created_at DESC, id LIMIT ?`, m.now().Unix(), limit)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "project store unavailable")
	}
	defer rows.Close()
	out := []Owned{}
	for rows.Next() {
		var o Owned
		var c, e int64
		if err := rows.Scan(&o.Principal, &o.ID, &o.Provider, &o.ProjectName, &o.Template, &c, &e); err != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "project store unavailable")
		}
		o.CreatedAt = time.Unix(c, 0).UTC().Format(time.RFC3339)
		o.ExpiresAt = time.Unix(e, 0).UTC().Format(time.RFC3339)
		out = append(out, o)
	}
	return out, rows.Err()
}
