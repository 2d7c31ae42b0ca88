package quota

import (
	"context"
	"time"
)

// Usage is a principal's current consumption, as get_usage reports it.
// "Used" for the sliding windows is the weighted estimate rounded up, so
// Used + Remaining == limit while under the limit.
type Usage struct {
	CallsUsedLastMinute   int64
	SandboxesUsedLastHour int64
	ExecutionUsedToday    time.Duration
	CallsRemaining        int64
	SandboxesRemaining    int64
	ExecutionRemaining    time.Duration
}

// Usage reports consumption against l without consuming anything, from
// the view: the file is read only for a principal the view does not hold
// yet (see Store). Limits that are zero report zero remaining rather than
// an error, so a partial Limits still yields the usage figures.
func (s *Store) Usage(ctx context.Context, principal string, l Limits) (Usage, error) {
	now := s.now()
	nowMs := now.UnixMilli()
	s.mu.Lock()
	a, ok := s.cached(principal, nowMs)
	var u Usage
	if ok {
		u = a.usage(nowMs, l)
	}
	s.mu.Unlock()
	if ok {
		return u, nil
	}
	err := s.writeTx(ctx, func(w *write) error {
		a, err := s.account(w, principal)
		if err == nil {
			u = a.usage(nowMs, l)
		}
		return err
	})
	if err != nil {
		return Usage{}, err
	}
	return u, nil
}

// usage is Usage from a's buckets.
func (a *account) usage(nowMs int64, l Limits) Usage {
	minute := windowStart(nowMs, minuteMs)
	hour := windowStart(nowMs, hourMs)
	day := windowStart(nowMs, dayMs)
	n := func(k Kind, start int64) int64 { return a.buckets[bucket{k, start}] }
	u := Usage{ExecutionUsedToday: time.Duration(n(KindExecution, day)) * time.Millisecond}
	u.CallsUsedLastMinute, u.CallsRemaining = used(nowMs-minute, minuteMs, int64(l.CallsPerMinute), n(KindCalls, minute-minuteMs), n(KindCalls, minute))
	u.SandboxesUsedLastHour, u.SandboxesRemaining = used(nowMs-hour, hourMs, int64(l.SandboxesPerHour), n(KindSandboxes, hour-hourMs), n(KindSandboxes, hour))
	u.ExecutionRemaining = max(0, l.ExecutionPerDay.Truncate(time.Millisecond)-u.ExecutionUsedToday)
	return u
}

// used is the sliding-window estimate rounded up, and what is left of limit.
func used(elapsed, size, limit, prev, cur int64) (n, remaining int64) {
	scaled := prev*(size-elapsed) + cur*size
	n = (scaled + size - 1) / size
	return n, max(0, limit-n)
}
