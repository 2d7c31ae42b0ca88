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
	defaultRetry     = time.Minute
	startupChecks    = 8
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
	checked bool
	canPush bool
	status  string
}

// New builds a Manager and checks every repo's push access once. A failed
// check is not an error here: it shows in Status and is re-run before the
// first write. Configuration errors are.
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
		client, err := gh.NewClient(gh.WithHTTPClient(hc), gh.WithAuthToken(r.token),
			gh.WithURLs(&baseURL, &baseURL), gh.WithUserAgent("sandbox-broker"))
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
	rs.checked, rs.canPush, rs.status = true, ok, status
}

// invalidate forgets a good check after GitHub refused the token, so the
// next write checks again.
func (rs *repoState) invalidate(status string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.canPush, rs.status = false, status
}

func (rs *repoState) pushOK() bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.checked && rs.canPush
}

// CheckAccess asks GitHub whether the repo's token can push to it.
func (m *Manager) CheckAccess(ctx context.Context, repoID string) error {
	rs, err := m.repo(repoID)
	if err != nil {
		return err
	}
	var repo *gh.Repository
	err = m.read(ctx, func(ctx context.Context) (*gh.Response, error) {
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
func (m *Manager) Commit(ctx context.Context, req CommitRequest) (CommitResult, error) {
	rs, paths, err := m.validateCommit(req)
	if err != nil {
		return CommitResult{}, err
	}
	if !rs.pushOK() {
		if err := m.CheckAccess(ctx, req.RepoID); err != nil {
			return CommitResult{}, err
		}
	}
	select {
	case rs.write <- struct{}{}:
		defer func() { <-rs.write }()
	case <-ctx.Done():
		return CommitResult{}, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "another commit to %s is still running", req.RepoID)
	}
	owner, name := rs.cfg.Owner, rs.cfg.Name

	parent, exists, err := m.branchHead(ctx, rs, req.Branch)
	if err != nil {
		return CommitResult{}, err
	}
	if !exists {
		if parent, _, err = m.branchHead(ctx, rs, rs.cfg.BaseBranch); err != nil {
			return CommitResult{}, err
		}
		if parent == "" {
			return CommitResult{}, brokererr.New(brokererr.InvalidRepo, "base branch %s does not exist in %s", rs.cfg.BaseBranch, req.RepoID)
		}
	}
	var parentCommit *gh.Commit
	err = m.read(ctx, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		parentCommit, resp, err = rs.client.Git.GetCommit(ctx, owner, name, parent)
		return resp, err
	})
	if err != nil {
		return CommitResult{}, m.apiError(rs, "get commit", err)
	}
	baseTree := parentCommit.GetTree().GetSHA()
	if baseTree == "" {
		return CommitResult{}, brokererr.New(brokererr.Unavailable, "GitHub returned a commit without a tree")
	}

	entries := make([]*gh.TreeEntry, 0, len(paths))
	for _, p := range paths {
		var blob *gh.Blob
		err := m.write(ctx, func(ctx context.Context) (*gh.Response, error) {
			var resp *gh.Response
			var err error
			blob, resp, err = rs.client.Git.CreateBlob(ctx, owner, name, gh.Blob{
				Content: new(base64.StdEncoding.EncodeToString(req.Files[p])), Encoding: new("base64")})
			return resp, err
		})
		if err != nil {
			return CommitResult{}, m.apiError(rs, "create blob", err)
		}
		if blob.GetSHA() == "" {
			return CommitResult{}, brokererr.New(brokererr.Unavailable, "GitHub returned a blob without a SHA")
		}
		entries = append(entries, &gh.TreeEntry{Path: new(p), Mode: new("100644"), Type: new("blob"), SHA: blob.SHA})
	}
	var tree *gh.Tree
	err = m.write(ctx, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		tree, resp, err = rs.client.Git.CreateTree(ctx, owner, name, baseTree, entries)
		return resp, err
	})
	if err != nil {
		return CommitResult{}, m.apiError(rs, "create tree", err)
	}
	var commit *gh.Commit
	err = m.write(ctx, func(ctx context.Context) (*gh.Response, error) {
		var resp *gh.Response
		var err error
		commit, resp, err = rs.client.Git.CreateCommit(ctx, owner, name, gh.Commit{
			Message: new(req.Message), Tree: &gh.Tree{SHA: tree.SHA}, Parents: []*gh.Commit{{SHA: new(parent)}}}, nil)
		return resp, err
	})
	if err != nil {
		return CommitResult{}, m.apiError(rs, "create commit", err)
	}
	sha := commit.GetSHA()
	if sha == "" || tree.GetSHA() == "" {
		return CommitResult{}, brokererr.New(brokererr.Unavailable, "GitHub returned an object without a SHA")
	}

	// The branch moves here and only here. A new branch is created at the
	// new commit directly, so it never exists half made.
	err = m.write(ctx, func(ctx context.Context) (*gh.Response, error) {
		if exists {
			_, resp, err := rs.client.Git.UpdateRef(ctx, owner, name, "heads/"+req.Branch, gh.UpdateRef{SHA: sha, Force: new(false)})
			return resp, err
		}
		_, resp, err := rs.client.Git.CreateRef(ctx, owner, name, gh.CreateRef{Ref: "refs/heads/" + req.Branch, SHA: sha})
		return resp, err
	})
	if isStatus(err, http.StatusUnprocessableEntity) {
		return CommitResult{}, brokererr.Wrap(err, brokererr.Conflict, "branch %s changed on GitHub while committing; nothing was written to it, try again", req.Branch)
	}
	if err != nil {
		return CommitResult{}, m.apiError(rs, "update ref", err)
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
	err = m.read(ctx, func(ctx context.Context) (*gh.Response, error) {
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
		err := m.read(ctx, func(ctx context.Context) (*gh.Response, error) {
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
	err := m.write(ctx, func(ctx context.Context) (*gh.Response, error) {
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
	err = m.read(ctx, func(ctx context.Context) (*gh.Response, error) {
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
func (m *Manager) read(ctx context.Context, call func(context.Context) (*gh.Response, error)) error {
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
		err = m.write(ctx, call)
		if !retryable(ctx, err) {
			return err
		}
	}
	return err
}

// write runs one GitHub call with a timeout; writes are never retried.
func (m *Manager) write(ctx context.Context, call func(context.Context) (*gh.Response, error)) error {
	cctx, cancel := context.WithTimeout(ctx, m.timeout)
	defer cancel()
	resp, err := call(cctx)
	if resp != nil && resp.Body != nil {
		_ = resp.Body.Close()
	}
	return err
}

func retryable(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil {
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
	m.log.Warn().Str("repo_id", rs.cfg.RepoID).Str("op", op).Int("status", status).Msg("github_request_failed")
	var rle *gh.RateLimitError
	var abuse *gh.AbuseRateLimitError
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		return brokererr.Wrap(err, brokererr.Unavailable, "GitHub did not answer in time (%s)", op)
	case errors.As(err, &rle):
		return rateLimited(err, rs, time.Until(rle.Rate.Reset.Time))
	case errors.As(err, &abuse):
		return rateLimited(err, rs, abuse.GetRetryAfter())
	}
	if er != nil && er.Response != nil {
		h := er.Response.Header
		if status == http.StatusTooManyRequests || status == http.StatusForbidden {
			if d, ok := retryAfter(h); ok {
				return rateLimited(err, rs, d)
			}
			if status == http.StatusTooManyRequests {
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

func rateLimited(err error, rs *repoState, d time.Duration) error {
	if d <= 0 {
		d = defaultRetry
	}
	if d < time.Second {
		d = time.Second
	}
	if d > time.Hour {
		d = time.Hour
	}
	return brokererr.Wrap(err, brokererr.RateLimitExceeded, "GitHub rate limit reached for %s", rs.cfg.RepoID).WithRetryAfter(d)
}

// retryAfter reads Retry-After (seconds), or X-RateLimit-Reset (epoch
// seconds) when X-RateLimit-Remaining is 0.
func retryAfter(h http.Header) (time.Duration, bool) {
	if v := h.Get("Retry-After"); v != "" {
		var s int64
		if _, err := fmt.Sscanf(v, "%d", &s); err == nil && s >= 0 {
			return time.Duration(s) * time.Second, true
		}
	}
	if h.Get("X-RateLimit-Remaining") == "0" {
		var reset int64
		if _, err := fmt.Sscanf(h.Get("X-RateLimit-Reset"), "%d", &reset); err == nil {
			return time.Until(time.Unix(reset, 0)), true
		}
		return 0, true
	}
	return 0, false
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
