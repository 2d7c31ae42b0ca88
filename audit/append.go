package audit

import (
	"context"
	"crypto/hmac"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"golang.org/x/mod/sumdb/tlog"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// Append writes r as the next row and returns its seq. An intent row is
// durable (fsynced) when Append returns; an outcome row is committed: it
// is visible to readers and survives the broker's crash at once, and a
// power loss once the next intent row, the next checkpoint or SyncDelay
// has synced the log (see syncer; on PostgreSQL every row is durable
// once committed, see committed). Any error means the row must be
// treated as not written and the caller should refuse the action. If the
// row was written but the checkpoint its batch triggered failed, Append
// returns the seq and the checkpoint error.
//
// Concurrent callers' rows are written by one writer goroutine in one
// transaction, so they share one fsync (group commit); on PostgreSQL,
// one commit under the audit advisory lock.
func (l *Log) Append(ctx context.Context, r Record) (int64, error) {
	rec, err := normalise(r)
	if err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	p := &pending{ctx: ctx, rec: rec, done: make(chan struct{})}
	select {
	case l.queue <- p:
	case <-l.writerDone:
		return 0, ErrClosed
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	select {
	case <-p.done:
		return p.seq, p.err
	case <-ctx.Done():
		// The row may still be written: an intent without its outcome,
		// as after a crash.
		return 0, ctx.Err()
	}
}

// pending is one Append waiting for its batch.
type pending struct {
	ctx  context.Context
	rec  Record
	done chan struct{} // closed once seq and err are set
	seq  int64
	err  error
}

func (p *pending) finish(seq int64, err error) {
	p.seq, p.err = seq, err
	close(p.done)
}

// row is a pending record with its place in the chain.
type row struct {
	p    *pending
	seq  int64
	ts   string
	at   time.Time
	leaf tlog.Hash
	mac  []byte
}

// writeBatch appends batch in one transaction, committed without an
// fsync (synchronous=NORMAL): its outcome rows' callers return at once,
// its intent rows' once the syncer has fsynced the WAL, while the writer
// goes on with the next batch. A batch that reaches CheckpointEvery waits
// for the checkpoint (which syncs first). Caller holds sem.
func (l *Log) writeBatch(batch []*pending) {
	var live []*pending
	for _, p := range batch {
		if err := p.ctx.Err(); err != nil {
			p.finish(0, err) // its caller gave up before the batch began
			continue
		}
		live = append(live, p)
	}
	if len(live) == 0 {
		return
	}
	failed := l.wal.failed() // rows after a failed fsync could be lost with it
	if l.closed {
		failed = ErrClosed
	}
	if failed != nil {
		for _, p := range live {
			p.finish(0, failed)
		}
		return
	}
	// No deadline: the driver would watch it with a goroutine per
	// statement, and a deadline cannot cut a write the disk holds up.
	ctx := context.Background()
	rows, err := l.insert(ctx, live)
	if err != nil {
		// Resynchronise in case the commit outcome is unknown; the chain
		// trigger rejects anything that does not follow the stored tail.
		if rerr := l.loadState(ctx); rerr != nil {
			err = errors.Join(err, rerr)
		}
		for _, p := range live {
			p.finish(0, err)
		}
		return
	}
	l.batches++
	last := rows[len(rows)-1]
	l.lastSeq, l.lastMAC, l.lastTS = last.seq, last.mac, last.at
	if l.lastSeq-l.cpSize >= int64(l.opts.CheckpointEvery) {
		l.wal.commit(last.seq, nil)
		err := l.checkpointLocked(ctx) // syncs first
		for _, r := range rows {
			r.p.finish(r.seq, err)
		}
		return
	}
	var intents []row
	for _, r := range rows {
		if r.p.rec.Phase == PhaseIntent {
			intents = append(intents, r)
		} else {
			r.p.finish(r.seq, nil)
		}
	}
	l.wal.commit(last.seq, intents)
}

// chain gives each record its seq, timestamp, leaf and MAC after the
// current tail.
func (l *Log) chain(batch []*pending) ([]row, error) {
	rows := make([]row, len(batch))
	seq, prev, last := l.lastSeq, l.lastMAC, l.lastTS
	for i, p := range batch {
		// Timestamps never go backwards, so Verify can check order.
		now := l.opts.Now().UTC()
		if now.Before(last) {
			now = last
		}
		seq++
		ts := now.Format(time.RFC3339Nano)
		body, err := bodyFor(bodyVersion, seq, ts, l.opts.Keys.KeyID, p.rec)
		if err != nil {
			return nil, fmt.Errorf("audit: encode row: %w", err)
		}
		b, err := marshalBody(body)
		if err != nil {
			return nil, fmt.Errorf("audit: encode row: %w", err)
		}
		leaf := leafHash(b)
		mac := computeMAC(l.opts.Keys.HMACKey, seq, prev, leaf)
		rows[i] = row{p: p, seq: seq, ts: ts, at: now, leaf: leaf, mac: mac}
		prev, last = mac, now
	}
	return rows, nil
}

// insert chains batch onto the stored tail and writes the rows and their
// tree hashes in one transaction with the prepared statements. The
// transaction holds the store's write lock from its start (BEGIN
// IMMEDIATE; on PostgreSQL the audit advisory lock), so on a store that
// broker replicas share the tail cannot move before it commits. A tail
// this Log did not write is verified before anything is chained onto it.
func (l *Log) insert(ctx context.Context, batch []*pending) ([]row, error) {
	tx, err := l.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("audit: begin: %w", statedb.Classify(err))
	}
	defer tx.Rollback()
	ins, tree := tx.StmtContext(ctx, l.stmts.insertRow), tx.StmtContext(ctx, l.stmts.insertHash)
	readHash := tx.StmtContext(ctx, l.stmts.readHash)
	var tailSeq int64
	var tailMAC []byte
	err = tx.StmtContext(ctx, l.stmts.tail).QueryRowContext(ctx).Scan(&tailSeq, &tailMAC)
	if errors.Is(err, sql.ErrNoRows) {
		tailSeq, tailMAC, err = 0, zeroMAC, nil
	}
	if err != nil {
		return nil, fmt.Errorf("audit: read tail: %w", statedb.Classify(err))
	}
	if tailSeq != l.lastSeq || !hmac.Equal(tailMAC, l.lastMAC) {
		if err := l.loadStateFrom(ctx, tx, readHash); err != nil {
			return nil, err
		}
	}
	rows, err := l.chain(batch)
	if err != nil {
		return nil, err
	}
	hr := hashReader{ctx: ctx, stmt: readHash}
	prev := l.lastMAC
	for _, w := range rows {
		r, o := w.p.rec, w.p.rec.Source
		_, err = ins.ExecContext(ctx, w.seq, w.ts, r.CallID, string(r.Phase), r.Principal, r.Tool, string(r.Params),
			string(r.Outcome), r.ErrorCode, r.DurationMS, w.leaf[:], prev, w.mac, l.opts.Keys.KeyID,
			bodyVersion, o.Transport, o.ClientAddr, o.UserAgent, o.MCPSession, o.Toolset)
		if err != nil {
			return nil, fmt.Errorf("audit: insert seq %d: %w", w.seq, statedb.Classify(err))
		}
		hashes, err := tlog.StoredHashesForRecordHash(w.seq-1, w.leaf, hr)
		if err != nil {
			return nil, fmt.Errorf("audit: tree hashes: %w", statedb.Classify(err))
		}
		base := tlog.StoredHashIndex(0, w.seq-1)
		for i, h := range hashes {
			if _, err := tree.ExecContext(ctx, base+int64(i), h[:]); err != nil {
				return nil, fmt.Errorf("audit: insert tree hash: %w", statedb.Classify(err))
			}
		}
		prev = w.mac
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("audit: commit seq %d: %w", rows[len(rows)-1].seq, statedb.Classify(err))
	}
	return rows, nil
}

// Checkpoint signs the current tree head and appends it to the checkpoint
// file. It is a no-op when no row was added since the last checkpoint.
func (l *Log) Checkpoint(ctx context.Context) error {
	if err := l.lock(ctx); err != nil {
		return err
	}
	defer l.unlock()
	if l.closed {
		return ErrClosed
	}
	return l.checkpointLocked(ctx)
}

func (l *Log) checkpointLocked(ctx context.Context) error {
	l.cpErr = l.writeCheckpoint(ctx)
	return l.cpErr
}

func (l *Log) writeCheckpoint(ctx context.Context) error {
	n := l.lastSeq
	if n == l.cpSize {
		return nil
	}
	// A checkpoint never claims rows that are not yet durable.
	if err := l.wal.now(); err != nil {
		return err
	}
	root, err := tlog.TreeHash(n, hashReader{ctx: ctx, stmt: l.stmts.readHash})
	if err != nil {
		return fmt.Errorf("audit: tree hash: %w", err)
	}
	msg, err := signCheckpoint(l.opts.Keys.Signer, n, root)
	if err != nil {
		return fmt.Errorf("audit: sign checkpoint: %w", err)
	}
	if err := appendCheckpoint(l.opts.CheckpointPath, n, msg); err != nil {
		return err
	}
	l.cpSize = n
	return nil
}

// Ping reports whether the log can still be written: it fails when the log
// is closed, the database is unreachable, its tail is not the one this Log
// wrote, the last checkpoint failed, or an fsync of the log failed.
func (l *Log) Ping(ctx context.Context) error {
	if err := l.lock(ctx); err != nil {
		return err
	}
	defer l.unlock()
	if l.closed {
		return ErrClosed
	}
	var last int64
	if err := l.stmts.lastSeq.QueryRowContext(ctx).Scan(&last); err != nil {
		return fmt.Errorf("audit: ping: %w", err)
	}
	switch {
	case last < l.lastSeq:
		return fmt.Errorf("%w: last seq is %d, expected %d", ErrIntegrity, last, l.lastSeq)
	case last > l.lastSeq:
		// Rows this Log did not write: another replica's, which must
		// verify (an outside writer's would not).
		if err := l.loadState(ctx); err != nil {
			return err
		}
	}
	return errors.Join(l.cpErr, l.wal.failed())
}

// Close writes the rows already handed to the writer, a final checkpoint,
// stops the timer and closes the database. Calling it again returns nil.
func (l *Log) Close() error {
	l.stopOnce.Do(func() { close(l.stop) })
	<-l.done
	<-l.writerDone
	l.wal.close()
	l.sem <- struct{}{}
	defer l.unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	err := l.checkpointLocked(context.Background())
	return errors.Join(err, l.stmts.close(), l.db.Close())
}

// startTimer runs timed checkpoints until Close.
func (l *Log) startTimer() {
	tick := l.opts.tick
	var ticker *time.Ticker
	if tick == nil && l.opts.CheckpointInterval > 0 {
		ticker = time.NewTicker(l.opts.CheckpointInterval)
		tick = ticker.C
	}
	go func() {
		defer close(l.done)
		if ticker != nil {
			defer ticker.Stop()
		}
		if tick == nil {
			<-l.stop
			return
		}
		for {
			select {
			case <-l.stop:
				return
			case <-tick:
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				err := l.Checkpoint(ctx)
				cancel()
				if l.opts.tickDone != nil {
					l.opts.tickDone <- err
				}
			}
		}
	}()
}
