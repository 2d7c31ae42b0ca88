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

// Append writes r as the next row in its own transaction and returns its
// seq once it is durable. Any error means the row must be treated as not
// written and the caller should refuse the action. If the row was written
// but the checkpoint it triggered failed, Append returns the seq and the
// checkpoint error.
func (l *Log) Append(ctx context.Context, r Record) (int64, error) {
	rec, err := normalise(r)
	if err != nil {
		return 0, err
	}
	if err := l.lock(ctx); err != nil {
		return 0, err
	}
	defer l.unlock()
	if l.closed {
		return 0, ErrClosed
	}
	seq, err := l.insert(ctx, rec)
	if err != nil {
		// Resynchronise in case the commit outcome is unknown; the chain
		// trigger rejects anything that does not follow the stored tail.
		if rerr := l.loadState(context.WithoutCancel(ctx)); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return 0, err
	}
	if seq-l.cpSize >= int64(l.opts.CheckpointEvery) {
		if err := l.checkpointLocked(ctx); err != nil {
			return seq, err
		}
	}
	return seq, nil
}

// insert chains rec onto the stored tail in one write transaction. The
// transaction holds the store's write lock from its start (BEGIN
// IMMEDIATE; on PostgreSQL the audit advisory lock), so on a store that
// broker replicas share the tail cannot move before it commits. A tail
// this Log did not write is verified before anything is chained onto it.
func (l *Log) insert(ctx context.Context, rec Record) (int64, error) {
	tx, err := l.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("audit: begin: %w", statedb.Classify(err))
	}
	defer tx.Rollback()
	var tailSeq int64
	var tailMAC []byte
	err = tx.QueryRowContext(ctx, "SELECT seq, mac FROM audit ORDER BY seq DESC LIMIT 1").Scan(&tailSeq, &tailMAC)
	if errors.Is(err, sql.ErrNoRows) {
		tailSeq, tailMAC, err = 0, zeroMAC, nil
	}
	if err != nil {
		return 0, fmt.Errorf("audit: read tail: %w", statedb.Classify(err))
	}
	if tailSeq != l.lastSeq || !hmac.Equal(tailMAC, l.lastMAC) {
		if err := l.loadStateFrom(ctx, tx); err != nil {
			return 0, err
		}
	}
	// Timestamps never go backwards, so Verify can check order.
	now := l.opts.Now().UTC()
	if now.Before(l.lastTS) {
		now = l.lastTS
	}
	ts := now.Format(time.RFC3339Nano)
	seq := l.lastSeq + 1
	body, err := bodyFor(bodyVersion, seq, ts, l.opts.Keys.KeyID, rec)
	if err != nil {
		return 0, fmt.Errorf("audit: encode row: %w", err)
	}
	b, err := marshalBody(body)
	if err != nil {
		return 0, fmt.Errorf("audit: encode row: %w", err)
	}
	leaf := leafHash(b)
	mac := computeMAC(l.opts.Keys.HMACKey, seq, l.lastMAC, leaf)
	o := rec.Source
	_, err = tx.ExecContext(ctx, `INSERT INTO audit(seq, ts, call_id, phase, principal, tool, params,
		outcome, error_code, duration_ms, leaf, prev_mac, mac, kid,
		body_version, transport, client_addr, user_agent, mcp_session, toolset)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		seq, ts, rec.CallID, string(rec.Phase), rec.Principal, rec.Tool, string(rec.Params),
		string(rec.Outcome), rec.ErrorCode, rec.DurationMS, leaf[:], l.lastMAC, mac, l.opts.Keys.KeyID,
		bodyVersion, o.Transport, o.ClientAddr, o.UserAgent, o.MCPSession, o.Toolset)
	if err != nil {
		return 0, fmt.Errorf("audit: insert seq %d: %w", seq, statedb.Classify(err))
	}
	hashes, err := tlog.StoredHashesForRecordHash(seq-1, leaf, hashReader{ctx: ctx, q: tx})
	if err != nil {
		return 0, fmt.Errorf("audit: tree hashes: %w", statedb.Classify(err))
	}
	base := tlog.StoredHashIndex(0, seq-1)
	for i, h := range hashes {
		if _, err := tx.ExecContext(ctx, "INSERT INTO audit_tree(idx, hash) VALUES (?, ?)", base+int64(i), h[:]); err != nil {
			return 0, fmt.Errorf("audit: insert tree hash: %w", statedb.Classify(err))
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("audit: commit seq %d: %w", seq, statedb.Classify(err))
	}
	l.lastSeq, l.lastMAC, l.lastTS = seq, mac, now
	return seq, nil
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
	root, err := tlog.TreeHash(n, hashReader{ctx: ctx, q: l.db})
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
// wrote, or the last checkpoint failed.
func (l *Log) Ping(ctx context.Context) error {
	if err := l.lock(ctx); err != nil {
		return err
	}
	defer l.unlock()
	if l.closed {
		return ErrClosed
	}
	var last int64
	if err := l.db.QueryRowContext(ctx, "SELECT coalesce(max(seq), 0) FROM audit").Scan(&last); err != nil {
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
	return l.cpErr
}

// Close writes a final checkpoint, stops the timer and closes the database.
// Calling it again returns nil.
func (l *Log) Close() error {
	l.stopOnce.Do(func() { close(l.stop) })
	<-l.done
	l.sem <- struct{}{}
	defer l.unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	return errors.Join(l.checkpointLocked(context.Background()), l.db.Close())
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
