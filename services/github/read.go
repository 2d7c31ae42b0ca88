package github

import (
	"context"
	"net/http"

	gh "github.com/google/go-github/v92/github"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// ReadFile returns a file's bytes at the head of branch (default: the base
// branch), its size and blob SHA. Files over 1 MB are refused.
func (m *Manager) ReadFile(ctx context.Context, repoID, p, branch string) ([]byte, int, string, error) {
	rs, err := m.repo(repoID)
	if err != nil {
		return nil, 0, "", err
	}
	if branch == "" {
		branch = rs.cfg.BaseBranch
	}
	if err := rs.cfg.checkReadBranch(branch); err != nil {
		return nil, 0, "", err
	}
	if _, err := workspace.ValidatePath(p, projects.ForbiddenPrefixes...); err != nil {
		return nil, 0, "", err
	}
	var fc *gh.RepositoryContent
	var dir []*gh.RepositoryContent
	err = m.read(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		// The full ref: a bare name could resolve to a tag of that name
		// (git looks in refs/tags before refs/heads).
		fc, dir, resp, err = rs.client.Repositories.GetContents(ctx, rs.cfg.Owner, rs.cfg.Name, p, &gh.RepositoryContentGetOptions{Ref: "refs/heads/" + branch})
		return resp, err
	})
	if isStatus(err, http.StatusNotFound) {
		return nil, 0, "", brokererr.New(brokererr.FileNotFound, "%s was not found on branch %s of %s", p, branch, repoID)
	}
	if err != nil {
		return nil, 0, "", m.apiError(rs, "get contents", err)
	}
	if fc == nil || dir != nil {
		return nil, 0, "", brokererr.New(brokererr.InvalidInput, "%s is a directory", p)
	}
	if fc.GetType() != "file" {
		return nil, 0, "", brokererr.New(brokererr.InvalidInput, "%s is a %s, not a file", p, fc.GetType())
	}
	if fc.GetSize() > MaxReadBytes || fc.GetEncoding() == "none" {
		return nil, 0, "", brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", p, MaxReadBytes)
	}
	s, err := fc.GetContent()
	if err != nil {
		return nil, 0, "", brokererr.Wrap(err, brokererr.Unavailable, "GitHub returned content that could not be decoded")
	}
	if len(s) > MaxReadBytes {
		return nil, 0, "", brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", p, MaxReadBytes)
	}
	return []byte(s), len(s), fc.GetSHA(), nil
}
