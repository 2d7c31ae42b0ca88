package audit

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// testKeys creates a fresh key set under a temp root.
func testKeys(t testing.TB) (Keys, KeyConfig) {
	t.Helper()
	cfg := KeyConfig{Root: t.TempDir()}
	k, err := LoadKeys(cfg)
	if err != nil {
		t.Fatalf("LoadKeys: %v", err)
	}
	return k, cfg
}

// clock is a deterministic Now hook that advances 1ms per call.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(time.Millisecond)
	return c.t
}

type fixture struct {
	dir  string
	keys Keys
	opts Options
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	dir := t.TempDir()
	return newFixtureAt(t, dir, filepath.Join(dir, "audit.db"))
}

// newPostgresFixture keeps the log in a fresh PostgreSQL database.
func newPostgresFixture(t testing.TB) *fixture {
	t.Helper()
	return newFixtureAt(t, t.TempDir(), statedbtest.PostgresURL(t))
}

// eachStore runs fn with fixtures on each store: the SQLite file and a
// PostgreSQL database.
func eachStore(t *testing.T, fn func(t *testing.T, newFixture func(testing.TB) *fixture)) {
	t.Run("sqlite", func(t *testing.T) { fn(t, newFixture) })
	t.Run("postgres", func(t *testing.T) { fn(t, newPostgresFixture) })
}

func newFixtureAt(t testing.TB, dir, path string) *fixture {
	t.Helper()
	k, _ := testKeys(t)
	return &fixture{dir: dir, keys: k, opts: Options{
		Path:               path,
		CheckpointPath:     filepath.Join(dir, "audit.checkpoints"),
		Keys:               k,
		CheckpointEvery:    1000,
		CheckpointInterval: -1,
		Now:                newClock().Now,
	}}
}

func (f *fixture) open(t testing.TB) *Log {
	t.Helper()
	l, err := Open(context.Background(), f.opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return l
}

func (f *fixture) verify(t testing.TB) VerifyReport {
	t.Helper()
	rep, err := Verify(context.Background(), VerifyOptions{Path: f.opts.Path, CheckpointPath: f.opts.CheckpointPath, Keys: f.keys})
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	return rep
}

// fill appends n records and returns them as stored (normalised).
func fill(t testing.TB, l *Log, n int) []Record {
	t.Helper()
	var out []Record
	for i := range n {
		r := testRecord(i)
		seq, err := l.Append(context.Background(), r)
		if err != nil {
			t.Fatalf("Append %d: %v", i, err)
		}
		if seq != l.lastSeq || seq < 1 {
			t.Fatalf("Append %d returned seq %d, last %d", i, seq, l.lastSeq)
		}
		nr, _ := normalise(r)
		out = append(out, nr)
	}
	return out
}

func testRecord(i int) Record {
	r := Record{
		CallID:    fmt.Sprintf("call-%d", i/2),
		Phase:     PhaseIntent,
		Principal: fmt.Sprintf("user-%d", i%3),
		Tool:      "run_command",
		Params:    json.RawMessage(fmt.Sprintf(`{"cmd": "echo %d", "n": %d}`, i, i)),
	}
	if i%2 == 1 {
		r.Phase, r.Outcome, r.DurationMS = PhaseOutcome, OutcomeSuccess, int64(i)
		if i%5 == 0 {
			r.Outcome, r.ErrorCode = OutcomeFailure, "E_EXIT"
		}
	}
	return r
}

// rawDB opens the store the way an attacker would: a plain connection with
// none of the app's pragmas (on PostgreSQL, the dialect layer's
// placeholders only, so tamper statements are written once).
func rawDB(t testing.TB, path string) *sql.DB {
	t.Helper()
	open := func() (*sql.DB, error) { return sql.Open("sqlite", path) }
	if statedb.IsPostgresURL(path) {
		open = func() (*sql.DB, error) { return statedb.OpenPostgres(path, 0) }
	}
	db, err := open()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func mustExec(t testing.TB, db *sql.DB, q string, args ...any) {
	t.Helper()
	if _, err := db.Exec(q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// dropTriggers is the attacker's first step.
func dropTriggers(t testing.TB, db *sql.DB) {
	t.Helper()
	for _, tr := range []string{"audit_no_update", "audit_no_delete", "audit_chain"} {
		if isPostgres(db) {
			mustExec(t, db, "DROP TRIGGER "+tr+" ON audit")
		} else {
			mustExec(t, db, "DROP TRIGGER "+tr)
		}
	}
}

func isPostgres(db *sql.DB) bool {
	_, ok := db.Driver().(*stdlib.Driver)
	return ok
}
