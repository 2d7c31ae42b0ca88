package broker

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// loadGitHubRepos reads the allow-list and its tokens (from the env
// variables it names, never from the file). Classic tokens are refused here,
// at start. It returns the tokens so the redactor knows them.
func loadGitHubRepos(cfg config.Config) ([]github.Repo, []string, error) {
	if cfg.GitHubReposFile == "" {
		return nil, nil, nil
	}
	repos, err := github.LoadRepos(cfg.GitHubReposFile, os.LookupEnv)
	if err != nil {
		return nil, nil, fmt.Errorf("GITHUB_REPOS_FILE: %w", err)
	}
	return repos, github.Tokens(repos), nil
}

const githubRecheckEvery = 5 * time.Minute

// openGitHub starts the manager; its push checks feed /readyz.
func (b *Broker) openGitHub(ctx context.Context, cfg config.Config, repos []github.Repo) error {
	if len(repos) == 0 {
		return nil
	}
	m, err := github.New(ctx, github.Options{APIURL: cfg.GitHubAPIURL, Repos: repos, Log: logging.Component(b.log, "github"),
		HTTP: &http.Client{Transport: b.pm.instrument("github", nil)}})
	if err != nil {
		return fmt.Errorf("github: %w", err)
	}
	b.github = m
	// A repo that failed its start-up check is checked again now and then,
	// so /readyz recovers once the token or the API is fixed; a token near
	// its expiry is warned about even while idle.
	b.lead(githubRecheckEvery, func(ctx context.Context) {
		m.WarnExpiring(time.Now())
		for id, st := range m.Status() {
			if st != "ok" {
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				_ = m.CheckAccess(cctx, id)
				cancel()
			}
		}
	})
	b.checks = append(b.checks, check{"github", func(context.Context) error {
		var bad []string
		for id, st := range m.Status() {
			if st != "ok" {
				bad = append(bad, id+": "+st)
			}
		}
		for id, exp := range m.TokenExpiries() {
			if !time.Now().Before(exp) {
				bad = append(bad, id+": token expired")
			}
		}
		if len(bad) > 0 {
			return fmt.Errorf("%s", strings.Join(bad, "; "))
		}
		return nil
	}})
	return nil
}

// githubDetails are /readyz details: when the first GitHub token expires,
// and a warning from github.ExpiryWarning before. No repo is named (the
// log does that): /readyz needs no token.
func (b *Broker) githubDetails() map[string]string {
	if b.github == nil {
		return nil
	}
	var first time.Time
	for _, exp := range b.github.TokenExpiries() {
		if first.IsZero() || exp.Before(first) {
			first = exp
		}
	}
	if first.IsZero() {
		return nil
	}
	d := map[string]string{"github_token_expires_at": first.UTC().Format(time.RFC3339)}
	switch left := time.Until(first); {
	case left <= 0:
		d["github_token_warning"] = "a GitHub token has expired; replace it"
	case left <= github.ExpiryWarning:
		d["github_token_warning"] = fmt.Sprintf("a GitHub token expires in %d hours; replace it before then", int(left/time.Hour))
	}
	return d
}

// githubDeps returns the GitHub tools' dependencies (nil interfaces when
// no allow-list is configured; the tools are then not listed).
func (b *Broker) githubDeps() (tools.GitHubCommitter, tools.SessionFiles) {
	var sf tools.SessionFiles
	if b.sandboxes != nil {
		sf = sessionFiles{b}
	}
	if b.github == nil {
		return nil, sf
	}
	return b.github, sf
}

// sessionFiles reads files a sandbox session produced, for
// commit_session_files: the caller must own the session, and reads go
// through the session's os.Root-confined file access.
type sessionFiles struct{ b *Broker }

func (s sessionFiles) ReadSessionFile(ctx context.Context, principal, sessionID, path string, max int64) ([]byte, error) {
	lease, err := s.b.sandboxes.Acquire(ctx, principal, sessionID, false)
	if err != nil {
		return nil, err
	}
	defer lease.Release()
	f, err := lease.Session.ReadFile(ctx, path, 0, max)
	if err != nil {
		return nil, err
	}
	if f.Size > max {
		return nil, brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", path, max)
	}
	return f.Data, nil
}
