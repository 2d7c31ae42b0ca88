package quota

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func reserve(t *testing.T, s *Store, p string, l Limits, d time.Duration) (Decision, Reservation) {
	t.Helper()
	dec, r, err := s.ReserveExecution(context.Background(), p, l, d)
	if err != nil {
		t.Fatal(err)
	}
	return dec, r
}

func settle(t *testing.T, s *Store, r Reservation, d time.Duration) {
	t.Helper()
	if err := s.SettleExecution(context.Background(), r, d); err != nil {
		t.Fatal(err)
	}
}

func TestExecutionBudget(t *testing.T) { eachStore(t, testExecutionBudget) }

func testExecutionBudget(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0.Add(15*time.Hour + 500*time.Millisecond))
	s := openStore(t, dbPath(t), c)
	l := LimitsFor(TierFree, 0)

	d, r := reserve(t, s, "fay", l, time.Minute)
	if !d.Allowed || d.Kind != KindExecution || d.Limit != 3_600_000 || d.Remaining != 3_540_000 {
		t.Fatalf("fresh: %+v", d)
	}
	// Settled with the real duration, not the reservation.
	settle(t, s, r, 30*time.Minute)
	if d, r := reserve(t, s, "fay", l, time.Minute); !d.Allowed || d.Remaining != 1_740_000 {
		t.Fatalf("after 30m: %+v", d)
	} else {
		// Charged even past the limit: the time was spent.
		settle(t, s, r, 45*time.Minute)
	}
	d, _ = reserve(t, s, "fay", l, time.Second)
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
	if d, _ := reserve(t, s, "fay", l, time.Second); d.Allowed || d.RetryAfter != time.Second {
		t.Fatalf("just before midnight: %+v", d)
	}
	c.Set(t0.Add(24 * time.Hour))
	if d, _ := reserve(t, s, "fay", l, time.Second); !d.Allowed || d.Remaining != 3_599_000 {
		t.Fatalf("next UTC day: %+v", d)
	}
}

// A run asks for its whole timeout: one that does not fit in what is left
// is refused even though some budget remains.
func TestReservationMustFit(t *testing.T) { eachStore(t, testReservationMustFit) }

func testReservationMustFit(t *testing.T, dbPath func(testing.TB) string) {
	s := openStore(t, dbPath(t), newClock(t0))
	l := Limits{ExecutionPerDay: time.Minute}
	_, r := reserve(t, s, "ida", l, 10*time.Second)
	settle(t, s, r, 50*time.Second)
	if d, _ := reserve(t, s, "ida", l, 11*time.Second); d.Allowed || d.Remaining != 10_000 {
		t.Fatalf("11s with 10s left: %+v", d)
	}
	if d, _ := reserve(t, s, "ida", l, 10*time.Second); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("10s with 10s left: %+v", d)
	}
}

// Runs started at once from one principal with budget for one: exactly one
// reservation is granted, however many race (the concurrency overspend).
func TestConcurrentReservationsCannotOverspend(t *testing.T) {
	eachStore(t, testConcurrentReservationsCannotOverspend)
}

func testConcurrentReservationsCannotOverspend(t *testing.T, dbPath func(testing.TB) string) {
	c := newClock(t0.Add(time.Hour))
	path := dbPath(t)
	stores := []*Store{openStore(t, path, c), openStore(t, path, c)} // two brokers, one file
	l := LimitsFor(TierFree, 0)
	_, r := reserve(t, stores[0], "jo", l, time.Second)
	settle(t, stores[0], r, 59*time.Minute) // 60s left
	var granted atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 16 {
		s := stores[i%2]
		wg.Go(func() {
			<-start
			d, _, err := s.ReserveExecution(context.Background(), "jo", l, 45*time.Second)
			if err != nil {
				t.Error(err)
				return
			}
			if d.Allowed {
				granted.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if n := granted.Load(); n != 1 {
		t.Fatalf("%d of 16 concurrent 45s runs were granted with 60s left, want 1", n)
	}
	// The refusal names when the held time comes back: the reservation's
	// expiry at the latest.
	d, _ := reserve(t, stores[1], "jo", l, 45*time.Second)
	if d.Allowed || d.RetryAfter <= 0 || d.RetryAfter > 45*time.Second+ReservationGrace {
		t.Fatalf("while held: %+v", d)
	}
	// Another principal has its own budget.
	if d, _ := reserve(t, stores[1], "kim", l, 45*time.Second); !d.Allowed {
		t.Fatalf("kim: %+v", d)
	}
}

// A reservation whose broker stopped before settling is charged in full when
// it expires, at the latest when a broker next opens the database, and a late
// settle adds only what ran past it.
func TestExpiredReservationIsChargedOnce(t *testing.T) {
	eachStore(t, testExpiredReservationIsChargedOnce)
}

func testExpiredReservationIsChargedOnce(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0.Add(time.Hour))
	path := dbPath(t)
	l := Limits{ExecutionPerDay: 10 * time.Minute}
	s, err := Open(ctx, path, c.Now)
	if err != nil {
		t.Fatal(err)
	}
	_, lost := reserve(t, s, "lee", l, 3*time.Minute)
	_, late := reserve(t, s, "lee", l, time.Minute)
	if err := s.Close(); err != nil { // the broker stops without settling
		t.Fatal(err)
	}
	// Before expiry the time stays held (another broker may be running it).
	s = openStore(t, path, c)
	if d, _ := reserve(t, s, "lee", l, 7*time.Minute); d.Allowed {
		t.Fatalf("held time was handed out again: %+v", d)
	}
	c.Add(3*time.Minute + ReservationGrace)
	s2 := openStore(t, path, c) // a restart settles what expired
	u, err := s2.Usage(ctx, "lee", l)
	if err != nil {
		t.Fatal(err)
	}
	if u.ExecutionUsedToday != 4*time.Minute {
		t.Fatalf("used %v after expiry, want both reservations charged (4m)", u.ExecutionUsedToday)
	}
	// The late run settles: 90s ran, 60s were charged at expiry.
	settle(t, s2, late, 90*time.Second)
	settle(t, s2, lost, 0)
	if u, _ = s2.Usage(ctx, "lee", l); u.ExecutionUsedToday != 4*time.Minute+30*time.Second {
		t.Fatalf("used %v, want 4m30s", u.ExecutionUsedToday)
	}
}

// A run that waited before starting renews its reservation, which then
// outlives the original expiry.
func TestRenewedReservationOutlivesItsFirstExpiry(t *testing.T) {
	eachStore(t, testRenewedReservationOutlivesItsFirstExpiry)
}

func testRenewedReservationOutlivesItsFirstExpiry(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	c := newClock(t0.Add(time.Hour))
	s := openStore(t, dbPath(t), c)
	l := Limits{ExecutionPerDay: 10 * time.Minute}
	_, r := reserve(t, s, "max", l, time.Minute)
	c.Add(time.Minute + ReservationGrace - time.Second) // waited for its session
	if err := s.RenewExecution(ctx, r); err != nil {
		t.Fatal(err)
	}
	c.Add(time.Minute) // past the first expiry
	if d, _ := reserve(t, s, "max", l, 9*time.Minute+time.Second); d.Allowed {
		t.Fatalf("renewed reservation no longer held: %+v", d)
	}
	if u, _ := s.Usage(ctx, "max", l); u.ExecutionUsedToday != 0 {
		t.Fatalf("renewed reservation charged as expired: %v", u.ExecutionUsedToday)
	}
	settle(t, s, r, 30*time.Second)
	if u, _ := s.Usage(ctx, "max", l); u.ExecutionUsedToday != 30*time.Second {
		t.Fatalf("used %v, want the real 30s", u.ExecutionUsedToday)
	}
}

// The day is the UTC day regardless of the clock's location.
func TestExecutionDayIsUTC(t *testing.T) { eachStore(t, testExecutionDayIsUTC) }

func testExecutionDayIsUTC(t *testing.T, dbPath func(testing.TB) string) {
	tokyo := time.FixedZone("JST", 9*3600)
	// 08:00 JST on Mar 11 is 23:00 UTC on Mar 10.
	c := newClock(time.Date(2025, 3, 11, 8, 0, 0, 0, tokyo))
	s := openStore(t, dbPath(t), c)
	l := Limits{ExecutionPerDay: time.Minute}
	_, r := reserve(t, s, "gus", l, time.Second)
	settle(t, s, r, time.Minute)
	if d, _ := reserve(t, s, "gus", l, time.Second); d.Allowed || d.RetryAfter != time.Hour {
		t.Fatalf("%+v; want denied for 1h", d)
	}
	c.Add(time.Hour)
	if d, _ := reserve(t, s, "gus", l, time.Second); !d.Allowed {
		t.Fatalf("after UTC midnight: %+v", d)
	}
}

func TestSettleExecutionRounding(t *testing.T) { eachStore(t, testSettleExecutionRounding) }

func testSettleExecutionRounding(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	s := openStore(t, dbPath(t), newClock(t0))
	l := LimitsFor(TierPro, 0)
	for _, d := range []time.Duration{0, time.Microsecond, 1500 * time.Microsecond} {
		_, r := reserve(t, s, "hal", l, time.Second)
		settle(t, s, r, d)
	}
	u, err := s.Usage(ctx, "hal", l)
	if err != nil {
		t.Fatal(err)
	}
	// 0 is a no-op; 1µs → 1ms; 1.5ms → 2ms.
	if u.ExecutionUsedToday != 3*time.Millisecond {
		t.Fatalf("used %v, want 3ms", u.ExecutionUsedToday)
	}
	if err := s.SettleExecution(ctx, Reservation{ID: "x", Principal: "hal"}, -time.Second); err == nil {
		t.Fatal("negative duration accepted")
	}
}
