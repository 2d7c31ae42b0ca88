package quota

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// race fires attempts AllowCall calls from each of goroutines goroutines,
// spread round-robin over stores, and returns how many were allowed.
func race(t *testing.T, stores []*Store, goroutines, attempts int, l Limits) int64 {
	t.Helper()
	var allowed atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, goroutines)
	for g := range goroutines {
		s := stores[g%len(stores)]
		wg.Go(func() {
			<-start
			for range attempts {
				d, err := s.AllowCall(context.Background(), "racer", l)
				if err != nil {
					errs <- err
					return
				}
				if d.Allowed {
					allowed.Add(1)
				}
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("AllowCall: %v", err)
	}
	return allowed.Load()
}

func TestConcurrentExactlyLimit(t *testing.T) { eachStore(t, testConcurrentExactlyLimit) }

func testConcurrentExactlyLimit(t *testing.T, dbPath func(testing.TB) string) {
	c := newClock(t0.Add(5 * time.Second))
	s := openStore(t, dbPath(t), c)
	l := Limits{CallsPerMinute: 37}
	if got := race(t, []*Store{s}, 50, 4, l); got != 37 {
		t.Fatalf("allowed %d of 200 racing calls, want exactly 37", got)
	}
}

// Two Stores on one file (or one DATABASE_URL) stand in for two broker
// processes (replicas): only SQLite's file locking, or the PostgreSQL
// advisory lock, serialises them. 50 callers race.
func TestConcurrentTwoStoresSameFile(t *testing.T) { eachStore(t, testConcurrentTwoStoresSameFile) }

func testConcurrentTwoStoresSameFile(t *testing.T, dbPath func(testing.TB) string) {
	c := newClock(t0.Add(5 * time.Second))
	path := dbPath(t)
	a, b := openStore(t, path, c), openStore(t, path, c)
	l := Limits{CallsPerMinute: 53}
	if got := race(t, []*Store{a, b}, 50, 4, l); got != 53 {
		t.Fatalf("allowed %d of 200 racing calls over two stores, want exactly 53", got)
	}
}

// The restart case: a quota exhausted before Close stays exhausted after
// reopening the same file.
func TestPersistsAcrossReopen(t *testing.T) { eachStore(t, testPersistsAcrossReopen) }

func testPersistsAcrossReopen(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0.Add(20 * time.Second))
	path := dbPath(t)
	l := LimitsFor(TierFree, 0)

	s, err := Open(ctx, path, c.Now)
	if err != nil {
		t.Fatal(err)
	}
	for range l.CallsPerMinute {
		if d, err := s.AllowCall(ctx, "dave", l); err != nil || !d.Allowed {
			t.Fatalf("%+v %v", d, err)
		}
	}
	for range l.SandboxesPerHour {
		if d, err := s.ReserveSandbox(ctx, "dave", l); err != nil || !d.Allowed {
			t.Fatalf("%+v %v", d, err)
		}
	}
	charge(t, s, "dave", 2*time.Hour)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s = openStore(t, path, c)
	if err := s.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if d := mustAllow(t, s, "dave", l); d.Allowed {
		t.Fatalf("calls reset by restart: %+v", d)
	}
	if d, err := s.ReserveSandbox(ctx, "dave", l); err != nil || d.Allowed {
		t.Fatalf("sandboxes reset by restart: %+v %v", d, err)
	}
	if d, _, err := s.ReserveExecution(ctx, "dave", l, time.Second); err != nil || d.Allowed {
		t.Fatalf("execution reset by restart: %+v %v", d, err)
	}
	if d := mustAllow(t, s, "erin", l); !d.Allowed {
		t.Fatalf("other principal affected: %+v", d)
	}
}

func TestFileModeAndSQLishPrincipal(t *testing.T) {
	c := newClock(t0)
	path := dbPath(t)
	s := openStore(t, path, c)
	evil := `x'); DROP TABLE quota_buckets; --`
	if d := mustAllow(t, s, evil, Limits{CallsPerMinute: 1}); !d.Allowed {
		t.Fatalf("%+v", d)
	}
	if d := mustAllow(t, s, evil, Limits{CallsPerMinute: 1}); d.Allowed {
		t.Fatalf("principal not stored verbatim: %+v", d)
	}
	if err := s.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{path, path + "-wal"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v, want 0600", p, fi.Mode().Perm())
		}
	}
}

func TestExistingFileTightened(t *testing.T) {
	path := dbPath(t)
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	openStore(t, path, newClock(t0))
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v %v, want 0600", fi.Mode().Perm(), err)
	}
}

func TestPrune(t *testing.T) { eachStore(t, testPrune) }

func testPrune(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0)
	s := openStore(t, dbPath(t), c)
	l := Limits{CallsPerMinute: 1 << 20, SandboxesPerHour: 1 << 20}
	mustAllow(t, s, "old", l)
	if _, err := s.ReserveSandbox(ctx, "old", l); err != nil {
		t.Fatal(err)
	}
	charge(t, s, "old", time.Minute)
	rows := func() (n int) {
		t.Helper()
		if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM quota_buckets WHERE principal = 'old'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := rows(); n != 3 {
		t.Fatalf("%d rows before prune, want 3", n)
	}
	c.Add(3 * 24 * time.Hour)
	for range pruneEvery {
		mustAllow(t, s, "new", l)
	}
	if n := rows(); n != 0 {
		t.Fatalf("%d stale rows after %d writes, want 0", n, pruneEvery)
	}
}

func TestErrors(t *testing.T) {
	ctx := context.Background()
	s := openStore(t, dbPath(t), newClock(t0))
	if _, err := s.AllowCall(ctx, "p", Limits{}); !errors.Is(err, ErrInvalidLimit) {
		t.Errorf("AllowCall zero limit: %v", err)
	}
	if _, err := s.ReserveSandbox(ctx, "p", Limits{}); !errors.Is(err, ErrInvalidLimit) {
		t.Errorf("ReserveSandbox zero limit: %v", err)
	}
	if _, _, err := s.ReserveExecution(ctx, "p", Limits{}, time.Second); !errors.Is(err, ErrInvalidLimit) {
		t.Errorf("ReserveExecution zero limit: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.AllowCall(cctx, "p", Limits{CallsPerMinute: 1}); err == nil {
		t.Error("AllowCall with cancelled context: no error")
	}
	if _, err := Open(ctx, t.TempDir()+"/missing/state.db", nil); err == nil {
		t.Error("Open in missing directory: no error")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AllowCall(ctx, "p", Limits{CallsPerMinute: 1}); err == nil {
		t.Error("AllowCall after Close: no error")
	}
	if err := s.Ping(ctx); err == nil {
		t.Error("Ping after Close: no error")
	}
}
