package quota

import "time"

// Window lengths in milliseconds; all bucket arithmetic is in integer ms so
// decisions are exact and reproducible (no float rounding at the limit).
const (
	minuteMs = int64(time.Minute / time.Millisecond)
	hourMs   = int64(time.Hour / time.Millisecond)
	dayMs    = int64(24 * time.Hour / time.Millisecond)
)

// floorDiv is a/b rounded towards minus infinity, so windows stay aligned
// even for (test) clocks before 1970.
func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}

// windowStart is the start (unix ms) of the fixed window of length size
// containing nowMs.
func windowStart(nowMs, size int64) int64 {
	return floorDiv(nowMs, size) * size
}

// slide is the sliding-window decision for one request at offset elapsed
// (ms) into the current fixed window of length size, given the previous and
// current window counts. The estimate is prev*(size-elapsed)/size + cur; it
// is kept multiplied by size so everything stays integral.
//
// It reports whether one more request fits, how many more would fit after
// this decision, and, when it does not fit, how long until one would.
func slide(elapsed, size, limit, prev, cur int64) (allowed bool, remaining int64, retry time.Duration) {
	scaled := prev*(size-elapsed) + cur*size
	allowed = scaled+size <= limit*size
	if allowed {
		scaled += size
	}
	remaining = max(0, (limit*size-scaled)/size)
	if allowed {
		return true, remaining, 0
	}
	var waitMs int64
	if cur < limit {
		// Room appears in this window once prev's weight has decayed
		// enough: prev*(size-elapsed-wait) <= (limit-cur-1)*size.
		// cur < limit and denied imply prev > 0.
		waitMs = size - elapsed - (limit-cur-1)*size/prev
	} else {
		// This window is full: wait for the next one, where cur becomes
		// the previous window and must decay until one more fits.
		// limit >= 1 is validated by callers, so cur > 0.
		waitMs = (size - elapsed) + (size - (limit-1)*size/cur)
	}
	return false, remaining, roundRetry(time.Duration(waitMs) * time.Millisecond)
}

// roundRetry rounds a wait up to whole seconds, minimum 1s, so a client that
// retries at now+RetryAfter (Retry-After is in seconds) is never early.
func roundRetry(d time.Duration) time.Duration {
	if d < time.Second {
		return time.Second
	}
	return (d + time.Second - 1).Truncate(time.Second)
}

// nextUTCMidnight is when the daily execution budget resets.
func nextUTCMidnight(t time.Time) time.Time {
	y, m, d := t.UTC().Date()
	return time.Date(y, m, d+1, 0, 0, 0, 0, time.UTC)
}
