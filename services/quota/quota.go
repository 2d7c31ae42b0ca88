package quota

import (
	"context"
	"fmt"
	"time"
)

// Kind names a budget; it is also the bucket key stored in the database.
type Kind string

// Budget kinds.
const (
	KindCalls     Kind = "calls"
	KindSandboxes Kind = "sandboxes"
	KindExecution Kind = "execution_ms" // Limit and Remaining are in milliseconds
)

// Decision is the outcome of one quota check.
type Decision struct {
	Allowed   bool
	Kind      Kind
	Limit     int64
	Remaining int64 // after this decision
	// RetryAfter is set only when !Allowed: the wait, rounded up to whole
	// seconds (min 1s), after which the same request would succeed if
	// nothing else consumes the budget meanwhile.
	RetryAfter time.Duration
}

// AllowCall consumes one tool call from the per-minute budget if it fits.
func (s *Store) AllowCall(ctx context.Context, principal string, l Limits) (Decision, error) {
	return s.take(ctx, principal, KindCalls, minuteMs, int64(l.CallsPerMinute))
}

// ReserveSandbox consumes one sandbox creation from the per-hour budget if
// it fits. The reservation is not refunded if creation later fails: a
// failed attempt still cost the backend work.
func (s *Store) ReserveSandbox(ctx context.Context, principal string, l Limits) (Decision, error) {
	return s.take(ctx, principal, KindSandboxes, hourMs, int64(l.SandboxesPerHour))
}

// take is the atomic sliding-window check-and-increment, decided from the
// view inside a write transaction it may share with concurrent takes
// (writeTogether).
func (s *Store) take(ctx context.Context, principal string, kind Kind, size, limit int64) (Decision, error) {
	if limit <= 0 {
		return Decision{}, fmt.Errorf("%w: %s", ErrInvalidLimit, kind)
	}
	d := Decision{Kind: kind, Limit: limit}
	err := s.writeTogether(ctx, func(w *write) error {
		a, err := s.account(w, principal)
		if err != nil {
			return err
		}
		nowMs := w.now.UnixMilli()
		cur := windowStart(nowMs, size)
		prevN, curN := a.buckets[bucket{kind, cur - size}], a.buckets[bucket{kind, cur}]
		if a.stepped(kind, cur) {
			// A bucket after the current window: the wall clock was
			// stepped back, and the windows it re-enters hold counts from
			// before the step. They are forgotten, so the budget starts
			// afresh once instead of refusing for as long as the step.
			if _, err := w.exec(s.st.forget, principal, string(kind), cur-size); err != nil {
				return fmt.Errorf("quota: forget %s after a clock step: %w", kind, err)
			}
			w.then(func() { a.forget(kind, cur-size) })
			prevN, curN = 0, 0
		}
		d.Allowed, d.Remaining, d.RetryAfter = slide(nowMs-cur, size, limit, prevN, curN)
		if !d.Allowed {
			return nil // rejected requests are not counted
		}
		w.then(func() { a.trim(kind, cur-size) })
		return s.add(w, a, principal, kind, cur, 1)
	})
	if err != nil {
		return Decision{}, err
	}
	return d, nil
}

// stepped reports a bucket of kind after the window starting at cur.
func (a *account) stepped(kind Kind, cur int64) bool {
	for b := range a.buckets {
		if b.kind == kind && b.start > cur {
			return true
		}
	}
	return false
}

// forget drops kind's buckets from start on (the view's side of sqlForget).
func (a *account) forget(kind Kind, start int64) {
	for b := range a.buckets {
		if b.kind == kind && b.start >= start {
			delete(a.buckets, b)
		}
	}
}

// trim drops kind's buckets before start, which no decision needs again
// unless the clock steps back (covers then says to read the file).
func (a *account) trim(kind Kind, start int64) {
	if a.from[kind] >= start {
		return
	}
	for b := range a.buckets {
		if b.kind == kind && b.start < start {
			delete(a.buckets, b)
		}
	}
	a.from[kind] = start
}

// add counts n more in principal's bucket, in the file and then the view
// (a is nil when the view does not hold the principal).
func (s *Store) add(w *write, a *account, principal string, kind Kind, start, n int64) error {
	if _, err := w.exec(s.st.add, principal, string(kind), start, n); err != nil {
		return fmt.Errorf("quota: record %s: %w", kind, err)
	}
	if a != nil {
		w.then(func() { a.add(kind, start, n) })
	}
	return nil
}
