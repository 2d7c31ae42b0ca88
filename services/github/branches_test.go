package github_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

// setupWith is setup with another allow-list and tokens, and prep run on
// the fake (one repo, acme/widgets, granted to token with push) before
// the manager starts.
func setupWith(t *testing.T, list string, env map[string]string, prep func(*ghfake.Fake)) env_ {
	t.Helper()
	f := ghfake.New()
	t.Cleanup(f.Close)
	f.AddRepo(owner, name)
	f.Grant(token, owner, name, true)
	if prep != nil {
		prep(f)
	}
	repos, err := github.ParseRepos([]byte(list))
	if err != nil {
		t.Fatal(err)
	}
	if err := github.ResolveTokens(repos, lookup(env)); err != nil {
		t.Fatal(err)
	}
	logs := &syncBuffer{}
	m, err := github.New(context.Background(), github.Options{APIURL: f.URL(), Repos: repos, Timeout: 5 * time.Second, Log: zerolog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	f.ResetRequests()
	return env_{fake: f, m: m, logs: logs}
}

// A tag named like the branch must not be read instead of it: git, and so
// GitHub, resolves a bare name to refs/tags/<name> before refs/heads/<name>.
func TestReadFileReadsTheBranchNotASameNamedTag(t *testing.T) {
	e := setup(t, true)
	e.fake.PushCommit(owner, name, branch, map[string]string{"a.txt": "from the branch"}, "branch")
	e.fake.AddTag(owner, name, branch, map[string]string{"a.txt": "from the tag"})
	e.fake.ResetRequests()
	b, _, _, err := e.m.ReadFile(context.Background(), repoID, "a.txt", branch)
	if err != nil || string(b) != "from the branch" {
		t.Fatalf("read %q, %v", b, err)
	}
	reqs := e.fake.Requests()
	if len(reqs) != 1 {
		t.Fatalf("requests: %v", calls(reqs))
	}
	if q, _ := url.ParseQuery(reqs[0].Query); q.Get("ref") != "refs/heads/"+branch {
		t.Fatalf("ref = %q", q.Get("ref"))
	}
	// The base branch, too.
	e.fake.AddTag(owner, name, "main", map[string]string{"README.md": "tagged"})
	if b, _, _, err := e.m.ReadFile(context.Background(), repoID, "README.md", ""); err != nil || string(b) != "# widgets\n" {
		t.Fatalf("read main %q, %v", b, err)
	}
}

// A "*" glob matches the repository's default branch; when that is not
// base_branch, nothing else would stop a write to it.
func TestDefaultBranchIsNeverWritten(t *testing.T) {
	const list = `[{"repo_id":"widgets","owner":"acme","name":"widgets","allowed_branches":["*"],"base_branch":"main","token_env":"WIDGETS_TOKEN"}]`
	e := setupWith(t, list, map[string]string{env: token}, func(f *ghfake.Fake) { f.SetDefaultBranch(owner, name, "trunk") })
	trunk, _ := e.fake.Head(owner, name, "trunk")
	for _, b := range []string{"trunk", "Trunk", "main"} {
		_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: b,
			Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
		wantCode(t, err, brokererr.InvalidBranch)
	}
	for _, r := range e.fake.Requests() {
		if r.Method != "GET" {
			t.Fatalf("a write reached GitHub: %s %s", r.Method, r.Path)
		}
	}
	if h, _ := e.fake.Head(owner, name, "trunk"); h != trunk {
		t.Fatal("the default branch moved")
	}
	// Other branches the glob allows still work.
	if _, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: "feature",
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"}); err != nil {
		t.Fatal(err)
	}
}
