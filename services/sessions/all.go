package sessions

import (
	"context"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// Overview is one session as the operator view shows it: whose it is,
// and the compute it holds now (none while idle).
type Overview struct {
	Principal  string            `json:"principal"`
	SessionID  string            `json:"session_id"`
	CreatedAt  time.Time         `json:"created_at"`
	LastUsedAt time.Time         `json:"last_used_at"`
	Live       bool              `json:"live"`    // it holds compute
	Jobs       int               `json:"jobs"`    // live jobs pinning it
	Compute    []sandbox.Compute `json:"compute"` // containers or sandboxes, when the backend says
}

// All lists sessions of every principal, most recently used first, or
// only principal's when it is not "". It is for operators; tools only ever
// see their caller's own sessions.
func (m *Manager) All(ctx context.Context, principal string, limit int) ([]Overview, error) {
	q := `SELECT principal, session_id, workspace_id, created_at, last_used_at FROM sessions`
	var args []any
	if principal != "" {
		q += ` WHERE principal = ?`
		args = append(args, principal)
	}
	q += ` ORDER BY last_used_at DESC, session_id LIMIT ?`
	args = append(args, limit)
	rows, err := m.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	defer rows.Close()
	out := []Overview{}
	var wids []string
	for rows.Next() {
		var o Overview
		var wid string
		var created, used int64
		if err := rows.Scan(&o.Principal, &o.SessionID, &wid, &created, &used); err != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
		}
		o.CreatedAt, o.LastUsedAt = time.Unix(created, 0).UTC(), time.Unix(used, 0).UTC()
		out = append(out, o)
		wids = append(wids, wid)
	}
	if err := rows.Err(); err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	for i, wid := range wids {
		m.mu.Lock()
		l, ok := m.live[wid]
		var pins int
		if ok {
			pins = l.pins
		}
		m.mu.Unlock()
		if !ok {
			continue
		}
		out[i].Live, out[i].Jobs = true, pins
		if d, ok := l.sess.(sandbox.Describer); ok {
			out[i].Compute = d.Compute()
		}
	}
	return out, nil
}

// Reaper decisions.
const (
	ReapIdleReleased = "idle_released" // containers removed, files kept
	ReapExpired      = "expired"       // older than MaxAge: deleted with its files
)

// Reaped is one decision of the reaper.
type Reaped struct {
	Action    string    `json:"action"`
	Principal string    `json:"principal"`
	SessionID string    `json:"session_id"`
	At        time.Time `json:"at"`
}

func (m *Manager) reaped(r Reaped) {
	if m.o.OnReap != nil {
		r.At = m.o.Now()
		m.o.OnReap(r)
	}
}

// reapedExpired reports an expired session once it is gone (one in use
// is skipped this round and stays).
func (m *Manager) reapedExpired(ctx context.Context, principal, id, wid string) {
	if m.o.OnReap == nil {
		return
	}
	var n int
	if err := m.db.QueryRowContext(ctx, `SELECT count(*) FROM sessions WHERE workspace_id = ?`, wid).Scan(&n); err == nil && n == 0 {
		m.reaped(Reaped{Action: ReapExpired, Principal: principal, SessionID: id})
	}
}

// reapedWorkspace reports a decision about a workspace by its session.
func (m *Manager) reapedWorkspace(ctx context.Context, action, wid string) {
	if m.o.OnReap == nil {
		return
	}
	r := Reaped{Action: action}
	_ = m.db.QueryRowContext(ctx, `SELECT principal, session_id FROM sessions WHERE workspace_id = ?`, wid).Scan(&r.Principal, &r.SessionID)
	m.reaped(r)
}
