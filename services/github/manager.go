package github

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	gh "github.com/google/go-github/v92/github"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// DefaultAPIURL is GitHub's REST API.
const DefaultAPIURL = "https://api.github.com/"

// Defaults and bounds of the calls to GitHub.
const (
	defaultTimeout   = 20 * time.Second
	maxResponseBytes = 8 << 20 // a 1 MB file is ~1.4 MB of base64 JSON
	readAttempts     = 3
	retryBase        = 250 * time.Millisecond
	defaultRetry     = time.Minute // GitHub: "wait for at least one minute"
	startupChecks    = 8
	// refAttempts bounds how often a commit is rebuilt on a branch head
	// that moved under it (a lost race at the non-force ref update).
	refAttempts = 3
)

// Options configure a Manager.
type Options struct {
	// APIURL is GITHUB_API_URL; empty means DefaultAPIURL.
	APIURL string
	// Repos is the allow-list, with tokens resolved (LoadRepos).
	Repos []Repo
	// HTTP is the base client; nil means a new default client. It is
	// copied, never modified.
	HTTP *http.Client
	// Timeout bounds each GitHub call; 0 means 20s.
	Timeout time.Duration
	Log     zerolog.Logger
}

// CommitRequest is one atomic multi-file commit.
type CommitRequest struct {
	RepoID   string
	Branch   string
	Files    map[string][]byte // repo-relative path → content
	Message  string
	CreatePR bool
	PRTitle  string // default: the message's first line
}

// CommitResult says where the commit went.
type CommitResult struct {
	CommitSHA string
	Branch    string
	PRURL     string
}

// Manager talks to GitHub for the allow-listed repos only, one client and
// token per repo.
type Manager struct {
	log     zerolog.Logger
	timeout time.Duration
	repos   map[string]*repoState
	ids     []string
}

type repoState struct {
	cfg    Repo
	client *gh.Client
	// write serialises this process's commits to the repo, so two calls do
	// not race each other into a non-fast-forward. A channel, so waiting
	// for it honours the caller's context.
	write chan struct{}

	mu      sync.Mutex
	canPush bool
	// writeChecked is set once push access was checked on the way to a
	// write, not only at start-up: the start-up check can be hours old.
	writeChecked bool
	status       string
	// limitedUntil closes the gate after a rate limit (see rateLimited).
	limitedUntil time.Time
}

// New builds a Manager and checks every repo's push access once. A failed
// check is not an error here: it shows in Status. Access is checked again
// before the first write to each repo, and after GitHub refuses the token.
// Configuration errors are errors.
func New(ctx context.Context, o Options) (*Manager, error) {
	if len(o.Repos) == 0 {
		return nil, errors.New("github: no repositories in the allow-list")
	}
	base, err := apiBase(o.APIURL)
	if err != nil {
		return nil, err
	}
	hc := &http.Client{}
	if o.HTTP != nil {
		c := *o.HTTP
		hc = &c
	}
	rt := hc.Transport
	if rt == nil {
		rt = http.DefaultTransport
	}
	hc.Transport = capTransport{base: rt, max: maxResponseBytes}
	// go-github adds the token to every request its transport sees,
	// redirects included: never follow one off the API host.
	hc.CheckRedirect = func(req *http.Request, via []*http.Request) error {
		if req.URL.Scheme != base.Scheme || req.URL.Host != base.Host || len(via) >= 3 {
			return http.ErrUseLastResponse
		}
		return nil
	}
	m := &Manager{log: o.Log, timeout: o.Timeout, repos: map[string]*repoState{}}
	if m.timeout <= 0 {
		m.timeout = defaultTimeout
	}
	baseURL := base.String()
	for _, r := range o.Repos {
		if err := r.validate(); err != nil {
			return nil, fmt.Errorf("github: %w", err)
		}
		if err := checkTokenShape(r.token); err != nil {
			return nil, fmt.Errorf("github: repo %s: the token in %s is %w", r.RepoID, r.TokenEnv, err)
		}
		if _, dup := m.repos[r.RepoID]; dup {
			return nil, fmt.Errorf("github: repo_id %s is listed twice", r.RepoID)
		}
		// go-github blocks a client after a secondary limit for its
		// Retry-After or, lacking one, until X-RateLimit-Reset (the primary
		// window, up to an hour); GitHub asks for a minute then. Capping
		// its block keeps it within the manager's own gate.
		client, err := gh.NewClient(gh.WithHTTPClient(hc), gh.WithAuthToken(r.token),
			gh.WithURLs(&baseURL, &baseURL), gh.WithUserAgent("sandbox-broker"),
			gh.WithMaxSecondaryRateLimitRetryAfterDuration(defaultRetry))
		if err != nil {
			return nil, fmt.Errorf("github: repo %s: client: %w", r.RepoID, err)
		}
		r.AllowedBranches = append([]string(nil), r.AllowedBranches...)
		m.repos[r.RepoID] = &repoState{cfg: r, client: client, status: "not checked", write: make(chan struct{}, 1)}
		m.ids = append(m.ids, r.RepoID)
	}
	sort.Strings(m.ids)
	// Checked in parallel, a few at a time, so a slow GitHub delays start-up
	// by one check's worth of retries rather than one per repo.
	sem := make(chan struct{}, startupChecks)
	var wg sync.WaitGroup
	for _, id := range m.ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := m.CheckAccess(ctx, id); err != nil {
				m.log.Warn().Str("repo_id", id).Str("error_code", string(brokererr.CodeOf(err))).Msg("github_access_check_failed")
			}
		}()
	}
	wg.Wait()
	return m, nil
}

func apiBase(raw string) (*url.URL, error) {
	if raw == "" {
		raw = DefaultAPIURL
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return nil, errors.New("github: GITHUB_API_URL must be an http(s) URL without credentials, query or fragment")
	}
	if !strings.HasSuffix(u.Path, "/") {
		u.Path += "/"
	}
	return u, nil
}

// RepoIDs lists the allow-listed repo IDs, sorted.
func (m *Manager) RepoIDs() []string { return append([]string(nil), m.ids...) }

func (m *Manager) repo(id string) (*repoState, error) {
	if rs, ok := m.repos[id]; ok {
		return rs, nil
	}
	return nil, brokererr.New(brokererr.InvalidRepo, "repo_id %q is not allow-listed; allowed: %s", id, strings.Join(m.ids, ", "))
}

// Status reports each repo's last access check for /readyz: "ok" or a short
// reason. It holds no secrets.
func (m *Manager) Status() map[string]string {
	out := make(map[string]string, len(m.repos))
	for id, rs := range m.repos {
		rs.mu.Lock()
		out[id] = rs.status
		rs.mu.Unlock()
	}
	return out
}

func (rs *repoState) setAccess(ok bool, status string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.canPush, rs.status = ok, status
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

// CheckAccess asks GitHub whether the repo's token can push to it.
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
	}
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

// Commit writes all files in one commit through the Git Data API: blobs, a
// tree on the branch's (or base branch's) tree, a commit with that parent,
// then one ref update without force. The ref update is the only step that
// changes the branch, so the commit is all or nothing. Everything the caller
// sent is validated before the first request.
//
// If the branch moves between reading its head and the ref update (GitHub
// answers 422, not a fast forward, or "Reference already exists" for a
// branch created meanwhile), the tree and commit are rebuilt on the new
// head, reusing the blobs, at most refAttempts times in all. Nothing is
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
	select {
	case rs.write <- struct{}{}:
		defer func() { <-rs.write }()
	case <-ctx.Done():
		return CommitResult{}, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "another commit to %s is still running", req.RepoID)
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
			if entries, err = m.createBlobs(ctx, rs, req.Files, paths); err != nil {
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
			// The commit stands; say so rather than hide it behind the error.
			code, msg := brokererr.CodeOf(err), "unknown error"
			if e := brokererr.As(err); e != nil {
				msg = e.Message
			}
			berr := brokererr.Wrap(err, code, "committed %s to %s, but the pull request failed: %s", sha, req.Branch, msg)
			if e := brokererr.As(err); e != nil && e.RetryAfter > 0 {
				berr = berr.WithRetryAfter(e.RetryAfter)
			}
			return res, berr
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

// createBlobs uploads each file as a base64 blob (binary-safe) and returns
// the tree entries naming them.
func (m *Manager) createBlobs(ctx context.Context, rs *repoState, files map[string][]byte, paths []string) ([]*gh.TreeEntry, error) {
	entries := make([]*gh.TreeEntry, 0, len(paths))
	for _, p := range paths {
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
		fc, dir, resp, err = rs.client.Repositories.GetContents(ctx, rs.cfg.Owner, rs.cfg.Name, p, &gh.RepositoryContentGetOptions{Ref: branch})
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

// read runs an idempotent GitHub read with a timeout per attempt, retrying
// transport failures and 5xx answers a bounded number of times.
func (m *Manager) read(ctx context.Context, rs *repoState, call func(context.Context) (*gh.Response, error)) error {
	var err error
	for attempt := 0; attempt < readAttempts; attempt++ {
		if attempt > 0 {
			t := time.NewTimer(retryBase << (attempt - 1))
			select {
			case <-ctx.Done():
				t.Stop()
				return err
			case <-t.C:
			}
		}
		err = m.write(ctx, rs, call)
		if !retryable(ctx, err) {
			return err
		}
	}
	return err
}

// write runs one GitHub call with a timeout; writes are never retried.
// While the repo's token is rate limited no request is made at all.
func (m *Manager) write(ctx context.Context, rs *repoState, call func(context.Context) (*gh.Response, error)) error {
	if err := rs.limited(time.Now()); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, m.timeout)
	defer cancel()
	resp, err := call(cctx)
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	return err
}

func retryable(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil || brokererr.As(err) != nil {
		return false
	}
	var rle *gh.RateLimitError
	var abuse *gh.AbuseRateLimitError
	if errors.As(err, &rle) || errors.As(err, &abuse) {
		return false
	}
	var er *gh.ErrorResponse
	if errors.As(err, &er) {
		return er.Response != nil && er.Response.StatusCode >= 500
	}
	var redirect *gh.RedirectionError
	return !errors.As(err, &redirect) && !errors.Is(err, errTooLarge)
}

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

// rateLimited maps a rate limit to RATE_LIMIT_EXCEEDED with retry_after_s
// and closes the repo's gate until then, so no request is sent while
// GitHub would refuse it (clients that keep trying risk being banned).
func rateLimited(err error, rs *repoState, d time.Duration) error {
	d = clampRetry(d)
	rs.mu.Lock()
	if until := time.Now().Add(d); until.After(rs.limitedUntil) {
		rs.limitedUntil = until
	}
	rs.mu.Unlock()
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
	rs.mu.Lock()
	until := rs.limitedUntil
	rs.mu.Unlock()
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

// clip makes GitHub's message one short line.
func clip(s string, n int) string {
	s = strings.ToValidUTF8(strings.Join(strings.Fields(s), " "), "")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n]) + "…"
}

// capTransport bounds every response body, so a broken or hostile endpoint
// cannot make the broker buffer without limit.
type capTransport struct {
	base http.RoundTripper
	max  int64
}

func (t capTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.base.RoundTrip(r)
	if err == nil && resp.Body != nil {
		resp.Body = &capBody{ReadCloser: resp.Body, left: t.max}
	}
	return resp, err
}

var errTooLarge = errors.New("github: response body too large")

type capBody struct {
	io.ReadCloser
	left int64
}

func (b *capBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// At the cap: fine if the body ends here, an error if it goes on.
		var one [1]byte
		if n, err := b.ReadCloser.Read(one[:]); n == 0 && err != nil {
			return 0, err
		}
		return 0, errTooLarge
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}
