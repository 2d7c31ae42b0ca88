package middleware

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// RejectionThrottle bounds audit rows for refused calls per principal.
type RejectionThrottle struct {
	mu         sync.Mutex
	limit      rate.Limit
	burst      int
	principals map[string]*rejections
	now        func() time.Time // time.Now; a hook for tests
}

type rejections struct {
	lim        *rate.Limiter
	suppressed int64
}

// maxTrackedPrincipals caps memory; principals come from the token registry,
// so this is only reached by a misconfiguration.
const maxTrackedPrincipals = 100000

// NewRejectionThrottle allows perSecond rows per principal, with burst.
func NewRejectionThrottle(perSecond float64, burst int) *RejectionThrottle {
	return &RejectionThrottle{limit: rate.Limit(perSecond), burst: burst, principals: map[string]*rejections{}, now: time.Now}
}

// Admit reports whether a row may be written now for key, and how many were
// suppressed since the last admitted one.
func (t *RejectionThrottle) Admit(principal string) (bool, int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.principals[principal]
	if r == nil {
		if len(t.principals) >= maxTrackedPrincipals {
			t.principals = map[string]*rejections{}
		}
		r = &rejections{lim: rate.NewLimiter(t.limit, t.burst)}
		t.principals[principal] = r
	}
	if !r.lim.AllowN(t.now(), 1) {
		r.suppressed++
		return false, 0
	}
	n := r.suppressed
	r.suppressed = 0
	return true, n
}
