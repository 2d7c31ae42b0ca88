package quota

import (
	"context"
	"testing"
	"time"
)

func TestExecutionBudget(t *testing.T) {
	ctx := context.Background()
	c := newClock(t0.Add(15*time.Hour + 500*time.Millisecond))
	s := openStore(t, dbPath(t), c)
	l := LimitsFor(TierFree, 0)

	check := func() Decision {
		t.Helper()
		d, err := s.CheckExecution(ctx, "fay", l)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if d := check(); !d.Allowed || d.Kind != KindExecution || d.Limit != 3_600_000 || d.Remaining != 3_600_000 {
		t.Fatalf("fresh: %+v", d)
	}
	if err := s.AddExecution(ctx, "fay", 30*time.Minute); err != nil {
		t.Fatal(err)
	}
	// CheckExecution does not consume.
	check()
	if d := check(); !d.Allowed || d.Remaining != 1_800_000 {
		t.Fatalf("after 30m: %+v", d)
	}
	// Recorded even past the limit: the time was spent.
	if err := s.AddExecution(ctx, "fay", 45*time.Minute); err != nil {
		t.Fatal(err)
	}
	d := check()
	if d.Allowed || d.Remaining != 0 {
		t.Fatalf("after 75m: %+v", d)
	}
	// 08:59:59.5 to midnight, rounded up.
	if want := 9 * time.Hour; d.RetryAfter != want {
		t.Fatalf("RetryAfter = %v, want %v", d.RetryAfter, want)
	}
	u, err := s.Usage(ctx, "fay", l)
	if err != nil {
		t.Fatal(err)
	}
	if u.ExecutionUsedToday != 75*time.Minute || u.ExecutionRemaining != 0 {
		t.Fatalf("usage %+v", u)
	}

	c.Set(t0.Add(24*time.Hour - time.Millisecond))
	if d := check(); d.Allowed || d.RetryAfter != time.Second {
		t.Fatalf("just before midnight: %+v", d)
	}
	c.Set(t0.Add(24 * time.Hour))
	if d := check(); !d.Allowed || d.Remaining != 3_600_000 {
		t.Fatalf("next UTC day: %+v", d)
	}
}

// The day is the UTC day regardless of the clock's location.
func TestExecutionDayIsUTC(t *testing.T) {
	ctx := context.Background()
	tokyo := time.FixedZone("JST", 9*3600)
	// 08:00 JST on Mar 11 is 23:00 UTC on Mar 10.
	c := newClock(time.Date(2025, 3, 11, 8, 0, 0, 0, tokyo))
	s := openStore(t, dbPath(t), c)
	l := Limits{ExecutionPerDay: time.Minute}
	if err := s.AddExecution(ctx, "gus", time.Minute); err != nil {
		t.Fatal(err)
	}
	d, err := s.CheckExecution(ctx, "gus", l)
	if err != nil || d.Allowed || d.RetryAfter != time.Hour {
		t.Fatalf("%+v %v; want denied for 1h", d, err)
	}
	c.Add(time.Hour)
	if d, err := s.CheckExecution(ctx, "gus", l); err != nil || !d.Allowed {
		t.Fatalf("after UTC midnight: %+v %v", d, err)
	}
}

func TestAddExecutionRounding(t *testing.T) {
	ctx := context.Background()
	s := openStore(t, dbPath(t), newClock(t0))
	for _, d := range []time.Duration{0, time.Microsecond, 1500 * time.Microsecond} {
		if err := s.AddExecution(ctx, "hal", d); err != nil {
			t.Fatal(err)
		}
	}
	u, err := s.Usage(ctx, "hal", LimitsFor(TierPro, 0))
	if err != nil {
		t.Fatal(err)
	}
	// 0 is a no-op; 1µs → 1ms; 1.5ms → 2ms.
	if u.ExecutionUsedToday != 3*time.Millisecond {
		t.Fatalf("used %v, want 3ms", u.ExecutionUsedToday)
	}
}
