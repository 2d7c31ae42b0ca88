package statedb

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// One replica leads at a time; when its connection goes (the replica is
// killed, or the server drops it) another takes over, and the old one
// knows it no longer leads.
func TestLeaderElection(t *testing.T) {
	ctx := context.Background()
	url := statedbtest.PostgresURL(t)
	a, err := NewLeader(url)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := NewLeader(url)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if !a.Lead(ctx) || b.Lead(ctx) || !a.Lead(ctx) {
		t.Fatal("want a leading alone")
	}
	// The server drops a's connection, as when a replica is killed.
	admin, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	const held = `FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = $1
		AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`
	var n int
	if err := admin.QueryRow(`SELECT count(pg_terminate_backend(pid)) `+held, LeaderLockKey&0xffffffff).Scan(&n); err != nil || n != 1 {
		t.Fatalf("terminate the leader's session: %d, %v", n, err)
	}
	// The backend exits (and its lock goes) shortly after the signal.
	deadline := time.Now().Add(10 * time.Second)
	for n > 0 && time.Now().Before(deadline) {
		if err := admin.QueryRow(`SELECT count(*) `+held, LeaderLockKey&0xffffffff).Scan(&n); err != nil {
			t.Fatal(err)
		}
	}
	if !b.Lead(ctx) {
		t.Fatal("b did not take over from a dead leader")
	}
	if a.Lead(ctx) {
		t.Fatal("a still believes it leads")
	}
	b.Close()
	if !a.Lead(ctx) {
		t.Fatal("a did not take over after b gave up")
	}
}

// On SQLite every broker leads (one host, as before replicas).
func TestLeaderSQLiteAlwaysLeads(t *testing.T) {
	l, err := NewLeader(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if !l.Lead(context.Background()) {
		t.Fatal("SQLite broker does not lead")
	}
}

// A replica is alive while it holds its presence lock; once it closes (or
// dies) the others see it gone.
func TestPresence(t *testing.T) {
	ctx := context.Background()
	url := statedbtest.PostgresURL(t)
	a, err := NewPresence(url, "a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := NewPresence(url, "b")
	if err != nil {
		t.Fatal(err)
	}
	if !a.Keep(ctx) || !b.Keep(ctx) {
		t.Fatal("Keep")
	}
	for _, c := range []struct {
		who  string
		want bool
	}{{"a", true}, {"b", true}, {"c", false}, {"", false}} {
		if alive, err := a.Alive(ctx, c.who); err != nil || alive != c.want {
			t.Fatalf("Alive(%q) = %v, %v; want %v", c.who, alive, err, c.want)
		}
	}
	b.Close()
	if alive, err := a.Alive(ctx, "b"); err != nil || alive {
		t.Fatalf("b after Close: %v, %v", alive, err)
	}
	s, err := NewPresence(filepath.Join(t.TempDir(), "state.db"), "s")
	if err != nil {
		t.Fatal(err)
	}
	if alive, _ := s.Alive(ctx, "s"); !alive {
		t.Fatal("SQLite: self not alive")
	}
	if alive, _ := s.Alive(ctx, "other"); alive {
		t.Fatal("SQLite: another process counted alive")
	}
}
