package github

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	gh "github.com/google/go-github/v92/github"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

func isStatus(err error, code int) bool {
	var er *gh.ErrorResponse
	return errors.As(err, &er) && er.Response != nil && er.Response.StatusCode == code
}

// apiError turns a GitHub failure into an error the model can act on. The
// go-github error (method, URL path, GitHub's message) stays as the cause,
// for the server log only.
func (m *Manager) apiError(rs *repoState, op string, err error) error {
	status := 0
	var er *gh.ErrorResponse
	if errors.As(err, &er) && er.Response != nil {
		status = er.Response.StatusCode
	}
	if be := brokererr.As(err); be != nil {
		return be // already mapped (the rate-limit gate)
	}
	m.log.Warn().Str("repo_id", rs.cfg.RepoID).Str("op", op).Int("status", status).Msg("github_request_failed")
	var rle *gh.RateLimitError
	var abuse *gh.AbuseRateLimitError
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		return brokererr.Wrap(err, brokererr.Unavailable, "GitHub did not answer in time (%s)", op)
	case errors.As(err, &rle):
		return rateLimited(err, rs, time.Until(rle.Rate.Reset.Time))
	case errors.As(err, &abuse):
		// GitHub's rule for a secondary limit: Retry-After if sent, else
		// X-RateLimit-Reset if X-RateLimit-Remaining is 0, else at least a
		// minute. go-github falls back to X-RateLimit-Reset regardless,
		// which on GitHub (sending it on every answer) is the primary
		// window's end, up to an hour away. Its own answers (the client
		// refusing while blocked) carry no headers and the time left.
		if abuse.Response == nil || len(abuse.Response.Header) == 0 {
			return rateLimited(err, rs, abuse.GetRetryAfter())
		}
		d, _ := retryAfter(abuse.Response.Header, time.Now())
		return rateLimited(err, rs, d)
	}
	if er != nil && er.Response != nil {
		h := er.Response.Header
		if status == http.StatusTooManyRequests || status == http.StatusForbidden {
			// GitHub answers both limits with 403 or 429: the primary with
			// X-RateLimit-Remaining: 0, a secondary with a message saying so
			// and maybe Retry-After. A 403 that is neither is a permission
			// problem, and must not be mistaken for one.
			if d, ok := retryAfter(h, time.Now()); ok {
				return rateLimited(err, rs, d)
			}
			if status == http.StatusTooManyRequests || mentionsRateLimit(er.Message) {
				return rateLimited(err, rs, 0)
			}
		}
		switch {
		case status == http.StatusUnauthorized:
			rs.invalidate("token rejected")
			return brokererr.Wrap(err, brokererr.GitHubAuthFailed, "GitHub rejected the token for %s (expired or revoked); the operator must replace it", rs.cfg.RepoID)
		case status == http.StatusForbidden:
			rs.invalidate("token lacks permission")
			need := ""
			if v := h.Get("X-Accepted-GitHub-Permissions"); v != "" && len(v) < 100 {
				need = " (needs " + v + ")"
			}
			return brokererr.Wrap(err, brokererr.PermissionDenied, "the token for %s may not %s%s", rs.cfg.RepoID, op, need)
		case status == http.StatusNotFound:
			return brokererr.Wrap(err, brokererr.InvalidRepo, "GitHub answered not found for %s (%s)", rs.cfg.RepoID, op)
		case status == http.StatusConflict || status == http.StatusUnprocessableEntity:
			return brokererr.Wrap(err, brokererr.Conflict, "GitHub refused to %s: %s", op, clip(er.Message, 120))
		}
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "GitHub request failed (%s)", op)
}

// clip makes GitHub's message one short line.
func clip(s string, n int) string {
	s = strings.ToValidUTF8(strings.Join(strings.Fields(s), " "), "")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n]) + "…"
}
