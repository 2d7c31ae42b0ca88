package github

import (
	"context"
	"net/http"

	gh "github.com/google/go-github/v92/github"
)

// pullRequest returns the open PR from branch into the base branch,
// opening one if there is none.
func (m *Manager) pullRequest(ctx context.Context, rs *repoState, branch, title string) (string, error) {
	owner, name := rs.cfg.Owner, rs.cfg.Name
	find := func() (string, error) {
		var prs []*gh.PullRequest
		err := m.read(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
			var resp *gh.Response
			var err error
			prs, resp, err = rs.client.PullRequests.List(ctx, owner, name, &gh.PullRequestListOptions{
				State: "open", Head: owner + ":" + branch, Base: rs.cfg.BaseBranch})
			return resp, err
		})
		if err != nil {
			return "", m.apiError(rs, "list pull requests", err)
		}
		for _, pr := range prs {
			if pr.GetHead().GetRef() == branch && pr.GetHTMLURL() != "" {
				return pr.GetHTMLURL(), nil
			}
		}
		return "", nil
	}
	if u, err := find(); err != nil || u != "" {
		return u, err
	}
	var pr *gh.PullRequest
	err := m.write(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		pr, resp, err = rs.client.PullRequests.Create(ctx, owner, name, gh.CreatePullRequest{
			Title: new(title), Head: branch, Base: rs.cfg.BaseBranch,
			Body: new("Opened by sandbox-broker.")})
		return resp, err
	})
	if isStatus(err, http.StatusUnprocessableEntity) {
		// Opened concurrently by someone else: use theirs.
		if u, ferr := find(); ferr == nil && u != "" {
			return u, nil
		}
	}
	if err != nil {
		return "", m.apiError(rs, "create pull request", err)
	}
	m.log.Info().Str("repo_id", rs.cfg.RepoID).Str("branch", branch).Int("pr_number", pr.GetNumber()).Msg("github_pull_request")
	return pr.GetHTMLURL(), nil
}
