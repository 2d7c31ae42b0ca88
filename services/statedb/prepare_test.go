package statedb_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// TestPreparedStatementsSurviveMigrations: packages keep their statements
// prepared for the life of their handle while another opener of state.db
// migrates it (new tables, a new column and an index on their own tables):
// every statement still runs, and what it reads and writes is right. On
// PostgreSQL the statements are prepared through the dialect layer (their
// placeholders renumbered) and run inside its locked transactions.
func TestPreparedStatementsSurviveMigrations(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) { testPreparedStatementsSurviveMigrations(t, st.Loc(t)) })
}

func testPreparedStatementsSurviveMigrations(t *testing.T, path string) {
	ctx := context.Background()
	root := t.TempDir()
	q, err := quota.Open(ctx, path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	s, err := sessions.Open(ctx, sessions.Options{DBPath: path, Root: root})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(ctx)
	j, err := jobs.Open(ctx, jobs.Options{DBPath: path, Dir: filepath.Join(root, "jobs")})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close(ctx)

	l := quota.Limits{CallsPerMinute: 100, SandboxesPerHour: 10, ExecutionPerDay: time.Hour}
	use := func(round int) {
		t.Helper()
		if d, err := q.AllowCall(ctx, "p", l); err != nil || !d.Allowed {
			t.Fatalf("round %d: AllowCall: %+v %v", round, d, err)
		}
		_, r, err := q.ReserveExecution(ctx, "p", l, time.Second)
		if err == nil {
			err = q.RenewExecution(ctx, r)
		}
		if err == nil {
			err = q.SettleExecution(ctx, r, 250*time.Millisecond)
		}
		if err != nil {
			t.Fatalf("round %d: execution budget: %v", round, err)
		}
		u, err := q.Usage(ctx, "p", l)
		if err != nil || u.CallsUsedLastMinute != int64(round) || u.ExecutionUsedToday != time.Duration(round)*250*time.Millisecond {
			t.Fatalf("round %d: Usage %+v %v", round, u, err)
		}
		if _, _, err := s.Owner(ctx, "0123456789abcdef0123456789abcdef"); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
			t.Fatalf("round %d: sessions Owner: %v", round, err)
		}
		if _, err := j.Status(ctx, "p", "exec_0123456789abcdef0123456789abcdef"); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
			t.Fatalf("round %d: jobs Status: %v", round, err)
		}
	}
	use(1)
	// Another opener's migration, while every handle above stays open.
	later, err := statedb.Open(ctx, path, statedb.Schema{Component: "later", Steps: []string{
		`CREATE TABLE later_things (a INTEGER NOT NULL)`,
		`ALTER TABLE quota_buckets ADD COLUMN note TEXT NOT NULL DEFAULT '';
		ALTER TABLE quota_reservations ADD COLUMN note TEXT NOT NULL DEFAULT '';
		ALTER TABLE sessions ADD COLUMN note TEXT NOT NULL DEFAULT '';
		ALTER TABLE jobs ADD COLUMN note TEXT NOT NULL DEFAULT '';
		CREATE INDEX quota_buckets_kind ON quota_buckets (kind, window_start);`,
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer later.Close()
	use(2)
	if _, err := later.Exec(`DROP INDEX quota_buckets_kind`); err != nil {
		t.Fatal(err)
	}
	use(3)
	var n int
	if err := later.QueryRow(`SELECT count(*) FROM quota_buckets WHERE principal = 'p'`).Scan(&n); err != nil || n < 2 {
		t.Fatalf("quota rows after the migration: %d %v", n, err)
	}
	if err := errors.Join(q.Ping(ctx), s.Ping(ctx), j.Ping(ctx)); err != nil {
		t.Fatal(err)
	}
}
