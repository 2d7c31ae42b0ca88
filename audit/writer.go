package audit

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// Bounds of one batch: its rows, and how long its transaction may take.
const (
	maxBatch     = 256
	batchTimeout = 30 * time.Second
)

// statements are the writer connection's prepared statements, parsed once
// for the life of the Log.
type statements struct {
	insertRow, insertHash, readHash, lastSeq *sql.Stmt
	all                                      statedb.Stmts
}

func prepare(ctx context.Context, db *sql.DB) (statements, error) {
	var s statements
	var err error
	s.all, err = statedb.Prepare(ctx, db,
		statedb.Query{Dst: &s.insertRow, SQL: `INSERT INTO audit(seq, ts, call_id, phase, principal, tool, params,
			outcome, error_code, duration_ms, leaf, prev_mac, mac, kid,
			body_version, transport, client_addr, user_agent, mcp_session, toolset)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`},
		statedb.Query{Dst: &s.insertHash, SQL: `INSERT INTO audit_tree(idx, hash) VALUES (?, ?)`},
		statedb.Query{Dst: &s.readHash, SQL: `SELECT hash FROM audit_tree WHERE idx = ?`},
		statedb.Query{Dst: &s.lastSeq, SQL: `SELECT coalesce(max(seq), 0) FROM audit`})
	if err != nil {
		return s, fmt.Errorf("audit: %w", err)
	}
	return s, nil
}

func (s statements) close() error { return s.all.Close() }

// startWriter runs the writer goroutine until Close: it takes the first
// waiting Append, then every other one already waiting (up to maxBatch,
// and never past the next CheckpointEvery boundary, so checkpoints land on
// the same sizes as one row at a time), and writes them as one batch.
// SyncDelay after a batch that was not synced, it syncs the log unless an
// intent row or a checkpoint did so first.
func (l *Log) startWriter() {
	go func() {
		defer close(l.writerDone)
		var syncDue <-chan time.Time
		for {
			select {
			case first := <-l.queue:
				l.sem <- struct{}{}
				l.writeBatch(l.gather(first))
				if l.unsynced && syncDue == nil {
					syncDue = time.After(l.opts.SyncDelay)
				}
				l.unlock()
			case <-syncDue:
				syncDue = nil
				l.sem <- struct{}{}
				var err error
				if !l.closed {
					if err = l.syncLocked(); err != nil {
						l.cpErr = err
					}
				}
				l.unlock()
				if l.opts.syncDone != nil {
					l.opts.syncDone <- err
				}
			case <-l.stop:
				// Appends already waiting are written; later ones see
				// writerDone.
				l.sem <- struct{}{}
				for drained := false; !drained; {
					select {
					case p := <-l.queue:
						l.writeBatch(l.gather(p))
					default:
						drained = true
					}
				}
				l.unlock()
				return
			}
		}
	}()
}

// gather returns first and the Appends waiting behind it. Caller holds
// sem.
func (l *Log) gather(first *pending) []*pending {
	limit := int64(maxBatch)
	if room := l.cpSize + int64(l.opts.CheckpointEvery) - l.lastSeq; room > 0 && room < limit {
		limit = room
	}
	batch := []*pending{first}
	for int64(len(batch)) < limit {
		select {
		case p := <-l.queue:
			batch = append(batch, p)
		default:
			return batch
		}
	}
	return batch
}

// syncFile fsyncs the file at path (SQLite holds no lock on the WAL file
// that closing another descriptor of it could drop).
func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
