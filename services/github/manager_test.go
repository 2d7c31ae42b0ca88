package github_test

import (
	"bytes"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

const (
	owner  = "acme"
	name   = "widgets"
	repoID = "widgets"
	env    = "WIDGETS_TOKEN"
	branch = "sandbox/feature"
)

// Token-shaped values, assembled so that no scanner flags this file.
var (
	token   = "github_" + "pat_" + "11AAAAAAA0" + strings.Repeat("b7Xq", 18)
	classic = "gh" + "p_" + strings.Repeat("Z9y8", 9)
)

const allowList = `[{"repo_id":"widgets","owner":"acme","name":"widgets","allowed_branches":["sandbox/*","agent-*"],"base_branch":"main","token_env":"WIDGETS_TOKEN"}]`

func lookup(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

type env_ struct {
	fake *ghfake.Fake
	m    *github.Manager
	logs *syncBuffer
}

// setup starts a fake with one repo and a manager for it; the manager's
// start-up access check is already done and forgotten from the record.
func setup(t *testing.T, push bool) env_ {
	t.Helper()
	return setupWith(t, allowList, map[string]string{env: token}, func(f *ghfake.Fake) { f.Grant(token, owner, name, push) })
}

func gitBlobSHA(b []byte) string {
	h := sha1.New()
	fmt.Fprintf(h, "blob %d\x00", len(b))
	h.Write(b)
	return hex.EncodeToString(h.Sum(nil))
}

func calls(reqs []ghfake.Request) []string {
	var out []string
	for _, r := range reqs {
		out = append(out, fmt.Sprintf("%s %s %d", r.Method, r.Path, r.Status))
	}
	return out
}

func count(reqs []ghfake.Request, method, pathSuffix string) int {
	n := 0
	for _, r := range reqs {
		if r.Method == method && strings.HasSuffix(r.Path, pathSuffix) {
			n++
		}
	}
	return n
}

func wantCode(t *testing.T, err error, code brokererr.Code) *brokererr.Error {
	t.Helper()
	e := brokererr.As(err)
	if e == nil || e.Code != code {
		t.Fatalf("error = %v, want code %s", err, code)
	}
	return e
}

func TestCommitThreeFilesIsOneCommitAndOnePR(t *testing.T) {
	e := setup(t, true)
	mainHead, _ := e.fake.Head(owner, name, "main")
	mainCommit, _ := e.fake.CommitByRef(owner, name, mainHead)
	files := map[string][]byte{
		"src/app.py":    []byte("print('hi')\n"),
		"README.md":     []byte("# widgets, updated\n"),
		"data/blob.bin": {0, 1, 2, 255, 254},
	}
	res, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch, Files: files,
		Message: "Add app\n\nThree files.", CreatePR: true})
	if err != nil {
		t.Fatal(err)
	}
	reqs := e.fake.Requests()
	base := "/repos/acme/widgets"
	want := []string{
		"GET " + base + " 200", // push access, checked again before the first write
		"GET " + base + "/git/ref/heads/sandbox/feature 404",
		"GET " + base + "/git/ref/heads/main 200",
		"GET " + base + "/git/commits/" + mainHead + " 200",
		"POST " + base + "/git/blobs 201", // the binary file; text goes inline in the tree
		"POST " + base + "/git/trees 201",
		"POST " + base + "/git/commits 201",
		"POST " + base + "/git/refs 201",
		"GET " + base + "/pulls 200",
		"POST " + base + "/pulls 201",
	}
	if got := calls(reqs); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("requests:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// The tree is built on the base tree and names exactly our files: text
	// inline, the binary file by its blob.
	var tree struct {
		BaseTree string `json:"base_tree"`
		Tree     []struct {
			Path, Mode, Type, SHA string
			Content               *string
		}
	}
	for _, r := range reqs {
		if r.Method == "POST" && strings.HasSuffix(r.Path, "/git/trees") {
			if err := json.Unmarshal(r.Body, &tree); err != nil {
				t.Fatal(err)
			}
		}
	}
	if tree.BaseTree != mainCommit.Tree {
		t.Errorf("base_tree = %s, want main's tree %s", tree.BaseTree, mainCommit.Tree)
	}
	var paths []string
	for _, en := range tree.Tree {
		paths = append(paths, en.Path)
		inline := en.Path != "data/blob.bin"
		if en.Mode != "100644" || en.Type != "blob" || inline != (en.Content != nil) ||
			inline && (en.SHA != "" || *en.Content != string(files[en.Path])) || !inline && en.SHA != gitBlobSHA(files[en.Path]) {
			t.Errorf("tree entry %+v", en)
		}
	}
	sort.Strings(paths)
	if strings.Join(paths, ",") != "README.md,data/blob.bin,src/app.py" {
		t.Errorf("tree paths %v", paths)
	}

	// One commit on the branch, with main's head as its only parent.
	head, ok := e.fake.Head(owner, name, branch)
	if !ok || head != res.CommitSHA || res.Branch != branch {
		t.Fatalf("branch head %s (%v), result %+v", head, ok, res)
	}
	c, _ := e.fake.CommitByRef(owner, name, head)
	if len(c.Parents) != 1 || c.Parents[0] != mainHead || c.Message != "Add app\n\nThree files." {
		t.Errorf("commit %+v, want parent %s", c, mainHead)
	}
	if n := e.fake.CommitCount(owner, name, branch); n != 2 {
		t.Errorf("branch has %d commits, want 2", n)
	}
	got, _ := e.fake.Files(owner, name, branch)
	if len(got) != len(files) {
		t.Errorf("branch tree has %d files, want %d: %v", len(got), len(files), got)
	}
	for p, b := range files {
		if !bytes.Equal(got[p], b) {
			t.Errorf("%s = %q, want %q", p, got[p], b)
		}
	}
	if h, _ := e.fake.Head(owner, name, "main"); h != mainHead {
		t.Error("main moved")
	}

	prs := e.fake.PullRequests(owner, name)
	if len(prs) != 1 || prs[0].Head != branch || prs[0].Base != "main" || prs[0].Title != "Add app" || prs[0].HTMLURL != res.PRURL {
		t.Fatalf("PRs %+v, result %+v", prs, res)
	}
}

func TestCommitOnExistingBranchBuildsOnItsHead(t *testing.T) {
	e := setup(t, true)
	prev := e.fake.PushCommit(owner, name, branch, map[string]string{"keep.txt": "kept"}, "earlier work")
	e.fake.ResetRequests()
	res, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"new.txt": []byte("new")}, Message: "more", CreatePR: true, PRTitle: "My PR"})
	if err != nil {
		t.Fatal(err)
	}
	reqs := e.fake.Requests()
	if count(reqs, "PATCH", "/git/refs/heads/sandbox/feature") != 1 || count(reqs, "POST", "/git/refs") != 0 {
		t.Fatalf("ref calls: %v", calls(reqs))
	}
	var patch struct {
		SHA   string `json:"sha"`
		Force *bool  `json:"force"`
	}
	for _, r := range reqs {
		if r.Method == "PATCH" {
			_ = json.Unmarshal(r.Body, &patch)
		}
	}
	if patch.SHA != res.CommitSHA || patch.Force == nil || *patch.Force {
		t.Errorf("PATCH body %+v: want sha %s and force false", patch, res.CommitSHA)
	}
	c, _ := e.fake.CommitByRef(owner, name, branch)
	if len(c.Parents) != 1 || c.Parents[0] != prev {
		t.Errorf("parents %v, want [%s]", c.Parents, prev)
	}
	files, _ := e.fake.Files(owner, name, branch)
	if string(files["keep.txt"]) != "kept" || string(files["new.txt"]) != "new" || len(files) != 3 {
		t.Errorf("files %v", files)
	}
	if n := e.fake.CommitCount(owner, name, branch); n != 3 {
		t.Errorf("commits on branch = %d, want 3", n)
	}

	// A second commit with create_pr finds the open PR instead of a second one.
	res2, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"new.txt": []byte("newer")}, Message: "again", CreatePR: true})
	if err != nil {
		t.Fatal(err)
	}
	prs := e.fake.PullRequests(owner, name)
	if len(prs) != 1 || res2.PRURL != res.PRURL || prs[0].Title != "My PR" {
		t.Fatalf("PRs %+v; urls %s %s", prs, res.PRURL, res2.PRURL)
	}
	if n := e.fake.CommitCount(owner, name, branch); n != 4 {
		t.Errorf("commits on branch = %d, want 4", n)
	}
}

func TestRefusedWithoutAnyRequest(t *testing.T) {
	e := setup(t, true)
	ok := map[string][]byte{"a.txt": []byte("a")}
	many := map[string][]byte{}
	for i := 0; i <= github.MaxFiles; i++ {
		many[fmt.Sprintf("f%d.txt", i)] = []byte("x")
	}
	cases := []struct {
		name string
		req  github.CommitRequest
		code brokererr.Code
	}{
		{"repo not allow-listed", github.CommitRequest{RepoID: "other", Branch: branch, Files: ok, Message: "m"}, brokererr.InvalidRepo},
		{"owner/../other as repo", github.CommitRequest{RepoID: "acme/../other", Branch: branch, Files: ok, Message: "m"}, brokererr.InvalidRepo},
		{"branch outside globs", github.CommitRequest{RepoID: repoID, Branch: "feature/x", Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"base branch", github.CommitRequest{RepoID: repoID, Branch: "main", Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"base branch by case", github.CommitRequest{RepoID: repoID, Branch: "MAIN", Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"dotdot branch", github.CommitRequest{RepoID: repoID, Branch: "sandbox/../main", Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"refs/ branch", github.CommitRequest{RepoID: repoID, Branch: "refs/heads/sandbox/x", Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"lock branch", github.CommitRequest{RepoID: repoID, Branch: "sandbox/x.lock", Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"double slash", github.CommitRequest{RepoID: repoID, Branch: "sandbox//x", Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"too long", github.CommitRequest{RepoID: repoID, Branch: "sandbox/" + strings.Repeat("x", 200), Files: ok, Message: "m"}, brokererr.InvalidBranch},
		{"traversal path", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{"../etc/passwd": nil}, Message: "m"}, brokererr.PathTraversal},
		{"absolute path", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{"/etc/passwd": nil}, Message: "m"}, brokererr.PathTraversal},
		{".git/config", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{".git/config": nil}, Message: "m"}, brokererr.PathTraversal},
		{".env", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{".env": nil}, Message: "m"}, brokererr.PathTraversal},
		{"node_modules", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{"node_modules/x": nil}, Message: "m"}, brokererr.PathTraversal},
		{"nested .env.local", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{"app/.env.local": nil}, Message: "m"}, brokererr.PathTraversal},
		{"workflow", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{".github/workflows/x.yml": nil}, Message: "m"}, brokererr.PathTraversal},
		{"too many files", github.CommitRequest{RepoID: repoID, Branch: branch, Files: many, Message: "m"}, brokererr.InvalidInput},
		{"no files", github.CommitRequest{RepoID: repoID, Branch: branch, Files: nil, Message: "m"}, brokererr.InvalidInput},
		{"file too big", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{"big": make([]byte, github.MaxFileBytes+1)}, Message: "m"}, brokererr.FileSizeExceeded},
		{"case collision", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{"A.txt": nil, "a.txt": nil}, Message: "m"}, brokererr.InvalidInput},
		{"file and dir", github.CommitRequest{RepoID: repoID, Branch: branch, Files: map[string][]byte{"a": nil, "a/b": nil}, Message: "m"}, brokererr.InvalidInput},
		{"empty message", github.CommitRequest{RepoID: repoID, Branch: branch, Files: ok, Message: "  "}, brokererr.InvalidInput},
		{"long message", github.CommitRequest{RepoID: repoID, Branch: branch, Files: ok, Message: strings.Repeat("m", 201)}, brokererr.InvalidInput},
		{"escape in message", github.CommitRequest{RepoID: repoID, Branch: branch, Files: ok, Message: "a\x1b[2Jb"}, brokererr.InvalidInput},
		{"title without PR", github.CommitRequest{RepoID: repoID, Branch: branch, Files: ok, Message: "m", PRTitle: "t"}, brokererr.InvalidInput},
		{"multi-line title", github.CommitRequest{RepoID: repoID, Branch: branch, Files: ok, Message: "m", CreatePR: true, PRTitle: "a\nb"}, brokererr.InvalidInput},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e.fake.ResetRequests()
			_, err := e.m.Commit(context.Background(), c.req)
			wantCode(t, err, c.code)
			if reqs := e.fake.Requests(); len(reqs) != 0 {
				t.Fatalf("%d requests reached GitHub: %v", len(reqs), calls(reqs))
			}
		})
	}
	reads := []struct {
		name, repo, path, branch string
		code                     brokererr.Code
	}{
		{"repo", "other", "README.md", "", brokererr.InvalidRepo},
		{"path", repoID, "../x", "", brokererr.PathTraversal},
		{"forbidden path", repoID, ".env", "", brokererr.PathTraversal},
		{"branch", repoID, "README.md", "feature/x", brokererr.InvalidBranch},
		{"bad branch", repoID, "README.md", "sandbox/..", brokererr.InvalidBranch},
	}
	for _, c := range reads {
		t.Run("read "+c.name, func(t *testing.T) {
			e.fake.ResetRequests()
			_, _, _, err := e.m.ReadFile(context.Background(), c.repo, c.path, c.branch)
			wantCode(t, err, c.code)
			if reqs := e.fake.Requests(); len(reqs) != 0 {
				t.Fatalf("%d requests reached GitHub: %v", len(reqs), calls(reqs))
			}
		})
	}
}

func TestClassicAndUnknownTokensRefusedAtStart(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo(owner, name)
	for _, tok := range []string{classic, "gh" + "o_" + strings.Repeat("Q", 36), "gh" + "s_" + strings.Repeat("Q", 36),
		strings.Repeat("ab12", 10), "github_" + "pat_short", ""} {
		repos, err := github.ParseRepos([]byte(allowList))
		if err != nil {
			t.Fatal(err)
		}
		err = github.ResolveTokens(repos, lookup(map[string]string{env: tok}))
		if err == nil {
			t.Fatalf("token shape %.6s… accepted", tok)
		}
		msg := err.Error()
		if !strings.Contains(msg, repoID) || !strings.Contains(msg, env) || (tok != "" && strings.Contains(msg, tok)) {
			t.Errorf("message %q must name %s and %s and not the token", msg, repoID, env)
		}
		// Unresolved repos cannot make a manager either.
		if _, err := github.New(context.Background(), github.Options{APIURL: f.URL(), Repos: repos}); err == nil {
			t.Error("New accepted a repo without a fine-grained token")
		}
	}
	if n := len(f.Requests()); n != 0 {
		t.Fatalf("%d requests reached GitHub", n)
	}
}

func TestRateLimitsBecomeRetryAfter(t *testing.T) {
	cases := []struct {
		name     string
		kind     ghfake.LimitKind
		min, max time.Duration
	}{
		{"primary 403", ghfake.PrimaryLimit, ghfake.PrimaryReset - 5*time.Second, ghfake.PrimaryReset + time.Second},
		{"primary 429", ghfake.PrimaryLimit429, ghfake.PrimaryReset - 5*time.Second, ghfake.PrimaryReset + time.Second},
		{"secondary 403", ghfake.SecondaryLimit, ghfake.RetryAfter, ghfake.RetryAfter},
		{"secondary 429", ghfake.TooManyRequests, ghfake.RetryAfter, ghfake.RetryAfter},
		// No Retry-After: GitHub asks for at least a minute.
		{"secondary without Retry-After", ghfake.SecondaryNoRetryAfter, time.Minute, time.Minute},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := setup(t, true)
			e.fake.LimitNext(1, c.kind)
			_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
				Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
			be := wantCode(t, err, brokererr.RateLimitExceeded)
			if !be.Retryable || be.RetryAfter < c.min || be.RetryAfter > c.max {
				t.Errorf("retryable %v retry_after %v, want in [%v, %v]", be.Retryable, be.RetryAfter, c.min, c.max)
			}
			// The limited read is not retried and nothing was written.
			reqs := e.fake.Requests()
			if len(reqs) != 1 || reqs[0].Method != "GET" {
				t.Errorf("requests %v", calls(reqs))
			}
			if _, ok := e.fake.Head(owner, name, branch); ok {
				t.Error("branch was created")
			}
			// A rate limit is not a permission problem.
			if s := e.m.Status()[repoID]; s != "rate limited" {
				t.Errorf("status %q, want rate limited", s)
			}
			// Until the retry time, nothing more is sent to GitHub.
			e.fake.ResetRequests()
			_, _, _, err = e.m.ReadFile(context.Background(), repoID, "README.md", "")
			again := wantCode(t, err, brokererr.RateLimitExceeded)
			if again.RetryAfter <= 0 || again.RetryAfter > be.RetryAfter {
				t.Errorf("gate retry_after %v, first %v", again.RetryAfter, be.RetryAfter)
			}
			if reqs := e.fake.Requests(); len(reqs) != 0 {
				t.Errorf("requests while limited: %v", calls(reqs))
			}
		})
	}
	// Limited in the middle of a commit: after the blobs, at the tree.
	e := setup(t, true)
	var once sync.Once
	e.fake.OnRequest(func(method, path string) {
		if method == "POST" && strings.HasSuffix(path, "/git/trees") {
			once.Do(func() { e.fake.LimitNext(1, ghfake.SecondaryLimit) })
		}
	})
	_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
	if be := wantCode(t, err, brokererr.RateLimitExceeded); be.RetryAfter != ghfake.RetryAfter {
		t.Errorf("retry_after %v", be.RetryAfter)
	}
	if n := count(e.fake.Requests(), "POST", "/git/commits"); n != 0 {
		t.Errorf("commit created after a limited tree")
	}
	if _, ok := e.fake.Head(owner, name, branch); ok {
		t.Error("branch was created")
	}
}

func TestNoPushPermission(t *testing.T) {
	e := setup(t, false)
	if s := e.m.Status()[repoID]; s != "token cannot push" {
		t.Errorf("status %q", s)
	}
	wantCode(t, e.m.CheckAccess(context.Background(), repoID), brokererr.PermissionDenied)
	e.fake.ResetRequests()
	_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
	wantCode(t, err, brokererr.PermissionDenied)
	if got := calls(e.fake.Requests()); len(got) != 1 || got[0] != "GET /repos/acme/widgets 200" {
		t.Fatalf("requests %v: want only the access re-check", got)
	}
	// Once the operator grants push, the next write re-checks and succeeds.
	e.fake.Grant(token, owner, name, true)
	if _, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"}); err != nil {
		t.Fatal(err)
	}
	if s := e.m.Status()[repoID]; s != "ok" {
		t.Errorf("status %q", s)
	}
}

func TestArchivedRepoRefused(t *testing.T) {
	e := setup(t, true)
	e.fake.Archive(owner, name)
	wantCode(t, e.m.CheckAccess(context.Background(), repoID), brokererr.PermissionDenied)
	_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
	wantCode(t, err, brokererr.PermissionDenied)
	if s := e.m.Status()[repoID]; s != "repository is archived" {
		t.Errorf("status %q", s)
	}
}

func TestAccessCheckedBeforeFirstWriteAndAfterAuthFailure(t *testing.T) {
	e := setup(t, true)
	commit := func() error {
		_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
			Files: map[string][]byte{"a.txt": []byte(time.Now().String())}, Message: "m"})
		return err
	}
	checks := func() int { return count(e.fake.Requests(), "GET", "/repos/acme/widgets") }
	// Checked at start (setup) and again before the first write...
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	if n := checks(); n != 1 {
		t.Errorf("access checked %d times before the first write, want 1", n)
	}
	reqs := e.fake.Requests()
	if len(reqs) == 0 || reqs[0].Method != "GET" || reqs[0].Path != "/repos/acme/widgets" {
		t.Errorf("the check is not the first request: %v", calls(reqs))
	}
	// ...but not before every write.
	e.fake.ResetRequests()
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	if n := checks(); n != 0 {
		t.Errorf("access re-checked %d times on the second write", n)
	}
	e.fake.Revoke(token)
	wantCode(t, commit(), brokererr.GitHubAuthFailed)
	if s := e.m.Status()[repoID]; s != "token rejected" {
		t.Errorf("status %q", s)
	}
	e.fake.Grant(token, owner, name, true)
	e.fake.ResetRequests()
	if err := commit(); err != nil {
		t.Fatal(err)
	}
	if n := checks(); n != 1 {
		t.Errorf("access checked %d times after a 401, want 1", n)
	}
}

// A fine-grained token can lack contents:write while its owner's role can
// push: GET /repos then says push:true and only the write tells. The
// first refused write stops the commit, names the missing permission and
// marks the repo not ready.
func TestTokenWithoutContentsWrite(t *testing.T) {
	f := ghfake.New()
	t.Cleanup(f.Close)
	f.AddRepo(owner, name)
	f.GrantRole(token, owner, name, false, true)
	repos, _ := github.ParseRepos([]byte(allowList))
	if err := github.ResolveTokens(repos, lookup(map[string]string{env: token})); err != nil {
		t.Fatal(err)
	}
	m, err := github.New(context.Background(), github.Options{APIURL: f.URL(), Repos: repos})
	if err != nil {
		t.Fatal(err)
	}
	if s := m.Status()[repoID]; s != "ok" {
		t.Fatalf("status %q: the role can push, so the start-up check passes", s)
	}
	f.ResetRequests()
	_, err = m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a"), "b.txt": []byte("b")}, Message: "m"})
	be := wantCode(t, err, brokererr.PermissionDenied)
	if !strings.Contains(be.Message, "contents=write") {
		t.Errorf("message %q does not name the permission", be.Message)
	}
	reqs := f.Requests()
	if n := count(reqs, "POST", "/git/trees"); n != 1 {
		t.Errorf("%d tree posts, want 1 (stop at the first refusal)", n)
	}
	if count(reqs, "POST", "/git/blobs")+count(reqs, "POST", "/git/commits")+count(reqs, "POST", "/git/refs") != 0 {
		t.Errorf("requests after the refusal: %v", calls(reqs))
	}
	if s := m.Status()[repoID]; s != "token lacks permission" {
		t.Errorf("status %q", s)
	}
	if _, ok := f.Head(owner, name, branch); ok {
		t.Error("branch created")
	}
}

// Someone else pushes to the branch between our read of its head and our
// ref update: the non-force update fails, and the commit is rebuilt on
// their commit, keeping it.
func TestBranchMovedMidCommitIsRebuiltOnTheNewHead(t *testing.T) {
	e := setup(t, true)
	e.fake.PushCommit(owner, name, branch, map[string]string{"x": "1"}, "first")
	var other string
	var once sync.Once
	e.fake.OnRequest(func(method, path string) {
		if method == "PATCH" {
			once.Do(func() { other = e.fake.PushCommit(owner, name, branch, map[string]string{"x": "2"}, "someone else") })
		}
	})
	e.fake.ResetRequests()
	res, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a"), "b.bin": {0, 0xff}}, Message: "m"})
	if err != nil {
		t.Fatal(err)
	}
	reqs := e.fake.Requests()
	if n := count(reqs, "PATCH", "/git/refs/heads/sandbox/feature"); n != 2 {
		t.Errorf("%d ref updates, want 2: %v", n, calls(reqs))
	}
	if n := count(reqs, "POST", "/git/blobs"); n != 1 {
		t.Errorf("blobs posted %d times; the retry must reuse them", n)
	}
	if n := count(reqs, "POST", "/git/trees"); n != 2 {
		t.Errorf("%d trees, want 2 (one per attempt)", n)
	}
	for _, r := range reqs {
		if r.Method == "PATCH" && strings.Contains(string(r.Body), `"force":true`) {
			t.Fatalf("forced update: %s", r.Body)
		}
	}
	c, _ := e.fake.CommitByRef(owner, name, branch)
	if c.SHA != res.CommitSHA || len(c.Parents) != 1 || c.Parents[0] != other {
		t.Fatalf("head %+v, want our commit on top of %s", c, other)
	}
	files, _ := e.fake.Files(owner, name, branch)
	if string(files["x"]) != "2" || string(files["a.txt"]) != "a" {
		t.Errorf("files %v: the other push or ours was lost", files)
	}
}

// The branch did not exist when read, and was created by someone else
// before ours: "Reference already exists" is a race like any other.
func TestBranchCreatedMidCommitIsRebuiltOnIt(t *testing.T) {
	e := setup(t, true)
	var other string
	var once sync.Once
	e.fake.OnRequest(func(method, path string) {
		if method == "POST" && strings.HasSuffix(path, "/git/refs") {
			once.Do(func() {
				other = e.fake.PushCommit(owner, name, branch, map[string]string{"y": "theirs"}, "someone else")
			})
		}
	})
	res, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
	if err != nil {
		t.Fatal(err)
	}
	c, _ := e.fake.CommitByRef(owner, name, branch)
	if c.SHA != res.CommitSHA || len(c.Parents) != 1 || c.Parents[0] != other {
		t.Fatalf("head %+v, want our commit on top of %s", c, other)
	}
	reqs := e.fake.Requests()
	if count(reqs, "POST", "/git/refs") != 1 || count(reqs, "PATCH", "/git/refs/heads/sandbox/feature") != 1 {
		t.Errorf("ref calls %v", calls(reqs))
	}
}

// A branch that moves on every attempt ends in CONFLICT after a bounded
// number of attempts, with every other push kept.
func TestBranchThatKeepsMovingIsConflict(t *testing.T) {
	e := setup(t, true)
	e.fake.PushCommit(owner, name, branch, map[string]string{"x": "0"}, "first")
	var mu sync.Mutex
	var others []string
	e.fake.OnRequest(func(method, path string) {
		if method == "PATCH" {
			mu.Lock()
			defer mu.Unlock()
			others = append(others, e.fake.PushCommit(owner, name, branch, map[string]string{"x": fmt.Sprint(len(others) + 1)}, "someone else"))
		}
	})
	e.fake.ResetRequests()
	_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
	wantCode(t, err, brokererr.Conflict)
	mu.Lock()
	defer mu.Unlock()
	if len(others) != 3 {
		t.Errorf("%d attempts, want 3", len(others))
	}
	if h, _ := e.fake.Head(owner, name, branch); h != others[len(others)-1] {
		t.Errorf("branch head %s, want the last other push", h)
	}
	if n := e.fake.CommitCount(owner, name, branch); n != 2+len(others) {
		t.Errorf("%d commits on the branch, want %d: a push was lost", n, 2+len(others))
	}
}

func TestReadFile(t *testing.T) {
	e := setup(t, true)
	b, size, sha, err := e.m.ReadFile(context.Background(), repoID, "README.md", "")
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != "# widgets\n" || size != len(b) || sha != gitBlobSHA(b) {
		t.Errorf("read %q size %d sha %s", b, size, sha)
	}
	big := strings.Repeat("x", 70<<10) // several base64 lines
	e.fake.PushCommit(owner, name, branch, map[string]string{"dir/big.txt": big, "dir/huge.txt": strings.Repeat("y", github.MaxReadBytes+1)}, "w")
	b, _, _, err = e.m.ReadFile(context.Background(), repoID, "dir/big.txt", branch)
	if err != nil || string(b) != big {
		t.Fatalf("read big: %d bytes, %v", len(b), err)
	}
	_, _, _, err = e.m.ReadFile(context.Background(), repoID, "dir/huge.txt", branch)
	wantCode(t, err, brokererr.FileSizeExceeded)
	_, _, _, err = e.m.ReadFile(context.Background(), repoID, "dir", branch)
	wantCode(t, err, brokererr.InvalidInput)
	_, _, _, err = e.m.ReadFile(context.Background(), repoID, "nope.txt", "")
	wantCode(t, err, brokererr.FileNotFound)

	// Reads are retried on 5xx, a bounded number of times.
	e.fake.ResetRequests()
	e.fake.FailNext(1, http.StatusBadGateway)
	if _, _, _, err := e.m.ReadFile(context.Background(), repoID, "README.md", ""); err != nil {
		t.Fatalf("read after one 502: %v", err)
	}
	if n := len(e.fake.Requests()); n != 2 {
		t.Errorf("%d requests, want 2", n)
	}
	e.fake.ResetRequests()
	e.fake.FailNext(5, http.StatusBadGateway)
	_, _, _, err = e.m.ReadFile(context.Background(), repoID, "README.md", "")
	wantCode(t, err, brokererr.Unavailable)
	if n := len(e.fake.Requests()); n != 3 {
		t.Errorf("%d attempts, want 3", n)
	}
}

func TestWritesAreNotRetried(t *testing.T) {
	e := setup(t, true)
	var once sync.Once
	e.fake.OnRequest(func(method, path string) {
		if method == "POST" && strings.HasSuffix(path, "/git/trees") {
			once.Do(func() { e.fake.FailNext(1, http.StatusBadGateway) })
		}
	})
	_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
		Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
	wantCode(t, err, brokererr.Unavailable)
	reqs := e.fake.Requests()
	if n := count(reqs, "POST", "/git/trees"); n != 1 {
		t.Errorf("tree posted %d times", n)
	}
	if n := count(reqs, "POST", "/git/commits"); n != 0 {
		t.Errorf("commit created after a failed tree")
	}
}

func TestTimeoutOnHungGitHub(t *testing.T) {
	f := ghfake.New()
	release := make(chan struct{})
	defer f.Close()
	defer close(release)
	f.AddRepo(owner, name)
	f.Grant(token, owner, name, true)
	repos, _ := github.ParseRepos([]byte(allowList))
	if err := github.ResolveTokens(repos, lookup(map[string]string{env: token})); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	n := 0
	f.OnRequest(func(string, string) {
		mu.Lock()
		n++
		mu.Unlock()
		<-release
	})
	start := time.Now()
	m, err := github.New(context.Background(), github.Options{APIURL: f.URL(), Repos: repos, Timeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if s := m.Status()[repoID]; s != "GitHub unreachable" {
		t.Errorf("status %q", s)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("start-up check took %v", d)
	}
	mu.Lock()
	defer mu.Unlock()
	if n != 3 {
		t.Errorf("%d attempts, want 3", n)
	}
}

func TestTokenNeverInErrorsOrLogs(t *testing.T) {
	e := setup(t, true)
	var errs []error
	ctx := context.Background()
	commit := func() {
		_, err := e.m.Commit(ctx, github.CommitRequest{RepoID: repoID, Branch: branch,
			Files: map[string][]byte{"a.txt": []byte(time.Now().String())}, Message: "m", CreatePR: true})
		errs = append(errs, err)
	}
	commit()
	e.fake.Revoke(token)
	commit()
	errs = append(errs, e.m.CheckAccess(ctx, repoID))
	e.fake.Grant(token, owner, name, false)
	commit()
	_, _, _, err := e.m.ReadFile(ctx, repoID, "missing.txt", "")
	errs = append(errs, err)
	// Last: go-github then refuses this client's calls until Retry-After.
	e.fake.Grant(token, owner, name, true)
	e.fake.LimitNext(1, ghfake.TooManyRequests)
	commit()
	failures := 0
	for _, err := range errs {
		if err == nil {
			continue
		}
		failures++
		var chain []string
		for u := err; u != nil; {
			chain = append(chain, u.Error())
			w, ok := u.(interface{ Unwrap() error })
			if !ok {
				break
			}
			u = w.Unwrap()
		}
		if s := strings.Join(chain, " | "); strings.Contains(s, token) || strings.Contains(s, token[11:]) {
			t.Fatalf("token in error chain: %s", s)
		}
	}
	if failures < 5 {
		t.Fatalf("only %d failures; the test did not exercise the error paths", failures)
	}
	logs := e.logs.String()
	if !strings.Contains(logs, "github_request_failed") || !strings.Contains(logs, "github_commit") {
		t.Fatalf("logs lack the expected events:\n%s", logs)
	}
	if strings.Contains(logs, token[11:]) {
		t.Fatal("token in logs")
	}
	repos, _ := github.ParseRepos([]byte(allowList))
	_ = github.ResolveTokens(repos, lookup(map[string]string{env: token}))
	for _, s := range []string{fmt.Sprintf("%v %+v %#v %s", repos, repos, repos, repos)} {
		if strings.Contains(s, token[11:]) {
			t.Fatalf("token printed: %s", s)
		}
	}
	if toks := github.Tokens(repos); len(toks) != 1 || toks[0] != token {
		t.Fatal("Tokens does not expose the resolved token for the redactor")
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	repos, _ := github.ParseRepos([]byte(allowList))
	_ = github.ResolveTokens(repos, lookup(map[string]string{env: token}))
	for _, u := range []string{"ftp://x/", "https://user:pw@api.github.com/", "not a url", "https://api.github.com/?x=1"} {
		if _, err := github.New(context.Background(), github.Options{APIURL: u, Repos: repos}); err == nil {
			t.Errorf("APIURL %q accepted", u)
		}
	}
	if _, err := github.New(context.Background(), github.Options{}); err == nil {
		t.Error("no repos accepted")
	}
	if _, err := github.New(context.Background(), github.Options{APIURL: "http://127.0.0.1:1/", Repos: append(repos, repos[0])}); err == nil {
		t.Error("duplicate repo accepted")
	}
}

// A redirect off the API host would carry the token (go-github sets it on
// every request its transport sees); the manager must not follow it.
func TestRedirectOffAPIHostNotFollowed(t *testing.T) {
	var leaked atomic.Int64
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leaked.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	defer other.Close()
	var hops atomic.Int64
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hops.Add(1)
		http.Redirect(w, r, other.URL+r.URL.Path, http.StatusMovedPermanently)
	}))
	defer api.Close()
	repos, _ := github.ParseRepos([]byte(allowList))
	if err := github.ResolveTokens(repos, lookup(map[string]string{env: token})); err != nil {
		t.Fatal(err)
	}
	m, err := github.New(context.Background(), github.Options{APIURL: api.URL, Repos: repos})
	if err != nil {
		t.Fatal(err)
	}
	wantCode(t, m.CheckAccess(context.Background(), repoID), brokererr.Unavailable)
	if hops.Load() == 0 {
		t.Fatal("the API server was never asked")
	}
	if n := leaked.Load(); n != 0 {
		t.Fatalf("%d requests followed the redirect to another host", n)
	}
}

// Concurrent commits to one branch from this process all land, in some
// order, with no lost update.
func TestConcurrentCommitsAreSerialised(t *testing.T) {
	e := setup(t, true)
	const n = 4
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
				Files: map[string][]byte{fmt.Sprintf("f%d.txt", i): []byte("x")}, Message: fmt.Sprintf("c%d", i)})
			errs <- err
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	files, _ := e.fake.Files(owner, name, branch)
	if len(files) != n+1 || e.fake.CommitCount(owner, name, branch) != n+1 {
		t.Fatalf("branch has %d files and %d commits, want %d each", len(files), e.fake.CommitCount(owner, name, branch), n+1)
	}
}
