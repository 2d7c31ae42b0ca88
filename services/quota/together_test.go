package quota

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"
)

// queued waits until n takes wait behind the leader.
func queued(s *Store, n int) {
	for {
		s.tmu.Lock()
		k := len(s.takers)
		s.tmu.Unlock()
		if k >= n {
			return
		}
		runtime.Gosched()
	}
}

// leaderWaiting waits until a take leads, has taken the queue (itself)
// and so waits for the write lock the test holds.
func leaderWaiting(s *Store) {
	for {
		s.tmu.Lock()
		taken := s.leading && len(s.takers) == 0
		s.tmu.Unlock()
		if taken {
			return
		}
		runtime.Gosched()
	}
}

// Takes that queue while a transaction runs share the next one, and each
// decides on the counts of those before it: exactly the limit is allowed.
func TestTakesShareATransaction(t *testing.T) { eachStore(t, testTakesShareATransaction) }

func testTakesShareATransaction(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	s := openStore(t, dbPath(t), newClock(t0.Add(5*time.Second)))
	l := Limits{CallsPerMinute: 7}
	s.wmu.Lock() // the first take leads and waits here
	before := s.writes
	const callers = 12
	var allowed sync.WaitGroup
	results := make(chan Decision, callers)
	lead := make(chan struct{})
	go func() {
		defer close(lead)
		d, err := s.AllowCall(ctx, "p", l)
		if err != nil {
			t.Error(err)
		}
		results <- d
	}()
	leaderWaiting(s)
	for range callers - 1 {
		allowed.Go(func() {
			d, err := s.AllowCall(ctx, "p", l)
			if err != nil {
				t.Error(err)
			}
			results <- d
		})
	}
	queued(s, callers-1)
	s.wmu.Unlock()
	<-lead
	allowed.Wait()
	close(results)
	n := 0
	remaining := map[int64]bool{}
	for d := range results {
		if d.Allowed {
			n++
			remaining[d.Remaining] = true
		}
	}
	if n != 7 || len(remaining) != 7 {
		t.Errorf("%d allowed with %d distinct remaining counts; want 7 and 7", n, len(remaining))
	}
	if got := s.writes - before; got != 2 {
		t.Errorf("%d write transactions for %d takes; want 2 (the leader's, then the rest together)", got, callers)
	}
	u, err := s.Usage(ctx, "p", l)
	if err != nil || u.CallsUsedLastMinute != 7 {
		t.Errorf("usage after: %+v, %v; want 7 calls", u, err)
	}
}

// A transaction that fails fails every take in it, and what the takes
// before the failure changed in the view is dropped with it.
func TestFailedSharedTransactionLeavesNoTrace(t *testing.T) {
	ctx := context.Background()
	s := openStore(t, dbPath(t), newClock(t0.Add(5*time.Second)))
	l := Limits{CallsPerMinute: 100}
	if _, err := s.AllowCall(ctx, "p", l); err != nil {
		t.Fatal(err)
	}
	s.wmu.Lock()
	lead := make(chan error, 1)
	go func() { lead <- s.writeTogether(ctx, func(*write) error { return nil }) }()
	leaderWaiting(s)
	boom := errors.New("boom")
	errs := make(chan error, 2)
	go func() {
		_, err := s.AllowCall(ctx, "p", l) // counts one more in the view, provisionally
		errs <- err
	}()
	queued(s, 1)
	go func() { errs <- s.writeTogether(ctx, func(*write) error { return boom }) }()
	queued(s, 2)
	s.wmu.Unlock()
	if err := <-lead; err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-errs; !errors.Is(err, boom) {
			t.Errorf("a take in the failed transaction: %v; want boom", err)
		}
	}
	u, err := s.Usage(ctx, "p", l)
	if err != nil || u.CallsUsedLastMinute != 1 {
		t.Errorf("usage after the failed transaction: %+v, %v; want the 1 committed call", u, err)
	}
}
