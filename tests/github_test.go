package tests

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

const fineGrainedPAT = "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456"

// githubBroker starts a broker whose allow-list holds acme/site (sandbox/*
// branches, base main) against a fake GitHub.
func githubBroker(t *testing.T, token string, extra map[string]string) (*Broker, *ghfake.Fake) {
	t.Helper()
	return githubBrokerWith(t, token, extra, nil)
}

// githubBrokerWith is githubBroker with prep run on the fake first.
func githubBrokerWith(t *testing.T, token string, extra map[string]string, prep func(*ghfake.Fake)) (*Broker, *ghfake.Fake) {
	t.Helper()
	env, fake := githubEnv(t, token, prep)
	for k, v := range extra {
		env[k] = v
	}
	return StartHTTP(t, BrokerOpts{Token: testToken, Env: env}), fake
}

// githubEnv is githubBroker's fake GitHub (prep, if set, run on it first)
// and broker environment.
func githubEnv(t *testing.T, token string, prep func(*ghfake.Fake)) (map[string]string, *ghfake.Fake) {
	t.Helper()
	fake := ghfake.New()
	t.Cleanup(fake.Close)
	fake.AddRepo("acme", "site")
	fake.Grant(fineGrainedPAT, "acme", "site", true)
	if prep != nil {
		prep(fake)
	}
	repos := []map[string]any{{"repo_id": "site", "owner": "acme", "name": "site", "allowed_branches": []string{"sandbox/*"},
		"base_branch": "main", "token_env": "SITE_GITHUB_TOKEN"}}
	raw, _ := json.Marshal(repos)
	file := filepath.Join(t.TempDir(), "repos.json")
	if err := os.WriteFile(file, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"GITHUB_REPOS_FILE": file, "GITHUB_API_URL": fake.URL(), "SITE_GITHUB_TOKEN": token, "SANDBOX_BACKEND": "none"}
	return env, fake
}

// A commit that lands when its pull request cannot be opened is reported
// as done, with pr_error saying why, and a
// retry with the same files only opens the PR (issue 9: a tool never
// reports failure for work it has already done).
func TestGitHubCommitStandsWhenThePullRequestFails(t *testing.T) {
	b, fake := githubBrokerWith(t, fineGrainedPAT, nil, func(f *ghfake.Fake) {
		var once sync.Once
		f.OnRequest(func(method, path string) {
			if method == "POST" && strings.HasSuffix(path, "/pulls") {
				once.Do(func() { f.FailNext(1, 422) })
			}
		})
	})
	c := b.Client(t, testToken)
	args := map[string]any{"repo_id": "site", "branch": "sandbox/pr-fails", "commit_message": "Add page", "create_pr": true,
		"files": map[string]string{"index.html": "<h1>hi</h1>"}}
	res := callTool(t, c, "commit_and_push_to_github", args)
	if res.IsError {
		t.Fatalf("a commit that landed was reported as failed: %+v", res.Content)
	}
	var out struct {
		Success   bool   `json:"success"`
		CommitSHA string `json:"commit_sha"`
		PRURL     string `json:"pr_url"`
		PRError   *struct {
			Error     string `json:"error"`
			Message   string `json:"message"`
			Retryable bool   `json:"retryable"`
		} `json:"pr_error"`
	}
	resultJSON(t, res, &out)
	head, ok := fake.Head("acme", "site", "sandbox/pr-fails")
	if !out.Success || !ok || out.CommitSHA != head || out.PRURL != "" || out.PRError == nil || out.PRError.Error == "" {
		t.Fatalf("result %+v, branch head %s", out, head)
	}
	if n := len(fake.PullRequests("acme", "site")); n != 0 {
		t.Fatalf("%d pull requests after the refusal", n)
	}
	// The retry opens the PR; the files are unchanged, so no new commit.
	res = callTool(t, c, "commit_and_push_to_github", args)
	out.PRError = nil
	resultJSON(t, res, &out)
	if res.IsError || out.PRURL == "" || out.PRError != nil {
		t.Fatalf("retry: %+v", out)
	}
	if prs := fake.PullRequests("acme", "site"); len(prs) != 1 || prs[0].Head != "sandbox/pr-fails" {
		t.Fatalf("PRs %+v", prs)
	}
}

func TestGitHubCommitThreeFilesOneCommitOnePR(t *testing.T) {
	b, fake := githubBroker(t, fineGrainedPAT, nil)
	c := b.Client(t, testToken)
	before := fake.CommitCount("acme", "site", "main")
	res := callTool(t, c, "commit_and_push_to_github", map[string]any{
		"repo_id": "site", "branch": "sandbox/landing", "commit_message": "Add landing page", "create_pr": true, "pr_title": "Landing page",
		"files": map[string]string{"index.html": "<h1>hi</h1>", "src/app.js": "console.log(1)", "README.md": "# site\n"},
	})
	if res.IsError {
		t.Fatalf("commit: %+v", res.Content)
	}
	var out struct {
		Success   bool   `json:"success"`
		CommitSHA string `json:"commit_sha"`
		Branch    string `json:"branch"`
		PRURL     string `json:"pr_url"`
	}
	resultJSON(t, res, &out)
	if !out.Success || out.Branch != "sandbox/landing" || len(out.CommitSHA) != 40 || out.PRURL == "" {
		t.Fatalf("result %+v", out)
	}
	if n := fake.CommitCount("acme", "site", "sandbox/landing"); n != before+1 {
		t.Fatalf("branch has %d commits, want %d (exactly one new)", n, before+1)
	}
	if fake.CommitCount("acme", "site", "main") != before {
		t.Fatal("main moved")
	}
	prs := fake.PullRequests("acme", "site")
	if len(prs) != 1 || prs[0].Head != "sandbox/landing" || prs[0].Base != "main" || prs[0].HTMLURL != out.PRURL {
		t.Fatalf("PRs %+v", prs)
	}
	files, _ := fake.Files("acme", "site", "sandbox/landing")
	if string(files["src/app.js"]) != "console.log(1)" || string(files["README.md"]) != "# site\n" {
		t.Fatalf("files %v", files)
	}
	var creates int
	for _, r := range fake.Requests() {
		if r.Method == "POST" && strings.HasSuffix(r.Path, "/git/commits") {
			creates++
		}
	}
	if creates != 1 {
		t.Fatalf("%d commit creations", creates)
	}
	// read_github_file reads it back.
	var rf struct {
		Content string `json:"content"`
		Size    int    `json:"size"`
		SHA     string `json:"sha"`
	}
	resultJSON(t, callTool(t, c, "read_github_file", map[string]any{"repo_id": "site", "file_path": "index.html", "branch": "sandbox/landing"}), &rf)
	if rf.Content != "<h1>hi</h1>" || rf.Size != 11 || rf.SHA == "" {
		t.Fatalf("read %+v", rf)
	}
	if strings.Contains(b.Logs(), fineGrainedPAT) {
		t.Fatal("token in broker logs")
	}
}

func TestGitHubRefusalsReachNoNetwork(t *testing.T) {
	b, fake := githubBroker(t, fineGrainedPAT, nil)
	c := b.Client(t, testToken)
	fake.ResetRequests()
	base := map[string]any{"repo_id": "site", "branch": "sandbox/x", "commit_message": "m", "files": map[string]string{"a.txt": "a"}}
	with := func(k string, v any) map[string]any {
		m := map[string]any{}
		for kk, vv := range base {
			m[kk] = vv
		}
		m[k] = v
		return m
	}
	cases := []struct {
		args map[string]any
		code string
	}{
		{with("branch", "main"), "INVALID_BRANCH"},
		{with("branch", "feature/x"), "INVALID_BRANCH"},
		{with("branch", "sandbox/../main"), "INVALID_BRANCH"},
		{with("branch", "refs/heads/sandbox/x"), "INVALID_BRANCH"},
		{with("repo_id", "other"), "INVALID_REPO"},
		{with("files", map[string]string{"../escape.txt": "x"}), "PATH_TRAVERSAL"},
		{with("files", map[string]string{".git/config": "x"}), "PATH_TRAVERSAL"},
		{with("files", map[string]string{".env": "SECRET=1"}), "PATH_TRAVERSAL"},
		{with("files", map[string]string{"node_modules/x.js": "x"}), "PATH_TRAVERSAL"},
		{with("files", map[string]string{"/etc/passwd": "x"}), "PATH_TRAVERSAL"},
		{with("commit_message", strings.Repeat("m", 201)), "INVALID_INPUT"},
	}
	for _, tc := range cases {
		mustToolError(t, callTool(t, c, "commit_and_push_to_github", tc.args), tc.code)
	}
	mustToolError(t, callTool(t, c, "read_github_file", map[string]any{"repo_id": "other", "file_path": "README.md"}), "INVALID_REPO")
	if n := len(fake.Requests()); n != 0 {
		t.Fatalf("%d requests reached GitHub for refused calls: %+v", n, fake.Requests())
	}
}

func TestGitHubRateLimitBecomesRetryable(t *testing.T) {
	b, fake := githubBroker(t, fineGrainedPAT, nil)
	c := b.Client(t, testToken)
	fake.LimitNext(1, ghfake.TooManyRequests)
	e := mustToolError(t, callTool(t, c, "commit_and_push_to_github", map[string]any{"repo_id": "site", "branch": "sandbox/rl",
		"commit_message": "m", "files": map[string]string{"a.txt": "a"}}), "RATE_LIMIT_EXCEEDED")
	if !e.Retryable || e.RetryAfterS == nil || *e.RetryAfterS < 1 {
		t.Fatalf("%+v", e)
	}
}

func TestGitHubClassicTokenRefusedAtStart(t *testing.T) {
	classic := "ghp_" + strings.Repeat("A1b2", 9)
	repos := `[{"repo_id":"site","owner":"acme","name":"site","allowed_branches":["sandbox/*"],"base_branch":"main","token_env":"SITE_GITHUB_TOKEN"}]`
	file := filepath.Join(t.TempDir(), "repos.json")
	if err := os.WriteFile(file, []byte(repos), 0o600); err != nil {
		t.Fatal(err)
	}
	fake := ghfake.New()
	defer fake.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, brokerBin, "serve", "--transport", "http", "--addr", "127.0.0.1:0")
	cmd.Env = brokerEnv(t.TempDir(), testToken, map[string]string{"GITHUB_REPOS_FILE": file, "SITE_GITHUB_TOKEN": classic,
		"GITHUB_API_URL": fake.URL(), "SANDBOX_BACKEND": "none"})
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatal("broker started with a classic token")
	}
	if !strings.Contains(string(out), "fine-grained") || !strings.Contains(string(out), "SITE_GITHUB_TOKEN") {
		t.Fatalf("message does not explain: %s", out)
	}
	if strings.Contains(string(out), classic) || strings.Contains(string(out), "A1b2A1b2") {
		t.Fatalf("token echoed: %s", out)
	}
	if n := len(fake.Requests()); n != 0 {
		t.Fatalf("%d requests with a classic token", n)
	}
}

func TestGitHubCommitSessionFiles(t *testing.T) {
	requireDocker(t)
	b, fake := githubBroker(t, fineGrainedPAT, map[string]string{"SANDBOX_BACKEND": "docker", "SANDBOX_POOL_SIZE": "0"})
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "python", "code": "import os\nos.makedirs('out', exist_ok=True)\nopen('out/report.md','w').write('# made in a sandbox\\n')\nopen('out/data.csv','w').write('a,b\\n1,2\\n')"})
	res := callTool(t, c, "commit_session_files", map[string]any{"repo_id": "site", "branch": "sandbox/report", "session_id": r.SessionID,
		"paths": []string{"out/report.md", "out/data.csv"}, "commit_message": "Report from session", "create_pr": true})
	if res.IsError {
		t.Fatalf("commit_session_files: %+v", res.Content)
	}
	files, _ := fake.Files("acme", "site", "sandbox/report")
	if string(files["out/report.md"]) != "# made in a sandbox\n" || string(files["out/data.csv"]) != "a,b\n1,2\n" {
		t.Fatalf("files %v", files)
	}
	// Another principal's session, or a missing file, is refused.
	mustToolError(t, callTool(t, c, "commit_session_files", map[string]any{"repo_id": "site", "branch": "sandbox/report", "session_id": "nope",
		"paths": []string{"out/report.md"}, "commit_message": "x"}), "SANDBOX_NOT_FOUND")
	// The token never entered the sandbox.
	r2, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "bash", "code": "env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'; true"})
	if strings.Contains(r2.Stdout, "github_pat_") || strings.Contains(r2.Stdout, "SITE_GITHUB_TOKEN") {
		t.Fatal("token visible inside the sandbox")
	}
}

// /readyz names when the GitHub token expires and warns a week ahead,
// without naming the repo; the log names it.
func TestGitHubTokenExpiryInReadyz(t *testing.T) {
	exp := time.Now().Add(72 * time.Hour).Truncate(time.Second).UTC()
	b, _ := githubBrokerWith(t, fineGrainedPAT, nil, func(f *ghfake.Fake) { f.SetTokenExpiry(fineGrainedPAT, exp) })
	var ready struct {
		Status     string            `json:"status"`
		Components map[string]string `json:"components"`
		Details    map[string]string `json:"details"`
	}
	body := getNoAuth(t, b, "/readyz")
	if err := json.Unmarshal([]byte(body), &ready); err != nil {
		t.Fatal(err)
	}
	if ready.Status != "ok" || ready.Components["github"] != "ok" || ready.Details["github_token_expires_at"] != exp.Format(time.RFC3339) ||
		!strings.Contains(ready.Details["github_token_warning"], "expires in") || strings.Contains(body, "site") {
		t.Fatalf("/readyz: %s", body)
	}
	if logs := b.Logs(); !strings.Contains(logs, "github_token_expiring") || !strings.Contains(logs, `"site"`) {
		t.Fatalf("no expiry warning in the log:\n%s", logs)
	}

	b2, _ := githubBrokerWith(t, fineGrainedPAT, nil, func(f *ghfake.Fake) { f.SetTokenExpiry(fineGrainedPAT, time.Now().Add(60*24*time.Hour)) })
	ready.Details = nil
	if err := json.Unmarshal([]byte(getNoAuth(t, b2, "/readyz")), &ready); err != nil || ready.Details["github_token_expires_at"] == "" || ready.Details["github_token_warning"] != "" {
		t.Fatalf("far expiry: %+v %v", ready, err)
	}
}
