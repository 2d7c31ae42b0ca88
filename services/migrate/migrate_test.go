package migrate

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"

	_ "modernc.org/sqlite"
)

func openDB(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "t.db")+"?_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { db.Close() })
	return db
}

// apply runs Apply in its own transaction, committing only on success.
func apply(t *testing.T, db *sql.DB, st Store, steps Steps) (int, error) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	from, err := Apply(ctx, tx, st, steps)
	if err == nil {
		err = tx.Commit()
	}
	return from, err
}

func TestApplyRunsOnlyNewSteps(t *testing.T) {
	for name, st := range map[string]Store{"user_version": UserVersion("audit"), "component": Component("c")} {
		t.Run(name, func(t *testing.T) {
			db := openDB(t)
			// Not idempotent: a step run twice fails.
			steps := Steps{`CREATE TABLE t (a INTEGER)`, `INSERT INTO t (a) VALUES (1)`}
			if from, err := apply(t, db, st, steps); err != nil || from != 0 {
				t.Fatalf("fresh: from %d, %v", from, err)
			}
			if from, err := apply(t, db, st, steps); err != nil || from != 2 {
				t.Fatalf("again: from %d, %v", from, err)
			}
			steps = append(steps, `ALTER TABLE t ADD COLUMN b TEXT NOT NULL DEFAULT 'x'`)
			if from, err := apply(t, db, st, steps); err != nil || from != 2 {
				t.Fatalf("step 3: from %d, %v", from, err)
			}
			var n int
			var b string
			if err := db.QueryRow(`SELECT count(*), max(b) FROM t`).Scan(&n, &b); err != nil || n != 1 || b != "x" {
				t.Fatalf("rows %d, b %q, %v", n, b, err)
			}
		})
	}
}

func TestApplyRefusesNewerSchema(t *testing.T) {
	for name, st := range map[string]Store{"user_version": UserVersion("audit"), "component": Component("c")} {
		t.Run(name, func(t *testing.T) {
			db := openDB(t)
			if _, err := apply(t, db, st, Steps{`CREATE TABLE t (a)`, `CREATE TABLE u (a)`}); err != nil {
				t.Fatal(err)
			}
			from, err := apply(t, db, st, Steps{`CREATE TABLE t (a)`})
			if !errors.Is(err, ErrTooNew) || from != 2 {
				t.Fatalf("older steps on a newer schema: from %d, %v", from, err)
			}
		})
	}
}

// A failing step leaves neither its predecessors' changes nor a version.
func TestFailedStepChangesNothing(t *testing.T) {
	db := openDB(t)
	st := Component("c")
	if _, err := apply(t, db, st, Steps{`CREATE TABLE t (a)`, `CREATE TABLE t (a)`}); err == nil {
		t.Fatal("a failing step succeeded")
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM sqlite_schema WHERE name = 't'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("table t left behind: %d, %v", n, err)
	}
	if from, err := apply(t, db, st, Steps{`CREATE TABLE t (a)`}); err != nil || from != 0 {
		t.Fatalf("version recorded by a failed migration: from %d, %v", from, err)
	}
}

// Components sharing a database keep separate versions.
func TestComponentsAreIndependent(t *testing.T) {
	db := openDB(t)
	if _, err := apply(t, db, Component("a"), Steps{`CREATE TABLE a1 (x)`, `CREATE TABLE a2 (x)`}); err != nil {
		t.Fatal(err)
	}
	if from, err := apply(t, db, Component("b"), Steps{`CREATE TABLE b1 (x)`}); err != nil || from != 0 {
		t.Fatalf("b: from %d, %v", from, err)
	}
	if from, err := apply(t, db, Component("a"), Steps{`CREATE TABLE a1 (x)`, `CREATE TABLE a2 (x)`}); err != nil || from != 2 {
		t.Fatalf("a again: from %d, %v", from, err)
	}
}
