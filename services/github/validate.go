package github

import (
	"path"
	"regexp"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Limits on one commit.
const (
	MaxBranchLen    = 200
	MaxFiles        = 10
	MaxFileBytes    = 500 << 10
	MaxMessageRunes = 200
	MaxTitleRunes   = 200
	MaxReadBytes    = 1 << 20
)

var branchChars = regexp.MustCompile(`^[A-Za-z0-9._/-]+$`)

// ValidateBranchName checks b's syntax: the allowed characters, and the
// subset of git check-ref-format rules they still allow to be broken.
// Whether the repo allows the branch is checked separately.
func ValidateBranchName(b string) error {
	bad := func(why string) error {
		return brokererr.New(brokererr.InvalidBranch, "branch %s", why)
	}
	switch {
	case b == "":
		return bad("is empty")
	case len(b) > MaxBranchLen:
		return bad("is longer than 200 characters")
	case !branchChars.MatchString(b):
		return bad("may only contain letters, digits, '.', '_', '/' and '-'")
	case strings.HasPrefix(b, "/"), strings.HasSuffix(b, "/"):
		return bad("must not start or end with '/'")
	case strings.Contains(b, "//"):
		return bad("must not contain '//'")
	case strings.Contains(b, ".."):
		return bad("must not contain '..'")
	case strings.HasPrefix(b, "refs/") || b == "refs":
		return bad("is a plain branch name, without refs/")
	case strings.HasPrefix(b, "-"):
		return bad("must not start with '-'")
	case strings.HasSuffix(b, "."):
		return bad("must not end with '.'")
	case b == "HEAD":
		return bad("must not be HEAD")
	}
	for _, c := range strings.Split(b, "/") {
		if strings.HasPrefix(c, ".") || strings.HasSuffix(c, ".lock") {
			return bad("components must not start with '.' or end with '.lock'")
		}
	}
	return nil
}

// checkWriteBranch allows b when it is well formed, matches one of the
// repo's globs and is not the base branch.
func (r *Repo) checkWriteBranch(b string) error {
	if err := ValidateBranchName(b); err != nil {
		return err
	}
	if strings.EqualFold(b, r.BaseBranch) {
		return brokererr.New(brokererr.InvalidBranch, "branch %s is the base branch of %s; commit to a work branch and open a pull request", b, r.RepoID)
	}
	if !r.allows(b) {
		return brokererr.New(brokererr.InvalidBranch, "branch %s is not allowed for %s; allowed: %s", b, r.RepoID, strings.Join(r.AllowedBranches, ", "))
	}
	return nil
}

// checkReadBranch allows the base branch and every writable branch.
func (r *Repo) checkReadBranch(b string) error {
	if err := ValidateBranchName(b); err != nil {
		return err
	}
	if b == r.BaseBranch || r.allows(b) {
		return nil
	}
	return brokererr.New(brokererr.InvalidBranch, "branch %s is not readable for %s; use %s or one of: %s", b, r.RepoID, r.BaseBranch, strings.Join(r.AllowedBranches, ", "))
}

func (r *Repo) allows(b string) bool {
	for _, g := range r.AllowedBranches {
		if ok, err := path.Match(g, b); err == nil && ok {
			return true
		}
	}
	return false
}

// ValidateRepoPath checks a repository file path: the shared validator with
// the project forbidden names, plus workflow files, which would run in
// GitHub Actions with the repository's secrets.
func ValidateRepoPath(p string) (string, error) {
	p, err := workspace.ValidatePath(p, projects.ForbiddenPrefixes...)
	if err != nil {
		return "", err
	}
	if first, rest, ok := strings.Cut(p, "/"); ok && strings.EqualFold(first, ".github") {
		if dir, _, _ := strings.Cut(rest, "/"); strings.EqualFold(dir, "workflows") {
			return "", brokererr.New(brokererr.PathTraversal, "paths under .github/workflows are not allowed")
		}
	}
	return p, nil
}

// validateText checks a commit message or PR title.
func validateText(field, s string, maxRunes int, multiline bool) error {
	if !utf8.ValidString(s) {
		return brokererr.New(brokererr.InvalidInput, "%s is not valid UTF-8", field)
	}
	if strings.TrimSpace(s) == "" {
		return brokererr.New(brokererr.InvalidInput, "%s is empty", field)
	}
	if utf8.RuneCountInString(s) > maxRunes {
		return brokererr.New(brokererr.InvalidInput, "%s is longer than %d characters", field, maxRunes)
	}
	for _, c := range s {
		if c == '\n' && multiline || c == '\t' {
			continue
		}
		if unicode.IsControl(c) || textsafe.Invisible(c) {
			return brokererr.New(brokererr.InvalidInput, "%s contains a control or invisible character (%U)", field, c)
		}
	}
	return nil
}

// CheckTarget refuses, with no request made, a repository outside the
// allow-list or a branch a commit to it may not go to (execute_task checks
// its commit target before the task starts).
func (m *Manager) CheckTarget(repoID, branch string) error {
	rs, err := m.repo(repoID)
	if err != nil {
		return err
	}
	return rs.cfg.checkWriteBranch(branch)
}

// validateCommit checks everything about a commit that needs no network.
func (m *Manager) validateCommit(req CommitRequest) (*repoState, []string, error) {
	rs, err := m.repo(req.RepoID)
	if err != nil {
		return nil, nil, err
	}
	if err := rs.cfg.checkWriteBranch(req.Branch); err != nil {
		return nil, nil, err
	}
	if err := validateText("commit message", req.Message, MaxMessageRunes, true); err != nil {
		return nil, nil, err
	}
	if req.PRTitle != "" {
		if !req.CreatePR {
			return nil, nil, brokererr.New(brokererr.InvalidInput, "pr_title is only used with create_pr")
		}
		if err := validateText("PR title", req.PRTitle, MaxTitleRunes, false); err != nil {
			return nil, nil, err
		}
	}
	if len(req.Files) == 0 {
		return nil, nil, brokererr.New(brokererr.InvalidInput, "no files to commit")
	}
	if len(req.Files) > MaxFiles {
		return nil, nil, brokererr.New(brokererr.InvalidInput, "at most %d files per commit", MaxFiles)
	}
	paths := make([]string, 0, len(req.Files))
	for p, data := range req.Files {
		if _, err := ValidateRepoPath(p); err != nil {
			return nil, nil, err
		}
		if len(data) > MaxFileBytes {
			return nil, nil, brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", p, MaxFileBytes)
		}
		paths = append(paths, p)
	}
	sort.Strings(paths)
	// Git trees are case-sensitive, but a checkout on macOS or Windows is
	// not: two names differing only in case would overwrite each other. A
	// file cannot also be a directory of another path in one tree.
	for i, p := range paths {
		for _, q := range paths[i+1:] {
			lp, lq := strings.ToLower(p), strings.ToLower(q)
			switch {
			case lp == lq:
				return nil, nil, brokererr.New(brokererr.InvalidInput, "%s and %s differ only in case", p, q)
			case strings.HasPrefix(lq, lp+"/"), strings.HasPrefix(lp, lq+"/"):
				return nil, nil, brokererr.New(brokererr.InvalidInput, "%s and %s: a file cannot also be a directory", p, q)
			}
		}
	}
	return rs, paths, nil
}
