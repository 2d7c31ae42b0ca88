package middleware

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// RejectionThrottle bounds what refusals may cost per key: audit rows for
// refused calls per principal, log lines and responses for refused HTTP
// requests per event or client address.
type RejectionThrottle struct {
	mu    sync.Mutex
	limit rate.Limit
	burst int
	keys  map[string]*rejections
	now   func() time.Time // time.Now; a hook for tests
}

type rejections struct {
	lim        *rate.Limiter
	suppressed int64
}

// maxTrackedKeys caps memory. Principals come from the token
// registry; client addresses can be many, and past the cap every key starts
// afresh (with its burst), which bounds memory, not the total.
const maxTrackedKeys = 100000

// NewRejectionThrottle allows perSecond refusals per key, with burst.
func NewRejectionThrottle(perSecond float64, burst int) *RejectionThrottle {
	return &RejectionThrottle{limit: rate.Limit(perSecond), burst: burst, keys: map[string]*rejections{}, now: time.Now}
}

// Admit reports whether a refusal under key may be recorded now, and how
// many were suppressed since the last admitted one.
func (t *RejectionThrottle) Admit(key string) (bool, int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.keys[key]
	if r == nil {
		if len(t.keys) >= maxTrackedKeys {
			t.keys = map[string]*rejections{}
		}
		r = &rejections{lim: rate.NewLimiter(t.limit, t.burst)}
		t.keys[key] = r
	}
	if !r.lim.AllowN(t.now(), 1) {
		r.suppressed++
		return false, 0
	}
	n := r.suppressed
	r.suppressed = 0
	return true, n
}
