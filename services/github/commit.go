package github

import (
	"bytes"
	"context"
	"encoding/base64"
	"net/http"
	"strings"
	"unicode/utf8"

	gh "github.com/google/go-github/v92/github"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Commit writes all files in one commit through the Git Data API: a tree
// on the branch's (or base branch's) tree with the text files inline and
// the binary ones as blobs, a commit with that parent, then one ref update
// without force. The ref update is the only step that changes the branch,
// so the commit is all or nothing. Everything the caller sent is validated
// before the first request.
//
// If the branch moves between reading its head and the ref update (GitHub
// answers 422, not a fast forward, or "Reference already exists" for a
// branch created meanwhile), the tree and commit are rebuilt on the new
// head, reusing the entries, at most refAttempts times in all. Nothing is
// ever forced, so no one else's commit is lost.
func (m *Manager) Commit(ctx context.Context, req CommitRequest) (CommitResult, error) {
	rs, paths, err := m.validateCommit(req)
	if err != nil {
		return CommitResult{}, err
	}
	if !rs.writeReady() {
		if err := m.CheckAccess(ctx, req.RepoID); err != nil {
			return CommitResult{}, err
		}
		rs.markWriteChecked()
	}
	// The globs may match it (a "*"), and it may differ from base_branch.
	if rs.isDefaultBranch(req.Branch) {
		return CommitResult{}, brokererr.New(brokererr.InvalidBranch,
			"branch %s is the default branch of %s; commit to a work branch and open a pull request", req.Branch, req.RepoID)
	}
	select {
	case rs.tok.write <- struct{}{}:
		defer func() { <-rs.tok.write }()
	case <-ctx.Done():
		return CommitResult{}, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "another commit with the token of %s is still running", req.RepoID)
	}

	head, exists, err := m.branchHead(ctx, rs, req.Branch)
	if err != nil {
		return CommitResult{}, err
	}
	var entries []*gh.TreeEntry
	var sha string
	for attempt := 1; ; attempt++ {
		parent := head
		if !exists {
			if parent, _, err = m.branchHead(ctx, rs, rs.cfg.BaseBranch); err != nil {
				return CommitResult{}, err
			}
			if parent == "" {
				return CommitResult{}, brokererr.New(brokererr.InvalidRepo, "base branch %s does not exist in %s", rs.cfg.BaseBranch, req.RepoID)
			}
		}
		baseTree, err := m.commitTree(ctx, rs, parent)
		if err != nil {
			return CommitResult{}, err
		}
		if entries == nil {
			if entries, err = m.treeEntries(ctx, rs, req.Files, paths); err != nil {
				return CommitResult{}, err
			}
		}
		if sha, err = m.createCommit(ctx, rs, baseTree, entries, parent, req.Message); err != nil {
			return CommitResult{}, err
		}
		// The branch moves here and only here. A new branch is created at
		// the new commit directly, so it never exists half made.
		err = m.moveBranch(ctx, rs, req.Branch, exists, sha)
		if err == nil {
			break
		}
		if !isStatus(err, http.StatusUnprocessableEntity) {
			return CommitResult{}, m.apiError(rs, "update ref", err)
		}
		// 422: either the branch moved (a lost race) or GitHub refused the
		// update for another reason. Only the first is retried.
		now, nowExists, herr := m.branchHead(ctx, rs, req.Branch)
		if herr != nil {
			return CommitResult{}, herr
		}
		if now == head && nowExists == exists {
			return CommitResult{}, m.apiError(rs, "update ref", err)
		}
		if attempt >= refAttempts {
			return CommitResult{}, brokererr.Wrap(err, brokererr.Conflict,
				"branch %s kept changing on GitHub while committing; nothing was written to it, try again", req.Branch)
		}
		m.log.Info().Str("repo_id", req.RepoID).Str("branch", req.Branch).Int("attempt", attempt).Msg("github_branch_moved_retrying")
		head, exists = now, nowExists
	}
	m.log.Info().Str("repo_id", req.RepoID).Str("branch", req.Branch).Int("files", len(paths)).
		Bool("branch_created", !exists).Str("commit_sha", sha).Msg("github_commit")

	res := CommitResult{CommitSHA: sha, Branch: req.Branch}
	if req.CreatePR {
		title := req.PRTitle
		if title == "" {
			title = firstLine(req.Message)
		}
		u, err := m.pullRequest(ctx, rs, req.Branch, title)
		if err != nil {
			// The commit stands: report it as done, with why the PR is
			// missing (a retry with create_pr only opens the PR).
			e := brokererr.As(err)
			if e == nil {
				e = brokererr.Wrap(err, brokererr.InternalError, "the pull request could not be opened")
			}
			m.log.Warn().Str("repo_id", req.RepoID).Str("branch", req.Branch).Str("error_code", string(e.Code)).Msg("github_pull_request_failed")
			res.PRError = e
			return res, nil
		}
		res.PRURL = u
	}
	return res, nil
}

// commitTree returns the tree SHA of a commit.
func (m *Manager) commitTree(ctx context.Context, rs *repoState, commitSHA string) (string, error) {
	var c *gh.Commit
	err := m.read(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		c, resp, err = rs.client.Git.GetCommit(ctx, rs.cfg.Owner, rs.cfg.Name, commitSHA)
		return resp, err
	})
	if err != nil {
		return "", m.apiError(rs, "get commit", err)
	}
	if c.GetTree().GetSHA() == "" {
		return "", brokererr.New(brokererr.Unavailable, "GitHub returned a commit without a tree")
	}
	return c.GetTree().GetSHA(), nil
}

// treeEntries returns the tree entries of files. A text file (valid UTF-8
// without NUL) goes inline, in the entry's content, so GitHub writes its
// blob with the tree: GitHub asks for mutating requests to be few and
// serial, and a commit of text files is then three of them. Only a binary
// file needs its own blob request (base64), made one at a time.
func (m *Manager) treeEntries(ctx context.Context, rs *repoState, files map[string][]byte, paths []string) ([]*gh.TreeEntry, error) {
	entries := make([]*gh.TreeEntry, 0, len(paths))
	for _, p := range paths {
		if isText(files[p]) {
			entries = append(entries, &gh.TreeEntry{Path: new(p), Mode: new("100644"), Type: new("blob"), Content: new(string(files[p]))})
			continue
		}
		var blob *gh.Blob
		err := m.write(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
			var resp *gh.Response
			var err error
			blob, resp, err = rs.client.Git.CreateBlob(ctx, rs.cfg.Owner, rs.cfg.Name, gh.Blob{
				Content: new(base64.StdEncoding.EncodeToString(files[p])), Encoding: new("base64")})
			return resp, err
		})
		if err != nil {
			return nil, m.apiError(rs, "create blob", err)
		}
		if blob.GetSHA() == "" {
			return nil, brokererr.New(brokererr.Unavailable, "GitHub returned a blob without a SHA")
		}
		entries = append(entries, &gh.TreeEntry{Path: new(p), Mode: new("100644"), Type: new("blob"), SHA: blob.SHA})
	}
	return entries, nil
}

// createCommit makes a tree of entries on baseTree and a commit of it with
// parent as its only parent, and returns the commit SHA.
func (m *Manager) createCommit(ctx context.Context, rs *repoState, baseTree string, entries []*gh.TreeEntry, parent, message string) (string, error) {
	owner, name := rs.cfg.Owner, rs.cfg.Name
	var tree *gh.Tree
	err := m.write(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		tree, resp, err = rs.client.Git.CreateTree(ctx, owner, name, baseTree, entries)
		return resp, err
	})
	if err != nil {
		return "", m.apiError(rs, "create tree", err)
	}
	if tree.GetSHA() == "" {
		return "", brokererr.New(brokererr.Unavailable, "GitHub returned a tree without a SHA")
	}
	var commit *gh.Commit
	err = m.write(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		commit, resp, err = rs.client.Git.CreateCommit(ctx, owner, name, gh.Commit{
			Message: new(message), Tree: &gh.Tree{SHA: tree.SHA}, Parents: []*gh.Commit{{SHA: new(parent)}}}, nil)
		return resp, err
	})
	if err != nil {
		return "", m.apiError(rs, "create commit", err)
	}
	if commit.GetSHA() == "" {
		return "", brokererr.New(brokererr.Unavailable, "GitHub returned a commit without a SHA")
	}
	return commit.GetSHA(), nil
}

// moveBranch points branch at sha: a fast-forward-only update of an
// existing branch, or the creation of a new one. Its error is go-github's.
func (m *Manager) moveBranch(ctx context.Context, rs *repoState, branch string, exists bool, sha string) error {
	return m.write(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		if exists {
			_, resp, err := rs.client.Git.UpdateRef(ctx, rs.cfg.Owner, rs.cfg.Name, "heads/"+branch, gh.UpdateRef{SHA: sha, Force: new(false)})
			return resp, err
		}
		_, resp, err := rs.client.Git.CreateRef(ctx, rs.cfg.Owner, rs.cfg.Name, gh.CreateRef{Ref: "refs/heads/" + branch, SHA: sha})
		return resp, err
	})
}

// firstLine is the first non-blank line of a validated message.
func firstLine(msg string) string {
	for _, l := range strings.Split(msg, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			return l
		}
	}
	return "Changes from sandbox-broker"
}

// branchHead returns the commit a branch points at; exists is false (and
// err nil) when the branch does not exist.
func (m *Manager) branchHead(ctx context.Context, rs *repoState, branch string) (sha string, exists bool, err error) {
	var ref *gh.Reference
	err = m.read(ctx, rs, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		ref, resp, err = rs.client.Git.GetRef(ctx, rs.cfg.Owner, rs.cfg.Name, "heads/"+branch)
		return resp, err
	})
	if isStatus(err, http.StatusNotFound) {
		return "", false, nil
	}
	if err != nil {
		return "", false, m.apiError(rs, "get ref", err)
	}
	if ref.GetRef() != "refs/heads/"+branch || ref.GetObject().GetType() != "commit" || ref.GetObject().GetSHA() == "" {
		return "", false, brokererr.New(brokererr.Unavailable, "GitHub returned an unexpected ref for %s", branch)
	}
	return ref.GetObject().GetSHA(), true, nil
}

// isText reports whether b can travel as a JSON string unchanged: valid
// UTF-8 and no NUL (which git tools take for binary).
func isText(b []byte) bool {
	return utf8.Valid(b) && bytes.IndexByte(b, 0) < 0
}
