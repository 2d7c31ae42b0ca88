package statedb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"sync"
	"time"
)

// LeaderLockKey is the advisory lock whose holder runs the background
// loops (reapers, pruning, re-checks).
const LeaderLockKey int64 = 0x73626c656164 // "sblead"

// leadTimeout bounds one Lead (a ping, or a connect and a try).
const leadTimeout = 10 * time.Second

// Leader elects one replica among those sharing a PostgreSQL store to run
// the background loops: the one holding a session-level advisory lock on
// a connection of its own. The lock goes when that connection does (the
// replica exits or is killed, or the server restarts), and another
// replica takes it at its next Lead. On SQLite (one host) every broker
// leads, as it always has: Lead is always true.
type Leader struct {
	db *sql.DB // nil on SQLite

	mu   sync.Mutex
	conn *sql.Conn // holds the lock while non-nil
}

// NewLeader returns the election for the store at loc.
func NewLeader(loc string) (*Leader, error) {
	if !IsPostgresURL(loc) {
		return &Leader{}, nil
	}
	db, err := OpenPostgres(loc, LeaderLockKey)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(2)
	return &Leader{db: db}, nil
}

// Lead reports whether this replica leads now, taking the lock if it is
// free and checking a held one is still held (its connection alive).
func (l *Leader) Lead(ctx context.Context) bool {
	if l.db == nil {
		return true
	}
	ctx, cancel := context.WithTimeout(ctx, leadTimeout)
	defer cancel()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil {
		if l.conn.PingContext(ctx) == nil {
			return true
		}
		// ErrBadConn makes database/sql close it rather than pool it.
		_ = l.conn.Raw(func(any) error { return driver.ErrBadConn })
		l.conn.Close()
		l.conn = nil
	}
	conn, err := l.db.Conn(ctx)
	if err != nil {
		return false
	}
	var got bool
	if err := conn.QueryRowContext(ctx, "SELECT pg_try_advisory_lock(?)", LeaderLockKey).Scan(&got); err != nil || !got {
		conn.Close()
		return false
	}
	l.conn = conn
	return true
}

// Close gives up the lead.
func (l *Leader) Close() error {
	if l.db == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil {
		// Unlocked now, so another replica can lead at once, rather than
		// when the server notices the connection is gone.
		ctx, cancel := context.WithTimeout(context.Background(), leadTimeout)
		_, _ = l.conn.ExecContext(ctx, "SELECT pg_advisory_unlock(?)", LeaderLockKey)
		cancel()
		l.conn.Close()
		l.conn = nil
	}
	return l.db.Close()
}
