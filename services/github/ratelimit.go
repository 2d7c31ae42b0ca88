package github

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// rateLimited maps a rate limit to RATE_LIMIT_EXCEEDED with retry_after_s
// and closes the token's gate until then, so no request is sent while
// GitHub would refuse it (clients that keep trying risk being banned).
func rateLimited(err error, rs *repoState, d time.Duration) error {
	d = clampRetry(d)
	rs.tok.mu.Lock()
	if until := time.Now().Add(d); until.After(rs.tok.limitedUntil) {
		rs.tok.limitedUntil = until
	}
	rs.tok.mu.Unlock()
	return brokererr.Wrap(err, brokererr.RateLimitExceeded, "GitHub rate limit reached for %s", rs.cfg.RepoID).WithRetryAfter(d)
}

func clampRetry(d time.Duration) time.Duration {
	switch {
	case d <= 0:
		return defaultRetry
	case d < time.Second:
		return time.Second
	case d > time.Hour:
		return time.Hour
	}
	return d.Round(time.Second)
}

// limited is the gate: RATE_LIMIT_EXCEEDED, without a request, until the
// last rate limit's retry time.
func (rs *repoState) limited(now time.Time) error {
	rs.tok.mu.Lock()
	until := rs.tok.limitedUntil
	rs.tok.mu.Unlock()
	if !now.Before(until) {
		return nil
	}
	d := until.Sub(now)
	if d < time.Second {
		d = time.Second
	}
	return brokererr.New(brokererr.RateLimitExceeded, "GitHub rate limit reached for %s; no request sent", rs.cfg.RepoID).
		WithRetryAfter(d.Round(time.Second))
}

// retryAfter reads Retry-After (delay seconds or an HTTP date), or
// X-RateLimit-Reset (epoch seconds) when X-RateLimit-Remaining is 0. A
// zero duration with ok means "limited, for an unknown time".
func retryAfter(h http.Header, now time.Time) (time.Duration, bool) {
	if v := strings.TrimSpace(h.Get("Retry-After")); v != "" {
		if s, err := strconv.ParseInt(v, 10, 64); err == nil && s >= 0 {
			if s == 0 {
				return time.Second, true // "now": still not before the next second
			}
			if s > int64(time.Hour/time.Second) {
				s = int64(time.Hour / time.Second)
			}
			return time.Duration(s) * time.Second, true
		}
		if t, err := http.ParseTime(v); err == nil {
			return t.Sub(now), true
		}
	}
	if strings.TrimSpace(h.Get("X-RateLimit-Remaining")) == "0" {
		if reset, err := strconv.ParseInt(strings.TrimSpace(h.Get("X-RateLimit-Reset")), 10, 64); err == nil && reset > 0 && reset < 1<<40 {
			return time.Unix(reset, 0).Sub(now), true
		}
		return 0, true
	}
	return 0, false
}

// mentionsRateLimit recognises GitHub's rate-limit messages ("API rate
// limit exceeded", "You have exceeded a secondary rate limit", the older
// "abuse detection mechanism") when no header says so.
func mentionsRateLimit(msg string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "rate limit") || strings.Contains(m, "abuse detection")
}
