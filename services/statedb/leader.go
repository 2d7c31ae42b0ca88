package statedb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"hash/fnv"
	"sync"
	"time"
)

// LeaderLockKey is the advisory lock whose holder runs the background
// loops (reapers, pruning, re-checks).
const LeaderLockKey int64 = 0x73626c656164 // "sblead"

// leadTimeout bounds one Hold (a ping, or a connect and a try).
const leadTimeout = 10 * time.Second

// heldLock is a session-level advisory lock held on a connection of its
// own: it goes when that connection does (the process exits or is
// killed, or the server restarts).
type heldLock struct {
	db  *sql.DB
	key int64

	mu   sync.Mutex
	conn *sql.Conn // holds the lock while non-nil
}

func openHeldLock(url string, key int64) (*heldLock, error) {
	db, err := OpenPostgres(url, key)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(2)
	return &heldLock{db: db, key: key}, nil
}

// hold reports whether the lock is held now, taking it if it is free and
// checking a held one is still held (its connection alive).
func (l *heldLock) hold(ctx context.Context) bool {
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
	if err := conn.QueryRowContext(ctx, "SELECT pg_try_advisory_lock(?)", l.key).Scan(&got); err != nil || !got {
		conn.Close()
		return false
	}
	l.conn = conn
	return true
}

// free reports whether nobody holds key, without keeping it.
func (l *heldLock) free(ctx context.Context, key int64) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, leadTimeout)
	defer cancel()
	// A read-only transaction: the xact lock ends with it, and the
	// dialect layer takes no write lock for it.
	tx, err := l.db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return false, Classify(err)
	}
	defer tx.Rollback()
	var got bool
	err = tx.QueryRowContext(ctx, "SELECT pg_try_advisory_xact_lock(?)", key).Scan(&got)
	return got, Classify(err)
}

func (l *heldLock) close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil {
		// Unlocked now, so another replica can take it at once, rather
		// than when the server notices the connection is gone.
		ctx, cancel := context.WithTimeout(context.Background(), leadTimeout)
		_, _ = l.conn.ExecContext(ctx, "SELECT pg_advisory_unlock(?)", l.key)
		cancel()
		l.conn.Close()
		l.conn = nil
	}
	return l.db.Close()
}

// Leader elects one replica among those sharing a PostgreSQL store to run
// the background loops: the one holding the leader lock. When it goes,
// another replica takes the lock at its next Lead. On SQLite (one host)
// every broker leads, as it always has: Lead is always true.
type Leader struct{ l *heldLock } // nil on SQLite

// NewLeader returns the election for the store at loc.
func NewLeader(loc string) (*Leader, error) {
	if !IsPostgresURL(loc) {
		return &Leader{}, nil
	}
	l, err := openHeldLock(loc, LeaderLockKey)
	return &Leader{l: l}, err
}

// Lead reports whether this replica leads now, taking the lead if free.
func (l *Leader) Lead(ctx context.Context) bool { return l.l == nil || l.l.hold(ctx) }

// Close gives up the lead.
func (l *Leader) Close() error {
	if l.l == nil {
		return nil
	}
	return l.l.close()
}

// Presence tells replicas sharing a PostgreSQL store which of them are
// running: each holds an advisory lock keyed by its replica ID (Keep), and
// any can ask whether another still holds its own (Alive). On SQLite
// there is no one else to ask: only this process is alive.
type Presence struct {
	self string
	l    *heldLock // nil on SQLite
}

// NewPresence announces replica self on the store at loc.
func NewPresence(loc, self string) (*Presence, error) {
	if self == "" {
		return nil, errors.New("state db: a replica needs an ID")
	}
	if !IsPostgresURL(loc) {
		return &Presence{self: self}, nil
	}
	l, err := openHeldLock(loc, replicaKey(self))
	if err != nil {
		return nil, err
	}
	p := &Presence{self: self, l: l}
	return p, nil
}

// Self is this replica's ID.
func (p *Presence) Self() string { return p.self }

// Keep (re)takes this replica's lock, as after a server restart; the
// broker calls it at start and periodically.
func (p *Presence) Keep(ctx context.Context) bool { return p.l == nil || p.l.hold(ctx) }

// Alive reports whether replica is running. An error means it could not
// be told: treat the replica as alive.
func (p *Presence) Alive(ctx context.Context, replica string) (bool, error) {
	if replica == p.self {
		return true, nil
	}
	if p.l == nil || replica == "" {
		return false, nil
	}
	free, err := p.l.free(ctx, replicaKey(replica))
	return !free, err
}

// Close withdraws this replica.
func (p *Presence) Close() error {
	if p.l == nil {
		return nil
	}
	return p.l.close()
}

// replicaKey is the advisory lock key of a replica ID.
func replicaKey(id string) int64 {
	h := fnv.New64a()
	h.Write([]byte("sandbox-broker replica " + id))
	return int64(h.Sum64())
}
