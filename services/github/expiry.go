package github

import (
	"net/http"
	"sort"
	"strings"
	"time"
)

// ExpiryWarning is how long before a token expires the broker warns.
const ExpiryWarning = 7 * 24 * time.Hour

// expiryHeader is where GitHub names a fine-grained token's expiry, on
// every answer to a request made with it, as "2026-03-01 12:00:00 UTC"
// (some answers have been seen with a numeric zone, "+0900").
const expiryHeader = "GitHub-Authentication-Token-Expiration"

// parseTokenExpiry reads an expiryHeader value. Zone abbreviations other
// than UTC are refused: Go would read an unknown one as UTC silently.
func parseTokenExpiry(v string) (time.Time, bool) {
	v = strings.TrimSpace(v)
	if len(v) > 64 {
		return time.Time{}, false
	}
	if s, ok := strings.CutSuffix(v, " UTC"); ok {
		t, err := time.ParseInLocation(time.DateTime, s, time.UTC)
		return t, err == nil
	}
	for _, layout := range []string{time.DateTime + " -0700", time.RFC3339} {
		if t, err := time.Parse(layout, v); err == nil {
			return t.UTC(), true
		}
	}
	return time.Time{}, false
}

// sawExpiry records the expiry an answer announced, if any.
func (t *tokenState) sawExpiry(h http.Header) {
	exp, ok := parseTokenExpiry(h.Get(expiryHeader))
	if !ok {
		return
	}
	t.mu.Lock()
	t.expires = exp
	t.mu.Unlock()
}

// TokenExpiries says, per repo, when its token expires as GitHub last
// announced; repos whose token's expiry is not known (no answer yet, or a
// token that never expires) are absent.
func (m *Manager) TokenExpiries() map[string]time.Time {
	out := map[string]time.Time{}
	for id, rs := range m.repos {
		rs.tok.mu.Lock()
		if !rs.tok.expires.IsZero() {
			out[id] = rs.tok.expires
		}
		rs.tok.mu.Unlock()
	}
	return out
}

// WarnExpiring logs, once per token and expiry, a token that expires
// within ExpiryWarning of now (github_token_expiring) or has expired
// (github_token_expired), naming the repos that use it. The broker calls
// it now and then; write calls it for the token it just used.
func (m *Manager) WarnExpiring(now time.Time) {
	seen := map[*tokenState]bool{}
	for _, id := range m.ids {
		if tok := m.repos[id].tok; !seen[tok] {
			seen[tok] = true
			m.warnExpiring(tok, now)
		}
	}
}

func (m *Manager) warnExpiring(tok *tokenState, now time.Time) {
	tok.mu.Lock()
	exp, level := tok.expires, 0
	switch {
	case exp.IsZero():
	case !now.Before(exp):
		level = 2
	case exp.Sub(now) <= ExpiryWarning:
		level = 1
	}
	due := level > 0 && (!tok.warnedFor.Equal(exp) || level > tok.warnedLevel)
	if due {
		tok.warnedFor, tok.warnedLevel = exp, level
	}
	tok.mu.Unlock()
	if !due {
		return
	}
	var ids []string
	for id, rs := range m.repos {
		if rs.tok == tok {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	ev, msg := m.log.Warn(), "github_token_expiring"
	if level == 2 {
		ev, msg = m.log.Error(), "github_token_expired"
	}
	ev.Strs("repo_ids", ids).Time("expires_at", exp).Int64("hours_left", int64(exp.Sub(now)/time.Hour)).Msg(msg)
}
