package audit

import (
	"bytes"
	"context"
	"crypto/hmac"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/mod/sumdb/tlog"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// Errors callers may test with errors.Is.
var (
	// ErrClosed is returned by operations on a closed Log.
	ErrClosed = errors.New("audit: log is closed")
	// ErrIntegrity means Open found the log inconsistent with its own MACs or
	// with its signed checkpoints; run Verify for details.
	ErrIntegrity = errors.New("audit: integrity check failed")
)

// Options configures Open.
type Options struct {
	Path               string        // e.g. <root>/audit.db
	CheckpointPath     string        // e.g. <root>/audit.checkpoints
	Keys               Keys          // needs HMACKey, Signer and Verifier
	CheckpointEvery    int           // rows between checkpoints; default 256
	CheckpointInterval time.Duration // default time.Minute; < 0 disables the timer
	// SyncDelay bounds how long an outcome row committed without an
	// fsync waits for one when no intent row or checkpoint comes first;
	// default 100ms.
	SyncDelay time.Duration
	Now       func() time.Time

	// Test hooks: replace the ticker and observe each timed checkpoint,
	// and each sync SyncDelay after rows no intent row synced.
	tick     <-chan time.Time
	tickDone chan<- error
	syncDone chan<- error
}

// Log is an open audit log. It is safe for concurrent use.
type Log struct {
	db    *sql.DB
	stmts statements
	opts  Options

	// queue hands Appends to the writer goroutine; unbuffered, so a
	// caller is either taken into a batch or sees writerDone.
	queue      chan *pending
	writerDone chan struct{}

	// wal makes committed rows durable (see durability).
	wal durability

	// sem serialises the writer, checkpoints and Close; a channel so
	// waiting honours ctx.
	sem chan struct{}
	// Guarded by sem.
	closed  bool
	lastSeq int64
	lastMAC []byte
	lastTS  time.Time
	cpSize  int64
	cpErr   error // last checkpoint failure, surfaced by Ping
	batches int64 // transactions committed

	stopOnce sync.Once
	stop     chan struct{}
	done     chan struct{}
}

// Open opens or creates the log. It refuses (ErrIntegrity) a log whose last
// row does not verify, whose last checkpoint does not verify, is larger than
// the row count, or whose root at that size differs.
func Open(ctx context.Context, opts Options) (*Log, error) {
	if opts.Path == "" || opts.CheckpointPath == "" {
		return nil, errors.New("audit: Path and CheckpointPath are required")
	}
	if len(opts.Keys.HMACKey) < minHMACKey {
		return nil, fmt.Errorf("audit: HMAC key must be at least %d bytes", minHMACKey)
	}
	if opts.Keys.Signer == nil || opts.Keys.Verifier == nil {
		return nil, errors.New("audit: checkpoint Signer and Verifier are required")
	}
	if opts.Keys.KeyID == "" {
		opts.Keys.KeyID = keyID(opts.Keys.HMACKey)
	}
	if opts.CheckpointEvery <= 0 {
		opts.CheckpointEvery = 256
	}
	if opts.CheckpointInterval == 0 {
		opts.CheckpointInterval = time.Minute
	}
	if opts.SyncDelay <= 0 {
		opts.SyncDelay = 100 * time.Millisecond
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}

	// Checkpoints first: any checkpoint in the file covers committed rows.
	cps, problem, err := readCheckpoints(opts.CheckpointPath, opts.Keys.Verifier)
	if err != nil {
		return nil, err
	}
	if problem != "" {
		return nil, fmt.Errorf("%w: %s: %s", ErrIntegrity, opts.CheckpointPath, problem)
	}
	db, err := openWriter(ctx, opts.Path)
	if err != nil {
		return nil, err
	}
	stmts, err := prepare(ctx, db)
	if err != nil {
		db.Close()
		return nil, err
	}
	l := &Log{db: db, stmts: stmts, opts: opts, queue: make(chan *pending), writerDone: make(chan struct{}),
		sem: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	fail := func(err error) (*Log, error) {
		return nil, errors.Join(err, stmts.close(), db.Close())
	}
	if err := l.loadState(ctx); err != nil {
		return fail(err)
	}
	if len(cps) > 0 {
		if err := l.checkAgainst(ctx, cps[len(cps)-1]); err != nil {
			return fail(err)
		}
		l.cpSize = cps[len(cps)-1].Size
	}
	if statedb.IsPostgresURL(opts.Path) {
		l.wal = committed{}
	} else {
		l.wal = startSyncer(opts.Path+"-wal", l.lastSeq, opts.SyncDelay, opts.syncDone)
	}
	l.startTimer()
	l.startWriter()
	return l, nil
}

// loadState reads the last row, checks its MAC and its link to the row
// before it, and checks the stored tree is as long as the log.
func (l *Log) loadState(ctx context.Context) error {
	return l.loadStateFrom(ctx, l.db, l.stmts.readHash)
}

// loadStateFrom is loadState through q and readHash, which may be the
// append's transaction and its statement (another replica appended since
// this Log's last row).
func (l *Log) loadStateFrom(ctx context.Context, q queryer, readHash *sql.Stmt) error {
	rows, err := q.QueryContext(ctx, selectRow+" ORDER BY seq DESC LIMIT 2")
	if err != nil {
		return fmt.Errorf("audit: read tail: %w", err)
	}
	var tail []storedRow
	for rows.Next() {
		r, err := scanRow(rows)
		if err != nil {
			rows.Close()
			return fmt.Errorf("audit: read tail: %w", err)
		}
		tail = append(tail, r)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("audit: read tail: %w", err)
	}
	l.lastSeq, l.lastMAC, l.lastTS = 0, zeroMAC, time.Time{}
	if len(tail) == 0 {
		return checkTreeSize(ctx, q, 0)
	}
	last := tail[0]
	prev := zeroMAC
	if len(tail) == 2 {
		prev = tail[1].MAC
		if tail[1].Seq != last.Seq-1 {
			return fmt.Errorf("%w: missing row before seq %d", ErrIntegrity, last.Seq)
		}
	} else if last.Seq != 1 {
		return fmt.Errorf("%w: log starts at seq %d", ErrIntegrity, last.Seq)
	}
	if last.KeyID != l.opts.Keys.KeyID {
		return fmt.Errorf("%w: last row was written with key id %q, current key id is %q", ErrIntegrity, last.KeyID, l.opts.Keys.KeyID)
	}
	if !hmac.Equal(last.PrevMAC, prev) {
		return fmt.Errorf("%w: prev_mac mismatch at seq %d", ErrIntegrity, last.Seq)
	}
	if p := last.check(l.opts.Keys.HMACKey, prev); p != "" {
		return fmt.Errorf("%w: %s at seq %d", ErrIntegrity, p, last.Seq)
	}
	ts, err := time.Parse(time.RFC3339Nano, last.TS)
	if err != nil {
		return fmt.Errorf("%w: bad timestamp at seq %d", ErrIntegrity, last.Seq)
	}
	l.lastSeq, l.lastMAC, l.lastTS = last.Seq, last.MAC, ts
	if err := checkTreeSize(ctx, q, last.Seq); err != nil {
		return err
	}
	// The stored tree must end with this row's leaf, or checkpoints signed
	// from it would not cover what the table holds.
	h, err := hashReader{ctx: ctx, stmt: readHash}.ReadHashes([]int64{tlog.StoredHashIndex(0, last.Seq-1)})
	if err != nil {
		return fmt.Errorf("audit: read tree: %w", err)
	}
	if !bytes.Equal(h[0][:], last.Leaf) {
		return fmt.Errorf("%w: stored tree does not match seq %d", ErrIntegrity, last.Seq)
	}
	return nil
}

func checkTreeSize(ctx context.Context, q querier, n int64) error {
	var next int64
	if err := q.QueryRowContext(ctx, "SELECT coalesce(max(idx), -1) + 1 FROM audit_tree").Scan(&next); err != nil {
		return fmt.Errorf("audit: read tree: %w", err)
	}
	if next != tlog.StoredHashCount(n) {
		return fmt.Errorf("%w: stored tree has %d hashes, want %d for %d rows", ErrIntegrity, next, tlog.StoredHashCount(n), n)
	}
	return nil
}

// checkAgainst compares the log with its newest checkpoint.
func (l *Log) checkAgainst(ctx context.Context, cp checkpoint) error {
	if cp.Size > l.lastSeq {
		return fmt.Errorf("%w: truncated below checkpoint (size %d, rows %d)", ErrIntegrity, cp.Size, l.lastSeq)
	}
	if cp.Size == 0 {
		return nil
	}
	root, err := tlog.TreeHash(cp.Size, hashReader{ctx: ctx, stmt: l.stmts.readHash})
	if err != nil {
		return fmt.Errorf("audit: tree hash: %w", err)
	}
	if root != cp.Root {
		return fmt.Errorf("%w: checkpoint root mismatch (size %d)", ErrIntegrity, cp.Size)
	}
	return nil
}

// querier is satisfied by *sql.DB and *sql.Tx.
type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// queryer is a querier that also returns row sets.
type queryer interface {
	querier
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// hashReader reads stored tree hashes for tlog with the prepared
// readHash statement (of the writer's pool or transaction).
type hashReader struct {
	ctx  context.Context
	stmt *sql.Stmt
}

func (r hashReader) ReadHashes(indexes []int64) ([]tlog.Hash, error) {
	out := make([]tlog.Hash, len(indexes))
	for i, idx := range indexes {
		var b []byte
		if err := r.stmt.QueryRowContext(r.ctx, idx).Scan(&b); err != nil {
			return nil, fmt.Errorf("stored hash %d: %w", idx, err)
		}
		if len(b) != tlog.HashSize {
			return nil, fmt.Errorf("stored hash %d: bad length", idx)
		}
		copy(out[i][:], b)
	}
	return out, nil
}

func (l *Log) lock(ctx context.Context) error {
	select {
	case l.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (l *Log) unlock() { <-l.sem }
