package github

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"time"

	gh "github.com/google/go-github/v92/github"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
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

// CommitResult says where the commit went. PRError is set when the commit
// stands but the pull request asked for could not be opened: the work done
// is reported as done, with why the PR is missing.
type CommitResult struct {
	CommitSHA string
	Branch    string
	PRURL     string
	PRError   *brokererr.Error
}

// Manager talks to GitHub for the allow-listed repos only, one client and
// token per repo. Repos that share a token share its tokenState.
type Manager struct {
	log     zerolog.Logger
	timeout time.Duration
	repos   map[string]*repoState
	ids     []string
}

type repoState struct {
	cfg    Repo
	client *gh.Client
	tok    *tokenState

	mu      sync.Mutex
	canPush bool
	// writeChecked is set once push access was checked on the way to a
	// write, not only at start-up: the start-up check can be hours old.
	writeChecked bool
	status       string
	// defaultBranch is the repository's default branch as of the last
	// access check; it is never written, whatever the globs allow.
	defaultBranch string
}

// tokenState is what the repos sharing one token share. GitHub limits a
// token's user, not a repository, and asks for that user's requests to be
// made serially ("avoid concurrent requests", REST API best practices).
type tokenState struct {
	// write serialises this process's commits with the token, so its
	// mutating requests are never concurrent and two commits to one repo
	// do not race each other into a non-fast-forward. A channel, so
	// waiting for it honours the caller's context.
	write chan struct{}

	mu sync.Mutex
	// limitedUntil closes the gate after a rate limit (see rateLimited).
	limitedUntil time.Time
	// expires is when GitHub says the token expires (zero: not said).
	expires time.Time
	// warnedFor and warnedLevel are the expiry last warned about and how
	// (1 expiring, 2 expired), so WarnExpiring logs each once.
	warnedFor   time.Time
	warnedLevel int
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
	tokens := map[string]*tokenState{}
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
		tok := tokens[r.token]
		if tok == nil {
			tok = &tokenState{write: make(chan struct{}, 1)}
			tokens[r.token] = tok
		}
		m.repos[r.RepoID] = &repoState{cfg: r, client: client, tok: tok, status: "not checked"}
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
