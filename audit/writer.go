package audit

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// maxBatch bounds the rows of one transaction.
const maxBatch = 256

// statements are the writer connection's prepared statements, parsed once
// for the life of the Log.
type statements struct {
	insertRow, insertHash, readHash, lastSeq, tail *sql.Stmt
	all                                            statedb.Stmts
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
		statedb.Query{Dst: &s.lastSeq, SQL: `SELECT coalesce(max(seq), 0) FROM audit`},
		statedb.Query{Dst: &s.tail, SQL: `SELECT seq, mac FROM audit ORDER BY seq DESC LIMIT 1`})
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
func (l *Log) startWriter() {
	go func() {
		defer close(l.writerDone)
		for {
			select {
			case first := <-l.queue:
				l.sem <- struct{}{}
				l.writeBatch(l.gather(first))
				l.unlock()
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
//
// When the queue runs dry it yields the processor once before giving up:
// goroutines runnable at that moment (on a busy broker, usually calls about
// to append their rows) run first and join the batch instead of paying for
// a transaction each. On an idle broker there is nothing to run and the
// yield costs well under a microsecond. With 8 clients on 2 cores:
// 2.4 rows per transaction instead of 1.35.
func (l *Log) gather(first *pending) []*pending {
	limit := int64(maxBatch)
	if room := l.cpSize + int64(l.opts.CheckpointEvery) - l.lastSeq; room > 0 && room < limit {
		limit = room
	}
	batch := []*pending{first}
	yielded := false
	for int64(len(batch)) < limit {
		select {
		case p := <-l.queue:
			batch = append(batch, p)
		default:
			if yielded {
				return batch
			}
			yielded = true
			runtime.Gosched()
		}
	}
	return batch
}

// durability makes committed rows durable and tells their callers: on
// SQLite the syncer fdatasyncs the WAL; on PostgreSQL a commit is durable
// when it returns (committed).
type durability interface {
	// commit records rows committed up to seq; intents' callers are
	// told once they are durable.
	commit(seq int64, intents []row)
	// now makes every committed row durable (before a checkpoint).
	now() error
	// failed returns the failure that broke the log, if any.
	failed() error
	// close makes what is left durable; the writer must have stopped.
	close()
}

// committed is PostgreSQL's durability: the server flushes its WAL before
// COMMIT returns (synchronous_commit=on, which statedb.OpenPostgres sets),
// and the advisory lock already serialises the writers, so there is
// nothing to wait for.
type committed struct{}

func (committed) commit(_ int64, intents []row) {
	for _, r := range intents {
		r.p.finish(r.seq, nil)
	}
}
func (committed) now() error    { return nil }
func (committed) failed() error { return nil }
func (committed) close()        {}

// syncer makes committed rows durable with one fsync of the WAL file for
// as many commits as came before it (what synchronous=FULL would do at
// every commit), on a goroutine of its own so the writer commits the next
// batch meanwhile. Intent rows wait for it; after commits with none, it
// syncs delay later.
type syncer struct {
	path  string
	delay time.Duration
	done  chan<- error // test hook: each delayed sync's result

	soon, wake, stop chan struct{} // cap 1, cap 1, closed by close
	exited           chan struct{}
	stopOnce         sync.Once

	mu        sync.Mutex
	committed int64 // last seq committed
	synced    int64 // last seq known durable
	waiting   []row // intent rows waiting for synced >= their seq, in seq order
	err       error // the first sync failure; final
}

func startSyncer(path string, seq int64, delay time.Duration, done chan<- error) *syncer {
	s := &syncer{path: path, delay: delay, done: done, committed: seq, synced: seq,
		soon: make(chan struct{}, 1), wake: make(chan struct{}, 1), stop: make(chan struct{}), exited: make(chan struct{})}
	go s.run()
	return s
}

func (s *syncer) run() {
	defer close(s.exited)
	var due <-chan time.Time
	for {
		select {
		case <-s.wake:
			_ = s.now()
		case <-s.soon:
			if due == nil {
				due = time.After(s.delay)
			}
		case <-due:
			due = nil
			err := s.now()
			if s.done != nil {
				s.done <- err
			}
		case <-s.stop:
			_ = s.now()
			return
		}
	}
}

// commit records rows committed up to seq; intents wait for their
// fsync, which it asks for at once (else within the delay).
func (s *syncer) commit(seq int64, intents []row) {
	s.mu.Lock()
	s.committed = seq
	s.waiting = append(s.waiting, intents...)
	s.mu.Unlock()
	ch := s.soon
	if len(intents) > 0 {
		ch = s.wake
	}
	select {
	case ch <- struct{}{}:
	default: // already asked
	}
}

// now fsyncs the WAL if rows were committed since the last fsync, and
// returns the rows it made durable to their callers (with its error, if it
// failed: then they must be treated as not written). A failure is final:
// the kernel may have dropped the pages it could not write, so a later
// fsync's success would not cover them; the log refuses rows until the
// broker reopens it.
func (s *syncer) now() error {
	s.mu.Lock()
	target, err := s.committed, s.err
	if err == nil && target == s.synced && len(s.waiting) == 0 {
		s.mu.Unlock()
		return nil
	}
	s.mu.Unlock()
	if err == nil {
		if err = syncFile(s.path); err != nil {
			err = fmt.Errorf("audit: sync: %w", err)
		}
	}
	s.mu.Lock()
	if err == nil {
		s.synced = max(s.synced, target)
	} else if s.err == nil {
		s.err = err
	}
	n := 0
	for n < len(s.waiting) && s.waiting[n].seq <= target {
		n++
	}
	done := s.waiting[:n]
	s.waiting = s.waiting[n:]
	s.mu.Unlock()
	for _, r := range done {
		r.p.finish(r.seq, err)
	}
	return err
}

// failed returns the sync failure that broke the log, if any.
func (s *syncer) failed() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// close syncs what is left and stops the goroutine; the writer must have
// stopped.
func (s *syncer) close() {
	s.stopOnce.Do(func() { close(s.stop) })
	<-s.exited
}

// syncFile makes the file at path durable with fdatasync, as SQLite syncs
// its WAL: the data and what reading it back needs (its size), not its
// times. SQLite holds no lock on the WAL file that closing another
// descriptor of it could drop.
func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	err = unix.Fdatasync(int(f.Fd()))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
