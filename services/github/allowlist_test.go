package github_test

import (
	"context"
	"encoding/json"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

func entry(over map[string]any) string {
	m := map[string]any{"repo_id": "widgets", "owner": "acme", "name": "widgets",
		"allowed_branches": []string{"sandbox/*"}, "base_branch": "main", "token_env": "WIDGETS_TOKEN"}
	for k, v := range over {
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
	}
	b, _ := json.Marshal(m)
	return string(b)
}

func TestParseRepos(t *testing.T) {
	good := `[` + entry(nil) + `,` + entry(map[string]any{"repo_id": "site", "name": "site.github.io", "base_branch": "develop",
		"allowed_branches": []string{"agent-*", "sandbox/[a-z]*"}, "token_env": "SITE_PAT"}) + `]`
	repos, err := github.ParseRepos([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if len(repos) != 2 || repos[1].RepoID != "site" || repos[1].BaseBranch != "develop" || repos[1].AllowedBranches[1] != "sandbox/[a-z]*" || repos[0].HasToken() {
		t.Fatalf("repos %+v", repos)
	}
	bad := map[string]string{
		"not an array":         entry(nil),
		"empty array":          `[]`,
		"null":                 `null`,
		"null globs":           `[` + entry(map[string]any{"allowed_branches": nil}) + `]`,
		"token in the file":    `[` + entry(map[string]any{"token_env": nil, "token": "x"}) + `]`,
		"trailing data":        `[` + entry(nil) + `] []`,
		"unknown field":        `[` + entry(map[string]any{"token": "x"}) + `]`,
		"case-variant key":     `[{"Repo_ID":"widgets","owner":"acme","name":"widgets","allowed_branches":["sandbox/*"],"base_branch":"main","token_env":"T"}]`,
		"duplicate key":        `[{"repo_id":"a","repo_id":"b","owner":"acme","name":"widgets","allowed_branches":["sandbox/*"],"base_branch":"main","token_env":"T"}]`,
		"duplicate repo_id":    `[` + entry(nil) + `,` + entry(map[string]any{"name": "other"}) + `]`,
		"duplicate repo":       `[` + entry(nil) + `,` + entry(map[string]any{"repo_id": "w2", "owner": "ACME", "name": "Widgets"}) + `]`,
		"missing field":        `[` + entry(map[string]any{"token_env": nil}) + `]`,
		"bad repo_id":          `[` + entry(map[string]any{"repo_id": "a/b"}) + `]`,
		"long repo_id":         `[` + entry(map[string]any{"repo_id": strings.Repeat("a", 65)}) + `]`,
		"owner leading hyphen": `[` + entry(map[string]any{"owner": "-acme"}) + `]`,
		"owner double hyphen":  `[` + entry(map[string]any{"owner": "ac--me"}) + `]`,
		"owner too long":       `[` + entry(map[string]any{"owner": strings.Repeat("a", 40)}) + `]`,
		"owner with slash":     `[` + entry(map[string]any{"owner": "acme/../x"}) + `]`,
		"name dotdot":          `[` + entry(map[string]any{"name": ".."}) + `]`,
		"name with slash":      `[` + entry(map[string]any{"name": "a/b"}) + `]`,
		"malformed glob":       `[` + entry(map[string]any{"allowed_branches": []string{"sandbox/["}}) + `]`,
		"glob bad chars":       `[` + entry(map[string]any{"allowed_branches": []string{"sandbox/ x"}}) + `]`,
		"no globs":             `[` + entry(map[string]any{"allowed_branches": []string{}}) + `]`,
		"duplicate glob":       `[` + entry(map[string]any{"allowed_branches": []string{"a", "a"}}) + `]`,
		"base master":          `[` + entry(map[string]any{"base_branch": "master"}) + `]`,
		"bad env name":         `[` + entry(map[string]any{"token_env": "1TOKEN"}) + `]`,
		"env name with =":      `[` + entry(map[string]any{"token_env": "A=B"}) + `]`,
		"wrong type":           `[` + entry(map[string]any{"allowed_branches": "sandbox/*"}) + `]`,
	}
	for name, doc := range bad {
		if _, err := github.ParseRepos([]byte(doc)); err == nil {
			t.Errorf("%s: accepted %s", name, doc)
		}
	}
}

func TestLoadReposFromFileAndSecretFile(t *testing.T) {
	dir := t.TempDir()
	list := filepath.Join(dir, "repos.json")
	if err := os.WriteFile(list, []byte(allowList), 0o600); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(dir, "token")
	if err := os.WriteFile(secret, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	repos, err := github.LoadRepos(list, lookup(map[string]string{env + "_FILE": secret}))
	if err != nil {
		t.Fatal(err)
	}
	if toks := github.Tokens(repos); len(toks) != 1 || toks[0] != token {
		t.Fatal("token from the _FILE variable was not loaded (trimmed)")
	}
	repos, err = github.LoadRepos(list, lookup(map[string]string{env: " " + token + " "}))
	if err != nil || github.Tokens(repos)[0] != token {
		t.Fatalf("env token: %v", err)
	}
	for name, vars := range map[string]map[string]string{
		"none":           {},
		"both":           {env: token, env + "_FILE": secret},
		"missing file":   {env + "_FILE": filepath.Join(dir, "nope")},
		"directory file": {env + "_FILE": dir},
		"classic":        {env: classic},
	} {
		_, err := github.LoadRepos(list, lookup(vars))
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		if !strings.Contains(err.Error(), repoID) || strings.Contains(err.Error(), dir) || strings.Contains(err.Error(), token) {
			t.Errorf("%s: message %q should name the repo and neither the path nor the token", name, err)
		}
	}
	if _, err := github.LoadRepos(filepath.Join(dir, "missing.json"), lookup(nil)); err == nil {
		t.Error("missing allow-list accepted")
	}
}

// Every non-fine-grained shape is refused with a message that says what
// the token is, names the variable, and does not repeat the token.
func TestTokenKindsExplained(t *testing.T) {
	cases := map[string]string{
		"gh" + "p_" + strings.Repeat("Z9y8", 9):            "classic personal access token",
		"gh" + "o_" + strings.Repeat("Z9y8", 9):            "OAuth token",
		"gh" + "u_" + strings.Repeat("Z9y8", 9):            "GitHub App user token",
		"gh" + "s_" + strings.Repeat("Z9y8", 9):            "installation token",
		"gh" + "r_" + strings.Repeat("Z9y8", 9):            "refresh token",
		strings.Repeat("0123456789abcdef", 2) + "01234567": "classic personal access token",
		"not-a-token-at-all-0123456789":                    "not a fine-grained personal access token",
	}
	for tok, want := range cases {
		repos, err := github.ParseRepos([]byte(allowList))
		if err != nil {
			t.Fatal(err)
		}
		err = github.ResolveTokens(repos, lookup(map[string]string{env: tok}))
		if err == nil {
			t.Fatalf("%.4s… accepted", tok)
		}
		msg := err.Error()
		if !strings.Contains(msg, want) || !strings.Contains(msg, "github_pat_") || !strings.Contains(msg, env) || strings.Contains(msg, tok[4:]) {
			t.Errorf("%.4s…: message %q should say %q, name %s and github_pat_, and not repeat the token", tok, msg, want, env)
		}
	}
}

func FuzzResolveTokens(f *testing.F) {
	for _, s := range []string{token, classic, "github_" + "pat_x", " " + token + "\n", strings.Repeat("a", 40), ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, tok string) {
		repos, err := github.ParseRepos([]byte(allowList))
		if err != nil {
			t.Fatal(err)
		}
		err = github.ResolveTokens(repos, lookup(map[string]string{env: tok}))
		trimmed := strings.TrimSpace(tok)
		if err == nil {
			got := github.Tokens(repos)
			if len(got) != 1 || got[0] != trimmed || !strings.HasPrefix(trimmed, "github_pat_") || strings.ContainsAny(trimmed, " \t\r\n") {
				t.Fatalf("accepted %q as %q", tok, got)
			}
			return
		}
		if github.Tokens(repos) != nil {
			t.Fatal("a refused token was kept")
		}
		// Long secret-like values never come back in the message.
		if len(trimmed) >= 24 && !strings.ContainsAny(trimmed, " \t\r\n") && strings.Contains(err.Error(), trimmed) {
			t.Fatalf("message %q repeats the token", err)
		}
	})
}

func TestBaseBranchRefusedEvenWhenAGlobMatchesIt(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo(owner, name)
	f.Grant(token, owner, name, true)
	repos, err := github.ParseRepos([]byte(`[` + entry(map[string]any{"allowed_branches": []string{"*"}}) + `]`))
	if err != nil {
		t.Fatal(err)
	}
	if err := github.ResolveTokens(repos, lookup(map[string]string{env: token})); err != nil {
		t.Fatal(err)
	}
	m, err := github.New(context.Background(), github.Options{APIURL: f.URL(), Repos: repos})
	if err != nil {
		t.Fatal(err)
	}
	f.ResetRequests()
	_, err = m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: "main",
		Files: map[string][]byte{"a": []byte("a")}, Message: "m"})
	if e := brokererr.As(err); e == nil || e.Code != brokererr.InvalidBranch || !strings.Contains(e.Message, "base branch") {
		t.Fatalf("commit to main: %v", err)
	}
	if n := len(f.Requests()); n != 0 {
		t.Fatalf("%d requests", n)
	}
	if _, err := m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: "develop",
		Files: map[string][]byte{"a": []byte("a")}, Message: "m"}); err != nil {
		t.Fatalf("commit to develop (not the base): %v", err)
	}
}

func TestValidateBranchName(t *testing.T) {
	for _, b := range []string{"sandbox/x", "agent-1", "a.b_c-d/e", strings.Repeat("a", 200)} {
		if err := github.ValidateBranchName(b); err != nil {
			t.Errorf("%q refused: %v", b, err)
		}
	}
	for _, b := range []string{"", "/a", "a/", "a//b", "a..b", "refs/heads/a", "a.lock", "a/.b", "-a", "a.", "HEAD",
		"a b", "a~1", "a^", "a:b", "a?", "a*", "a[", "a\\b", "a@{1}", "ä", strings.Repeat("a", 201)} {
		err := github.ValidateBranchName(b)
		if e := brokererr.As(err); e == nil || e.Code != brokererr.InvalidBranch {
			t.Errorf("%q: %v, want INVALID_BRANCH", b, err)
		}
	}
}

var branchShape = regexp.MustCompile(`^[A-Za-z0-9._/-]{1,200}$`)

func FuzzValidateBranchName(f *testing.F) {
	for _, s := range []string{"sandbox/x", "a..b", "refs/heads/x", "x.lock", "/x", "a//b", "-x", "HEAD", ".x", "a/.x/b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b string) {
		err := github.ValidateBranchName(b)
		if err != nil {
			if e := brokererr.As(err); e == nil || e.Code != brokererr.InvalidBranch {
				t.Fatalf("%q: error %v is not INVALID_BRANCH", b, err)
			}
			return
		}
		// Everything accepted is a plain, canonical branch name.
		if !branchShape.MatchString(b) || strings.Contains(b, "..") || strings.Contains(b, "//") ||
			strings.HasPrefix(b, "/") || strings.HasSuffix(b, "/") || strings.HasPrefix(b, "refs/") ||
			strings.HasSuffix(b, ".lock") || strings.HasPrefix(b, "-") || strings.HasSuffix(b, ".") || b == "HEAD" {
			t.Fatalf("accepted %q", b)
		}
		for _, c := range strings.Split(b, "/") {
			if c == "" || c[0] == '.' {
				t.Fatalf("accepted %q with component %q", b, c)
			}
		}
	})
}

func FuzzParseRepos(f *testing.F) {
	f.Add([]byte(allowList))
	f.Add([]byte(`[` + entry(nil) + `,` + entry(map[string]any{"repo_id": "b", "name": "b"}) + `]`))
	f.Add([]byte(`[{"repo_id":"a","repo_id":"a"}]`))
	f.Add([]byte(`[{"REPO_ID":"a"}]`))
	f.Add([]byte(`[] x`))
	f.Fuzz(func(t *testing.T, data []byte) {
		repos, err := github.ParseRepos(data)
		if err != nil {
			return
		}
		ids := map[string]bool{}
		for _, r := range repos {
			if ids[r.RepoID] || r.HasToken() {
				t.Fatalf("duplicate repo_id or token in %s", data)
			}
			ids[r.RepoID] = true
			if r.BaseBranch != "main" && r.BaseBranch != "develop" || len(r.AllowedBranches) == 0 {
				t.Fatalf("accepted %+v", r)
			}
			if strings.ContainsAny(r.Owner+r.Name, "/\\ ") || r.Name == ".." || r.Name == "." {
				t.Fatalf("accepted owner/name %q/%q", r.Owner, r.Name)
			}
		}
		// What was accepted re-encodes to a document that parses the same.
		b, err := json.Marshal(repos)
		if err != nil {
			t.Fatal(err)
		}
		again, err := github.ParseRepos(b)
		if err != nil || len(again) != len(repos) {
			t.Fatalf("re-parse of %s: %v", b, err)
		}
	})
}

func FuzzValidateRepoPath(f *testing.F) {
	for _, s := range []string{"src/a.py", ".git/config", ".env", "a/.ENV.local", "node_modules/x", ".github/workflows/ci.yml",
		".GitHub/Workflows/x", ".github/dependabot.yml", "../x", "a//b", "/abs"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		got, err := github.ValidateRepoPath(p)
		if err != nil {
			return
		}
		if got != p || path.Clean(p) != p || strings.HasPrefix(p, "/") || !utf8.ValidString(p) {
			t.Fatalf("accepted non-canonical %q", p)
		}
		parts := strings.Split(strings.ToLower(p), "/")
		for _, c := range parts {
			for _, bad := range []string{".git", ".env", "node_modules", ".codesandbox"} {
				if c == bad || strings.HasPrefix(c, bad+".") {
					t.Fatalf("accepted forbidden %q", p)
				}
			}
			if c == ".." || c == "." || c == "" {
				t.Fatalf("accepted %q", p)
			}
		}
		if len(parts) > 2 && parts[0] == ".github" && parts[1] == "workflows" {
			t.Fatalf("accepted workflow %q", p)
		}
	})
}
