package quota

import (
	"context"
	"testing"
	"time"
)

// TestClockSteppedBack: when the wall clock is stepped back, the windows it
// re-enters still hold the counts written before the step. The limiter
// must not hold the principal to those for as long as the step lasts (two
// hours here): the first call after the step forgets them, the budget
// starts afresh, refusals keep a RetryAfter within two windows, and the
// windows after that count normally.
func TestClockSteppedBack(t *testing.T) {
	start := t0.Add(10 * time.Hour)
	c := newClock(start)
	s := openStore(t, dbPath(t), c)
	l := Limits{CallsPerMinute: 5, SandboxesPerHour: 1, ExecutionPerDay: time.Hour}
	ctx := context.Background()
	// burst takes calls until one is refused and returns how many passed
	// and the refusal.
	burst := func() (int, Decision) {
		for n := 0; ; n++ {
			d := mustAllow(t, s, "alice", l)
			if !d.Allowed {
				return n, d
			}
			if n > 100 {
				t.Fatal("no refusal")
			}
		}
	}
	// An hour at the limit, then, an hour later, the sandbox budget used.
	for m := range 60 {
		c.Set(start.Add(time.Duration(m)*time.Minute + time.Second))
		burst()
	}
	c.Add(time.Hour)
	if d, err := s.ReserveSandbox(ctx, "alice", l); err != nil || !d.Allowed {
		t.Fatalf("sandbox before the step: %+v %v", d, err)
	}

	// Stepped back two hours.
	c.Set(start.Add(time.Second))
	n, refused := burst()
	if n != l.CallsPerMinute {
		t.Fatalf("after the step: %d calls allowed, want the full %d", n, l.CallsPerMinute)
	}
	if refused.RetryAfter < time.Second || refused.RetryAfter > 2*time.Minute || refused.Remaining != 0 {
		t.Fatalf("refusal after the step: %+v", refused)
	}
	if d, err := s.ReserveSandbox(ctx, "alice", l); err != nil || !d.Allowed {
		t.Fatalf("sandbox after the step: %+v %v", d, err)
	}
	if d, err := s.ReserveSandbox(ctx, "alice", l); err != nil || d.Allowed || d.RetryAfter > 2*time.Hour {
		t.Fatalf("second sandbox after the step: %+v %v", d, err)
	}
	// Two minutes on, the windows the step re-entered count only what was
	// taken since.
	c.Set(start.Add(2*time.Minute + time.Second))
	if n, _ := burst(); n != l.CallsPerMinute {
		t.Fatalf("two minutes after the step: %d calls allowed, want %d", n, l.CallsPerMinute)
	}
	u, err := s.Usage(ctx, "alice", l)
	if err != nil || u.CallsUsedLastMinute != int64(l.CallsPerMinute) || u.CallsRemaining != 0 {
		t.Fatalf("usage: %+v %v", u, err)
	}
}
