package quota

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestViewFollowsAnotherWriter: a Store whose view is stale (another
// Store, a second broker process or replica, wrote since) decides on the
// store: it neither admits past the limit nor refuses what the other freed.
func TestViewFollowsAnotherWriter(t *testing.T) { eachStore(t, testViewFollowsAnotherWriter) }

func testViewFollowsAnotherWriter(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0.Add(5 * time.Second))
	path := dbPath(t)
	a, b := openStore(t, path, c), openStore(t, path, c)
	calls := Limits{CallsPerMinute: 5}
	for range 3 {
		if d := mustAllow(t, a, "p", calls); !d.Allowed {
			t.Fatalf("a: %+v", d)
		}
	}
	for range 2 {
		if d := mustAllow(t, b, "p", calls); !d.Allowed {
			t.Fatalf("b: %+v", d)
		}
	}
	if d := mustAllow(t, a, "p", calls); d.Allowed {
		t.Fatalf("a admitted a 6th call of 5 from its own view: %+v", d)
	}
	if u, err := a.Usage(ctx, "p", calls); err != nil || u.CallsUsedLastMinute != 5 {
		t.Fatalf("a's usage after its next write: %+v %v", u, err)
	}

	exec := Limits{ExecutionPerDay: 10 * time.Second}
	_, ra, err := a.ReserveExecution(ctx, "q", exec, 6*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if d, _, err := b.ReserveExecution(ctx, "q", exec, 4*time.Second); err != nil || !d.Allowed {
		t.Fatalf("b reserving the rest: %+v %v", d, err)
	}
	if d, _, err := b.ReserveExecution(ctx, "q", exec, time.Millisecond); err != nil || d.Allowed {
		t.Fatalf("b reserved past the budget: %+v %v", d, err)
	}
	if err := a.SettleExecution(ctx, ra, time.Second); err != nil {
		t.Fatal(err)
	}
	// 1s spent, 4s held by b: 5s are free again, and b must see it.
	if d, _, err := b.ReserveExecution(ctx, "q", exec, 5*time.Second); err != nil || !d.Allowed || d.Remaining != 0 {
		t.Fatalf("b after a settled: %+v %v", d, err)
	}
}

// TestUsageIsServedFromTheView: once a Store holds a principal, get_usage
// never touches the database (here: closed under it); a principal it does
// not hold yet is read from the file.
func TestUsageIsServedFromTheView(t *testing.T) { eachStore(t, testUsageIsServedFromTheView) }

func testUsageIsServedFromTheView(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0.Add(5 * time.Second))
	path := dbPath(t)
	s, err := Open(ctx, path, c.Now)
	if err != nil {
		t.Fatal(err)
	}
	l := Limits{CallsPerMinute: 10, SandboxesPerHour: 3, ExecutionPerDay: time.Hour}
	mustAllow(t, s, "p", l)
	charge(t, s, "p", 1500*time.Millisecond)
	want, err := s.Usage(ctx, "p", l)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if got, err := s.Usage(ctx, "p", l); err != nil || got != want {
		t.Fatalf("Usage with the database closed: %+v %v, want %+v", got, err, want)
	}
	if _, err := s.Usage(ctx, "stranger", l); err == nil {
		t.Fatal("Usage of a principal the view does not hold did not need the database")
	}
}

// TestViewMatchesTheFileUnderConcurrency: callers racing every kind of
// write leave a view that equals what a fresh Store reads from the file.
func TestViewMatchesTheFileUnderConcurrency(t *testing.T) {
	eachStore(t, testViewMatchesTheFileUnderConcurrency)
}

func testViewMatchesTheFileUnderConcurrency(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0.Add(30 * time.Second))
	path := dbPath(t)
	s := openStore(t, path, c)
	l := Limits{CallsPerMinute: 150, SandboxesPerHour: 40, ExecutionPerDay: 20 * time.Second}
	principals := []string{"p0", "p1", "p2"}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for range 60 {
				p := principals[rng.IntN(len(principals))]
				var err error
				switch rng.IntN(3) {
				case 0:
					_, err = s.AllowCall(ctx, p, l)
				case 1:
					_, err = s.ReserveSandbox(ctx, p, l)
				default:
					var d Decision
					var r Reservation
					want := time.Duration(1+rng.IntN(2000)) * time.Millisecond
					d, r, err = s.ReserveExecution(ctx, p, l, want)
					if err == nil && d.Allowed { // a run that took at most its timeout
						err = s.SettleExecution(ctx, r, time.Duration(rng.Int64N(int64(want))))
					}
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	fresh := openStore(t, path, c)
	for _, p := range principals {
		got, err := s.Usage(ctx, p, l)
		if err != nil {
			t.Fatal(err)
		}
		want, err := fresh.Usage(ctx, p, l)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s: the view says %+v, the file %+v", p, got, want)
		}
		if got.CallsUsedLastMinute > 150 || got.SandboxesUsedLastHour > 40 || got.ExecutionUsedToday > 20*time.Second {
			t.Errorf("%s: over a limit: %+v", p, got)
		}
	}
}
