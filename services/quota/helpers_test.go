package quota

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// clock is a manually advanced time source for the now hook.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock(t time.Time) *clock { return &clock{t: t} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// t0 is a window-aligned instant (a UTC midnight, so also a minute and
// hour boundary) that tests offset from.
var t0 = time.Date(2025, 3, 10, 0, 0, 0, 0, time.UTC)

func dbPath(t testing.TB) string { return filepath.Join(t.TempDir(), "state.db") }

// eachStore runs fn once per store (a state.db file, a PostgreSQL
// database), handing it that store's dbPath.
func eachStore(t *testing.T, fn func(t *testing.T, dbPath func(testing.TB) string)) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) { fn(t, st.Loc) })
}

func openStore(t testing.TB, path string, c *clock) *Store {
	t.Helper()
	s, err := Open(context.Background(), path, c.Now)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func mustAllow(t *testing.T, s *Store, p string, l Limits) Decision {
	t.Helper()
	d, err := s.AllowCall(context.Background(), p, l)
	if err != nil {
		t.Fatalf("AllowCall: %v", err)
	}
	return d
}

// charge records d of execution time for p: a 1 ms reservation settled
// with d.
func charge(t testing.TB, s *Store, p string, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	_, r, err := s.ReserveExecution(ctx, p, Limits{ExecutionPerDay: 1 << 62}, time.Millisecond)
	if err == nil {
		err = s.SettleExecution(ctx, r, d)
	}
	if err != nil {
		t.Fatalf("charge: %v", err)
	}
}
