package audit

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// Two brokers (replicas) on one PostgreSQL database append concurrently:
// the advisory lock makes them take turns, each chains onto the other's
// rows, and the log verifies against either replica's checkpoints, kept
// in a file of each replica's own or in one file they share on one host.
func TestReplicasShareOneChain(t *testing.T) {
	for _, shared := range []bool{false, true} {
		t.Run(map[bool]string{false: "own_checkpoints", true: "shared_checkpoints"}[shared], func(t *testing.T) {
			testReplicasShareOneChain(t, shared)
		})
	}
}

func testReplicasShareOneChain(t *testing.T, sharedCheckpoints bool) {
	a := newPostgresFixture(t)
	a.opts.CheckpointEvery = 16
	b := *a
	if !sharedCheckpoints {
		b.opts.CheckpointPath = filepath.Join(t.TempDir(), "audit.checkpoints")
	}
	la, lb := a.open(t), b.open(t)
	const each = 60
	var wg sync.WaitGroup
	seqs := make(chan int64, 4*each)
	for i, l := range []*Log{la, lb, la, lb} {
		wg.Go(func() {
			for j := range each {
				seq, err := l.Append(context.Background(), testRecord(i*each+j))
				if err != nil {
					t.Errorf("replica append: %v", err)
					return
				}
				seqs <- seq
			}
		})
	}
	wg.Wait()
	close(seqs)
	seen := map[int64]bool{}
	for s := range seqs {
		if seen[s] {
			t.Fatalf("seq %d given twice", s)
		}
		seen[s] = true
	}
	if len(seen) != 4*each {
		t.Fatalf("%d seqs, want %d", len(seen), 4*each)
	}
	for _, l := range []*Log{la, lb} {
		if err := l.Ping(context.Background()); err != nil {
			t.Fatalf("Ping after the other replica appended: %v", err)
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []*fixture{a, &b} {
		if rep := f.verify(t); !rep.OK || rep.Rows != 4*each || rep.Checkpoints < 2 {
			t.Fatalf("Verify with %s: %+v", filepath.Base(filepath.Dir(f.opts.CheckpointPath)), rep)
		}
	}
}

// The PL/pgSQL triggers hold the same rules as SQLite's: no UPDATE,
// DELETE or TRUNCATE, and no INSERT off the end of the chain.
func TestPostgresTriggersBlockRewrites(t *testing.T) {
	f := newPostgresFixture(t)
	l := f.open(t)
	fill(t, l, 4)
	l.Close()
	db := rawDB(t, f.opts.Path)
	for _, q := range []string{
		"UPDATE audit SET principal = 'mallory' WHERE seq = 2",
		"DELETE FROM audit WHERE seq = 4",
		"TRUNCATE audit",
		"UPDATE audit_tree SET hash = hash",
		"DELETE FROM audit_tree",
		"TRUNCATE audit_tree",
		`INSERT INTO audit SELECT seq + 10, ts, call_id, phase, principal, tool, params, outcome, error_code,
			duration_ms, leaf, prev_mac, mac, kid FROM audit WHERE seq = 4`,
		`INSERT INTO audit SELECT seq + 1, ts, call_id, phase, principal, tool, params, outcome, error_code,
			duration_ms, leaf, prev_mac, mac, kid FROM audit WHERE seq = 4`,
		"INSERT INTO audit_tree(idx, hash) VALUES (1000, '\\x00')",
	} {
		_, err := db.Exec(q)
		if err == nil || !strings.Contains(err.Error(), "append-only") && !strings.Contains(err.Error(), "violation") {
			t.Errorf("%s: %v, want a trigger's refusal", q, err)
		}
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != 4 {
		t.Fatalf("Verify: %+v", rep)
	}
}
