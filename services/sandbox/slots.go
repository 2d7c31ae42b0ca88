package sandbox

import (
	"sync"
	"time"
)

// Slots caps how many sandboxes (containers) run at once across every
// engine that shares it: warm-pool containers count like sessions' ones.
// A nil *Slots means no cap.
type Slots struct {
	mu   sync.Mutex
	max  int
	held map[*Slot]struct{}
}

// Slot is one held place; Release gives it back.
type Slot struct {
	s      *Slots
	idleAt time.Time // when its holder lets it go if unused; zero if unknown
}

// NewSlots returns a cap of max live sandboxes.
func NewSlots(max int) *Slots {
	return &Slots{max: max, held: map[*Slot]struct{}{}}
}

// Max is the cap (0 when s is nil).
func (s *Slots) Max() int {
	if s == nil {
		return 0
	}
	return s.max
}

// Acquire takes a slot, or reports false when all are held. With a nil
// Slots it always succeeds (with a nil *Slot, which is safe to use).
func (s *Slots) Acquire() (*Slot, bool) {
	if s == nil {
		return nil, true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.held) >= s.max {
		return nil, false
	}
	sl := &Slot{s: s}
	s.held[sl] = struct{}{}
	return sl, true
}

// InUse is how many slots are held.
func (s *Slots) InUse() int {
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.held)
}

// RetryAfter estimates when a slot may next come free: the earliest time a
// holder said it would let go of an unused sandbox (0 when none said).
func (s *Slots) RetryAfter(now time.Time) time.Duration {
	if s == nil {
		return 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var first time.Time
	for sl := range s.held {
		if !sl.idleAt.IsZero() && (first.IsZero() || sl.idleAt.Before(first)) {
			first = sl.idleAt
		}
	}
	if first.IsZero() {
		return 0
	}
	return max(first.Sub(now), time.Second)
}

// IdleAt records when the holder will let go of the slot if the sandbox
// stays unused (zero: unknown, e.g. while jobs run in it).
func (sl *Slot) IdleAt(t time.Time) {
	if sl == nil {
		return
	}
	sl.s.mu.Lock()
	sl.idleAt = t
	sl.s.mu.Unlock()
}

// Release gives the slot back; it is idempotent and nil-safe.
func (sl *Slot) Release() {
	if sl == nil {
		return
	}
	sl.s.mu.Lock()
	delete(sl.s.held, sl)
	sl.s.mu.Unlock()
}
