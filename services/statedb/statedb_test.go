package statedb

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/migrate"
	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// TestConcurrentOpensMigrateOnce: handles opening a fresh store at once (as
// the broker's packages do at start, or two brokers on one root or one
// DATABASE_URL) apply each step exactly once; the steps fail if run twice.
func TestConcurrentOpensMigrateOnce(t *testing.T) {
	statedbtest.Run(t, testConcurrentOpensMigrateOnce)
}

func testConcurrentOpensMigrateOnce(t *testing.T, st statedbtest.Store) {
	path := st.Loc(t)
	s := Schema{Component: "test", Steps: []string{
		`CREATE TABLE t (a INTEGER NOT NULL)`,
		`ALTER TABLE t ADD COLUMN b INTEGER NOT NULL DEFAULT 0`,
		`INSERT INTO t (a, b) VALUES (1, 2)`,
	}}
	other := Schema{Component: "other", Steps: []string{`CREATE TABLE u (a INTEGER NOT NULL)`}}
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sc := s
			if i%2 == 1 {
				sc = other
			}
			db, err := Open(context.Background(), path, sc)
			if err == nil {
				err = db.Close()
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("open %d: %v", i, err)
		}
	}
	db, err := Open(context.Background(), path, s)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var n, b int
	if err := db.QueryRow(`SELECT count(*), max(b) FROM t`).Scan(&n, &b); err != nil || n != 1 || b != 2 {
		t.Fatalf("t has %d rows (b=%d), want the one step 3 inserted: %v", n, b, err)
	}
	got := map[string]int{}
	rows, err := db.Query(`SELECT component, version FROM schema_versions`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var c string
		var v int
		if err := rows.Scan(&c, &v); err != nil {
			t.Fatal(err)
		}
		got[c] = v
	}
	if len(got) != 2 || got["test"] != 3 || got["other"] != 1 {
		t.Fatalf("schema_versions = %v", got)
	}
	if st.Name != "sqlite" {
		return
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("state.db mode: %v, %v", fi, err)
	}
}

// A store a newer broker migrated further is refused, not used.
func TestNewerSchemaRefused(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		path := st.Loc(t)
		newer := Schema{Component: "test", Steps: []string{`CREATE TABLE t (a INTEGER)`, `CREATE TABLE u (a INTEGER)`}}
		db, err := Open(context.Background(), path, newer)
		if err != nil {
			t.Fatal(err)
		}
		db.Close()
		if _, err := Open(context.Background(), path, Schema{Component: "test", Steps: newer.Steps[:1]}); !errors.Is(err, migrate.ErrTooNew) {
			t.Fatalf("older broker on a newer store: %v", err)
		}
	})
}
