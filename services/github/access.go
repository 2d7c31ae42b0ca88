package github

import (
	"context"
	"net/http"
	"strings"

	gh "github.com/google/go-github/v92/github"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

func (rs *repoState) setAccess(ok bool, status string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.canPush, rs.status = ok, status
}

// isDefaultBranch reports whether b is the default branch as of the last
// access check; it must follow a successful one.
func (rs *repoState) isDefaultBranch(b string) bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return strings.EqualFold(b, rs.defaultBranch)
}

// invalidate forgets a good check after GitHub refused the token, so the
// next write checks again.
func (rs *repoState) invalidate(status string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.canPush, rs.status = false, status
}

// writeReady reports whether a write may go ahead without a new check.
func (rs *repoState) writeReady() bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.writeChecked && rs.canPush
}

func (rs *repoState) markWriteChecked() {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.writeChecked = true
}

// CheckAccess asks GitHub whether the repo's token can push to it, and
// learns the repository's default branch.
func (m *Manager) CheckAccess(ctx context.Context, repoID string) error {
	rs, err := m.repo(repoID)
	if err != nil {
		return err
	}
	var repo *gh.Repository
	err = m.read(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		repo, resp, err = rs.client.Repositories.Get(ctx, rs.cfg.Owner, rs.cfg.Name)
		return resp, err
	})
	switch {
	case isStatus(err, http.StatusNotFound):
		rs.setAccess(false, "repository not found or not shared with the token")
		return brokererr.New(brokererr.InvalidRepo, "repository of %s was not found, or its token was not granted access to it", repoID)
	case err != nil:
		berr := m.apiError(rs, "check access", err)
		rs.setAccess(false, statusFor(berr))
		return berr
	case repo.GetArchived():
		rs.setAccess(false, "repository is archived")
		return brokererr.New(brokererr.PermissionDenied, "repository of %s is archived", repoID)
	case !repo.GetPermissions().GetPush():
		rs.setAccess(false, "token cannot push")
		return brokererr.New(brokererr.PermissionDenied, "the token for %s cannot push to the repository", repoID)
	case repo.GetDefaultBranch() == "":
		// Without it no write could be told apart from one to the
		// default branch.
		rs.setAccess(false, "GitHub did not report the default branch")
		return brokererr.New(brokererr.Unavailable, "GitHub did not report the default branch of %s", repoID)
	}
	rs.mu.Lock()
	rs.defaultBranch = repo.GetDefaultBranch()
	rs.mu.Unlock()
	rs.setAccess(true, "ok")
	m.log.Info().Str("repo_id", repoID).Msg("github_access_ok")
	return nil
}

func statusFor(err error) string {
	switch brokererr.CodeOf(err) {
	case brokererr.GitHubAuthFailed:
		return "token rejected"
	case brokererr.RateLimitExceeded:
		return "rate limited"
	case brokererr.PermissionDenied:
		return "token lacks permission"
	}
	return "GitHub unreachable"
}
