package quota

import (
	"context"
	"fmt"
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

const sqlUsage = `SELECT kind, window_start, count FROM quota_buckets
	WHERE principal = ?1 AND (
		(kind = ?2 AND window_start IN (?3, ?4)) OR
		(kind = ?5 AND window_start IN (?6, ?7)) OR
		(kind = ?8 AND window_start = ?9))`

// Usage reports consumption against l without consuming anything. Limits
// that are zero report zero remaining rather than an error, so a partial
// Limits still yields the usage figures.
func (s *Store) Usage(ctx context.Context, principal string, l Limits) (Usage, error) {
	nowMs := s.now().UnixMilli()
	minute := windowStart(nowMs, minuteMs)
	hour := windowStart(nowMs, hourMs)
	day := windowStart(nowMs, dayMs)

	rows, err := s.db.QueryContext(ctx, sqlUsage, principal,
		string(KindCalls), minute-minuteMs, minute,
		string(KindSandboxes), hour-hourMs, hour,
		string(KindExecution), day)
	if err != nil {
		return Usage{}, fmt.Errorf("quota: read usage: %w", err)
	}
	defer rows.Close()
	var callsPrev, callsCur, sbPrev, sbCur, execMs int64
	for rows.Next() {
		var kind string
		var start, n int64
		if err := rows.Scan(&kind, &start, &n); err != nil {
			return Usage{}, fmt.Errorf("quota: read usage: %w", err)
		}
		switch {
		case Kind(kind) == KindCalls && start == minute:
			callsCur = n
		case Kind(kind) == KindCalls:
			callsPrev = n
		case Kind(kind) == KindSandboxes && start == hour:
			sbCur = n
		case Kind(kind) == KindSandboxes:
			sbPrev = n
		default:
			execMs = n
		}
	}
	if err := rows.Err(); err != nil {
		return Usage{}, fmt.Errorf("quota: read usage: %w", err)
	}

	u := Usage{ExecutionUsedToday: time.Duration(execMs) * time.Millisecond}
	u.CallsUsedLastMinute, u.CallsRemaining = used(nowMs-minute, minuteMs, int64(l.CallsPerMinute), callsPrev, callsCur)
	u.SandboxesUsedLastHour, u.SandboxesRemaining = used(nowMs-hour, hourMs, int64(l.SandboxesPerHour), sbPrev, sbCur)
	u.ExecutionRemaining = max(0, l.ExecutionPerDay.Truncate(time.Millisecond)-u.ExecutionUsedToday)
	return u, nil
}

// used is the sliding-window estimate rounded up, and what is left of limit.
func used(elapsed, size, limit, prev, cur int64) (n, remaining int64) {
	scaled := prev*(size-elapsed) + cur*size
	n = (scaled + size - 1) / size
	return n, max(0, limit-n)
}
