package codesandbox

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxHeaderWait caps what any header may make us believe: a broken or
// hostile value must not turn into a wait of years.
const maxHeaderWait = 24 * time.Hour

// budget is one rate-limit budget as the x-csb-* headers name it
// (codesandbox-api.md §6.1). The VM budget has no reset header: it frees up
// when another VM stops.
type budget struct {
	name, remaining, used, reset string
}

var budgets = []budget{
	{"sandboxes created per hour", "x-csb-sandbox-hourly-remaining", "x-csb-sandbox-hourly-used", "x-csb-sandbox-hourly-reset"},
	{"API requests per hour", "x-csb-rate-hourly-remaining", "x-csb-rate-hourly-used", "x-csb-rate-hourly-reset"},
	{"concurrently running VMs", "x-csb-vms-remaining", "x-csb-vms-used", ""},
}

// RateLimit is what a 429 response says about when to come back.
type RateLimit struct {
	// Budget names the exhausted budget; "" when no header reports one.
	Budget string
	// Wait is how long until a retry can succeed; 0 when unknown.
	Wait time.Duration
}

// ParseRateLimit reads the x-csb-* budget headers and a standard
// Retry-After. The reset format is not documented: integers are taken as
// Unix seconds (≥1e9), Unix milliseconds (≥1e12) or a delta in seconds,
// and RFC 3339 and HTTP dates are accepted. The longest wait wins.
func ParseRateLimit(h http.Header, now time.Time) RateLimit {
	var rl RateLimit
	for _, b := range budgets {
		rem, ok := headerInt(h, b.remaining)
		if !ok || rem > 0 {
			continue
		}
		if rl.Budget == "" {
			rl.Budget = b.name
		}
		if b.reset != "" {
			rl.Wait = max(rl.Wait, parseReset(h.Get(b.reset), now))
		}
	}
	if v := h.Get("Retry-After"); v != "" {
		rl.Wait = max(rl.Wait, parseRetryAfter(v, now))
	}
	return rl
}

// vmBudgetExhausted reports whether the headers say no VM may start.
func vmBudgetExhausted(h http.Header) bool {
	n, ok := headerInt(h, budgets[2].remaining)
	return ok && n <= 0
}

func headerInt(h http.Header, name string) (int64, bool) {
	v := strings.TrimSpace(h.Get(name))
	if v == "" {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	return n, err == nil
}

// parseReset turns a reset header into a wait from now.
func parseReset(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		switch {
		case n <= 0:
			return 0
		case n >= 1e12:
			return clampWait(time.UnixMilli(n).Sub(now))
		case n >= 1e9:
			return clampWait(time.Unix(n, 0).Sub(now))
		default:
			return clampSeconds(n)
		}
	}
	if t, err := time.Parse(time.RFC3339, v); err == nil {
		return clampWait(t.Sub(now))
	}
	if t, err := http.ParseTime(v); err == nil {
		return clampWait(t.Sub(now))
	}
	return 0
}

// parseRetryAfter reads RFC 9110 Retry-After: delta-seconds or HTTP-date.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		return clampSeconds(n)
	}
	if t, err := http.ParseTime(v); err == nil {
		return clampWait(t.Sub(now))
	}
	return 0
}

func clampSeconds(n int64) time.Duration {
	if n <= 0 {
		return 0
	}
	if n > int64(maxHeaderWait/time.Second) {
		return maxHeaderWait
	}
	return time.Duration(n) * time.Second
}

func clampWait(d time.Duration) time.Duration {
	return min(max(d, 0), maxHeaderWait)
}
