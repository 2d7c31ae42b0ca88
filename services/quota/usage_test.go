package quota

import (
	"context"
	"testing"
	"time"
)

func TestUsage(t *testing.T) {
	ctx := context.Background()
	c := newClock(t0.Add(2*time.Hour + 30*time.Second))
	s := openStore(t, dbPath(t), c)
	l := LimitsFor(TierPro, 20)

	u, err := s.Usage(ctx, "ivy", l)
	if err != nil {
		t.Fatal(err)
	}
	want := Usage{CallsRemaining: 20, SandboxesRemaining: 100, ExecutionRemaining: 24 * time.Hour}
	if u != want {
		t.Fatalf("fresh usage %+v, want %+v", u, want)
	}

	for range 8 {
		mustAllow(t, s, "ivy", l)
	}
	for range 3 {
		if _, err := s.ReserveSandbox(ctx, "ivy", l); err != nil {
			t.Fatal(err)
		}
	}
	charge(t, s, "ivy", 90*time.Minute)
	mustAllow(t, s, "someone-else", l)

	u, err = s.Usage(ctx, "ivy", l)
	if err != nil {
		t.Fatal(err)
	}
	want = Usage{
		CallsUsedLastMinute: 8, CallsRemaining: 12,
		SandboxesUsedLastHour: 3, SandboxesRemaining: 97,
		ExecutionUsedToday: 90 * time.Minute, ExecutionRemaining: 22*time.Hour + 30*time.Minute,
	}
	if u != want {
		t.Fatalf("usage %+v, want %+v", u, want)
	}

	// 45s into the next minute the 8 previous calls weigh 8*15/60 = 2.
	c.Set(t0.Add(2*time.Hour + 105*time.Second))
	u, err = s.Usage(ctx, "ivy", l)
	if err != nil {
		t.Fatal(err)
	}
	if u.CallsUsedLastMinute != 2 || u.CallsRemaining != 18 || u.SandboxesUsedLastHour != 3 {
		t.Fatalf("decayed usage %+v", u)
	}
	// Usage agrees with what AllowCall reports.
	if d := mustAllow(t, s, "ivy", l); d.Remaining != u.CallsRemaining-1 {
		t.Fatalf("AllowCall Remaining %d, Usage said %d before it", d.Remaining, u.CallsRemaining)
	}

	// Usage does not consume.
	for range 5 {
		if _, err := s.Usage(ctx, "ivy", l); err != nil {
			t.Fatal(err)
		}
	}
	if u2, _ := s.Usage(ctx, "ivy", l); u2.CallsUsedLastMinute != 3 {
		t.Fatalf("usage after one more call %+v", u2)
	}
}
