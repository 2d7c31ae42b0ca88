package sandbox

import (
	"testing"
	"time"
)

func TestSlots(t *testing.T) {
	s := NewSlots(2)
	a, ok1 := s.Acquire()
	b, ok2 := s.Acquire()
	if !ok1 || !ok2 || s.InUse() != 2 {
		t.Fatalf("two slots of two: %v %v, %d in use", ok1, ok2, s.InUse())
	}
	if _, ok := s.Acquire(); ok {
		t.Fatal("a third slot of two")
	}
	now := time.Unix(1000, 0)
	if d := s.RetryAfter(now); d != 0 {
		t.Fatalf("retry after %v with no idle times known", d)
	}
	a.IdleAt(now.Add(5 * time.Minute))
	b.IdleAt(now.Add(2 * time.Minute))
	if d := s.RetryAfter(now); d != 2*time.Minute {
		t.Fatalf("retry after %v, want the earliest idle time (2m)", d)
	}
	if d := s.RetryAfter(now.Add(time.Hour)); d != time.Second {
		t.Fatalf("retry after %v for a past idle time, want 1s", d)
	}
	b.Release()
	b.Release() // idempotent
	if s.InUse() != 1 {
		t.Fatalf("%d in use after release", s.InUse())
	}
	if _, ok := s.Acquire(); !ok {
		t.Fatal("a released slot was not reusable")
	}
	var none *Slots // no cap
	sl, ok := none.Acquire()
	if !ok || none.Max() != 0 || none.InUse() != 0 || none.RetryAfter(now) != 0 {
		t.Fatal("nil Slots must not cap")
	}
	sl.IdleAt(now)
	sl.Release()
}
