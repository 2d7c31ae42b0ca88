package ghfake_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

var pat = "github_" + "pat_" + strings.Repeat("Ab9", 20)

type answer struct {
	status int
	body   map[string]any
	header http.Header
}

func do(t *testing.T, f *ghfake.Fake, method, path, auth, body string) answer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(f.URL(), "/")+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, header: resp.Header}
	_ = json.Unmarshal(b, &a.body)
	return a
}

func TestFakeIsStrict(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.Grant(pat, "acme", "widgets", true)
	ro := "github_" + "pat_" + strings.Repeat("Ro7", 20)
	f.Grant(ro, "acme", "widgets", false)
	bearer, tok := "Bearer "+pat, "token "+pat
	head, _ := f.Head("acme", "widgets", "main")

	cases := []struct {
		name, method, path, auth, body string
		status                         int
		message                        string
	}{
		{"no auth", "GET", "/repos/acme/widgets", "", "", 401, "Requires authentication"},
		{"unknown token", "GET", "/repos/acme/widgets", "Bearer github_pat_nope", "", 401, "Bad credentials"},
		{"basic auth", "GET", "/repos/acme/widgets", "Basic eDp5", "", 401, "Bad credentials"},
		{"repo not granted", "GET", "/repos/acme/other", bearer, "", 404, "Not Found"},
		{"token scheme", "GET", "/repos/acme/widgets", tok, "", 200, ""},
		{"get ref", "GET", "/repos/acme/widgets/git/ref/heads/main", bearer, "", 200, ""},
		{"get ref plural path is not the API", "GET", "/repos/acme/widgets/git/refs/heads/main", bearer, "", 404, "Not Found"},
		{"bad JSON", "POST", "/repos/acme/widgets/git/blobs", bearer, `{"content":`, 400, "Problems parsing JSON"},
		{"unknown field", "POST", "/repos/acme/widgets/git/blobs", bearer, `{"content":"x","evil":1}`, 422, `"evil" is not a permitted key`},
		{"unknown tree entry field", "POST", "/repos/acme/widgets/git/trees", bearer, `{"tree":[{"path":"a","mode":"100644","type":"blob","content":"x","evil":1}]}`, 422, `"evil" is not a permitted key`},
		{"wrong type", "POST", "/repos/acme/widgets/git/blobs", bearer, `{"content":1}`, 422, "is not a string"},
		{"force as string", "PATCH", "/repos/acme/widgets/git/refs/heads/main", bearer, `{"sha":"` + head + `","force":"false"}`, 422, "is not a boolean"},
		{"update bad sha", "PATCH", "/repos/acme/widgets/git/refs/heads/main", bearer, `{"sha":"nothex"}`, 422, "Object does not exist"},
		{"commit unknown parent", "POST", "/repos/acme/widgets/git/commits", bearer, `{"message":"m","tree":"` + strings.Repeat("2", 40) + `","parents":["` + strings.Repeat("4", 40) + `"]}`, 422, "does not exist"},
		{"tree without tree", "POST", "/repos/acme/widgets/git/trees", bearer, `{"base_tree":"x"}`, 422, "Validation Failed"},
		{"get unknown commit", "GET", "/repos/acme/widgets/git/commits/" + strings.Repeat("5", 40), bearer, "", 404, "Not Found"},
		{"bad encoding", "POST", "/repos/acme/widgets/git/blobs", bearer, `{"content":"x","encoding":"rot13"}`, 422, "Validation Failed"},
		{"read-only token write", "POST", "/repos/acme/widgets/git/blobs", "Bearer " + ro, `{"content":"x"}`, 403, "Resource not accessible by personal access token"},
		{"unknown base tree", "POST", "/repos/acme/widgets/git/trees", bearer, `{"base_tree":"` + strings.Repeat("0", 40) + `","tree":[]}`, 422, "base_tree"},
		{"unknown blob in tree", "POST", "/repos/acme/widgets/git/trees", bearer, `{"tree":[{"path":"a","mode":"100644","type":"blob","sha":"` + strings.Repeat("1", 40) + `"}]}`, 422, "not a valid blob"},
		{"tree path escape", "POST", "/repos/acme/widgets/git/trees", bearer, `{"tree":[{"path":"../a","mode":"100644","type":"blob","content":"x"}]}`, 422, "malformed path"},
		{"tree sha and content", "POST", "/repos/acme/widgets/git/trees", bearer, `{"tree":[{"path":"a","mode":"100644","type":"blob","content":"x","sha":"` + strings.Repeat("1", 40) + `"}]}`, 422, "either"},
		{"commit unknown tree", "POST", "/repos/acme/widgets/git/commits", bearer, `{"message":"m","tree":"` + strings.Repeat("2", 40) + `"}`, 422, "Tree SHA does not exist"},
		{"ref unknown sha", "POST", "/repos/acme/widgets/git/refs", bearer, `{"ref":"refs/heads/x","sha":"` + strings.Repeat("3", 40) + `"}`, 422, "Object does not exist"},
		{"ref exists", "POST", "/repos/acme/widgets/git/refs", bearer, `{"ref":"refs/heads/main","sha":"` + head + `"}`, 422, "Reference already exists"},
		{"bad ref name", "POST", "/repos/acme/widgets/git/refs", bearer, `{"ref":"heads/x","sha":"` + head + `"}`, 422, "not a valid ref name"},
		{"update missing ref", "PATCH", "/repos/acme/widgets/git/refs/heads/nope", bearer, `{"sha":"` + head + `"}`, 422, "Reference does not exist"},
		{"pr without commits", "POST", "/repos/acme/widgets/pulls", bearer, `{"title":"t","head":"main","base":"main"}`, 422, "Validation Failed"},
		{"pulls unknown query", "GET", "/repos/acme/widgets/pulls?evil=1", bearer, "", 422, "Unknown parameter"},
		{"contents missing", "GET", "/repos/acme/widgets/contents/nope.txt", bearer, "", 404, "Not Found"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := do(t, f, c.method, c.path, c.auth, c.body)
			if a.status != c.status {
				t.Fatalf("status %d, want %d: %v", a.status, c.status, a.body)
			}
			if msg, _ := a.body["message"].(string); c.message != "" && !strings.Contains(msg, c.message) {
				t.Fatalf("message %q, want %q", msg, c.message)
			}
		})
	}
	if a := do(t, f, "POST", "/repos/acme/widgets/git/blobs", "Bearer "+ro, `{"content":"x"}`); a.header.Get("X-Accepted-GitHub-Permissions") != "contents=write" {
		t.Errorf("403 lacks X-Accepted-GitHub-Permissions: %v", a.header)
	}
	reqs := f.Requests()
	if len(reqs) != len(cases)+1 {
		t.Fatalf("recorded %d requests, want %d", len(reqs), len(cases)+1)
	}
	for _, r := range reqs {
		if strings.Contains(string(r.Body)+r.Path+r.Query, pat) {
			t.Fatal("a token was recorded")
		}
	}
	if h, _ := f.Head("acme", "widgets", "main"); h != head || f.CommitCount("acme", "widgets", "main") != 1 {
		t.Error("refused requests changed the repository")
	}
}

func TestFakeFastForwardOnly(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.Grant(pat, "acme", "widgets", true)
	first, _ := f.Head("acme", "widgets", "main")
	second := f.PushCommit("acme", "widgets", "main", map[string]string{"a": "1"}, "two")
	auth := "Bearer " + pat
	a := do(t, f, "PATCH", "/repos/acme/widgets/git/refs/heads/main", auth, `{"sha":"`+first+`","force":false}`)
	if a.status != 422 || a.body["message"] != "Update is not a fast forward" {
		t.Fatalf("rewind without force: %d %v", a.status, a.body)
	}
	if a := do(t, f, "PATCH", "/repos/acme/widgets/git/refs/heads/main", auth, `{"sha":"`+first+`","force":true}`); a.status != 200 {
		t.Fatalf("forced rewind: %d %v", a.status, a.body)
	}
	if a := do(t, f, "PATCH", "/repos/acme/widgets/git/refs/heads/main", auth, `{"sha":"`+second+`"}`); a.status != 200 {
		t.Fatalf("fast forward: %d %v", a.status, a.body)
	}
	if h, _ := f.Head("acme", "widgets", "main"); h != second {
		t.Fatalf("head %s, want %s", h, second)
	}
}

func TestFakeRateLimitHooks(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.Grant(pat, "acme", "widgets", true)
	auth := "Bearer " + pat
	cases := []struct {
		kind           ghfake.LimitKind
		status         int
		remaining0     bool
		retryAfter     string
		secondaryInDoc bool
	}{
		{ghfake.PrimaryLimit, 403, true, "", false},
		{ghfake.PrimaryLimit429, 429, true, "", false},
		{ghfake.SecondaryLimit, 403, false, "30", true},
		{ghfake.TooManyRequests, 429, false, "30", true},
		{ghfake.SecondaryNoRetryAfter, 403, false, "", true},
	}
	for _, c := range cases {
		f.LimitNext(1, c.kind)
	}
	for _, c := range cases {
		a := do(t, f, "GET", "/repos/acme/widgets", auth, "")
		doc, _ := a.body["documentation_url"].(string)
		msg, _ := a.body["message"].(string)
		reset, err := strconv.ParseInt(a.header.Get("X-RateLimit-Reset"), 10, 64)
		switch {
		case a.status != c.status, (a.header.Get("X-RateLimit-Remaining") == "0") != c.remaining0,
			a.header.Get("Retry-After") != c.retryAfter, strings.HasSuffix(doc, "secondary-rate-limits") != c.secondaryInDoc,
			!strings.Contains(strings.ToLower(msg), "rate limit"), err != nil || reset <= time.Now().Unix(),
			a.header.Get("X-RateLimit-Limit") == "":
			t.Errorf("kind %d: %d %v %v", c.kind, a.status, a.header, a.body)
		}
	}
	a := do(t, f, "GET", "/repos/acme/widgets", auth, "")
	if a.status != 200 {
		t.Errorf("after the limits: %d", a.status)
	}
	// Ordinary answers carry the primary-limit headers too, counting down.
	rem1, _ := strconv.Atoi(a.header.Get("X-RateLimit-Remaining"))
	a = do(t, f, "GET", "/repos/acme/widgets/git/ref/heads/main", auth, "")
	rem2, _ := strconv.Atoi(a.header.Get("X-RateLimit-Remaining"))
	if a.header.Get("X-RateLimit-Limit") != "5000" || a.header.Get("X-RateLimit-Resource") != "core" || rem2 != rem1-1 || rem1 <= 0 {
		t.Errorf("rate headers %v (remaining %d then %d)", a.header, rem1, rem2)
	}
}

// GrantRole separates what GET /repos reports (the user's role) from what
// the token may do, as with a fine-grained token made without
// contents:write.
func TestFakeGrantRole(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.GrantRole(pat, "acme", "widgets", false, true)
	auth := "Bearer " + pat
	a := do(t, f, "GET", "/repos/acme/widgets", auth, "")
	perms, _ := a.body["permissions"].(map[string]any)
	if a.status != 200 || perms["push"] != true {
		t.Fatalf("repo: %d %v", a.status, a.body)
	}
	a = do(t, f, "POST", "/repos/acme/widgets/git/blobs", auth, `{"content":"x"}`)
	if a.status != 403 || a.header.Get("X-Accepted-GitHub-Permissions") != "contents=write" {
		t.Fatalf("write: %d %v %v", a.status, a.header, a.body)
	}
	a = do(t, f, "POST", "/repos/acme/widgets/pulls", auth, `{"title":"t","head":"main","base":"main"}`)
	if a.status != 403 || a.header.Get("X-Accepted-GitHub-Permissions") != "pull_requests=write" {
		t.Fatalf("pull: %d %v %v", a.status, a.header, a.body)
	}
}

// GitHub's published secondary limit on content creation: 80 writes a
// minute per token. The 81st is refused with the secondary-limit answer
// and a Retry-After; another token is not affected.
func TestFakeContentCreationLimit(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.Grant(pat, "acme", "widgets", true)
	other := "github_" + "pat_" + strings.Repeat("Ot5", 20)
	f.Grant(other, "acme", "widgets", true)
	for i := range ghfake.ContentPerMinute {
		if a := do(t, f, "POST", "/repos/acme/widgets/git/blobs", "Bearer "+pat, `{"content":"x`+strconv.Itoa(i)+`"}`); a.status != 201 {
			t.Fatalf("write %d: %d %v", i, a.status, a.body)
		}
	}
	a := do(t, f, "POST", "/repos/acme/widgets/git/blobs", "Bearer "+pat, `{"content":"one too many"}`)
	retry, _ := strconv.Atoi(a.header.Get("Retry-After"))
	if msg, _ := a.body["message"].(string); a.status != 403 || !strings.Contains(msg, "secondary rate limit") || retry < 1 || retry > 60 {
		t.Fatalf("81st write: %d %v %v", a.status, a.header, a.body)
	}
	if a := do(t, f, "GET", "/repos/acme/widgets", "Bearer "+pat, ""); a.status != 200 {
		t.Fatalf("reads are not content creation: %d", a.status)
	}
	if a := do(t, f, "POST", "/repos/acme/widgets/git/blobs", "Bearer "+other, `{"content":"y"}`); a.status != 201 {
		t.Fatalf("another token: %d", a.status)
	}
}

// A write of a token while another of its writes is being answered gets a
// secondary rate limit: GitHub asks for requests to be serial.
func TestFakeRefusesConcurrentWrites(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.Grant(pat, "acme", "widgets", true)
	held, release := make(chan struct{}), make(chan struct{})
	var once bool
	f.OnRequest(func(method, path string) {
		if method == "POST" && !once {
			once = true
			close(held)
			<-release
		}
	})
	first := make(chan answer, 1)
	go func() { first <- do(t, f, "POST", "/repos/acme/widgets/git/blobs", "Bearer "+pat, `{"content":"a"}`) }()
	<-held
	if a := do(t, f, "GET", "/repos/acme/widgets", "Bearer "+pat, ""); a.status != 200 {
		t.Fatalf("a read alongside: %d", a.status)
	}
	a := do(t, f, "POST", "/repos/acme/widgets/git/blobs", "Bearer "+pat, `{"content":"b"}`)
	if msg, _ := a.body["message"].(string); a.status != 403 || !strings.Contains(msg, "secondary rate limit") {
		t.Fatalf("concurrent write: %d %v", a.status, a.body)
	}
	close(release)
	if a := <-first; a.status != 201 {
		t.Fatalf("first write: %d", a.status)
	}
	if a := do(t, f, "POST", "/repos/acme/widgets/git/blobs", "Bearer "+pat, `{"content":"c"}`); a.status != 201 {
		t.Fatalf("a later write: %d", a.status)
	}
}

// Refs resolve as git resolves them: a bare name that is both a tag and a
// branch is the tag; refs/heads/<name> is the branch.
func TestFakeResolvesRefsLikeGit(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.Grant(pat, "acme", "widgets", true)
	f.PushCommit("acme", "widgets", "v1", map[string]string{"f": "branch"}, "b")
	f.AddTag("acme", "widgets", "v1", map[string]string{"f": "tag"})
	for ref, want := range map[string]string{"v1": "tag", "refs/tags/v1": "tag", "refs/heads/v1": "branch", "heads/v1": "branch"} {
		a := do(t, f, "GET", "/repos/acme/widgets/contents/f?ref="+ref, "Bearer "+pat, "")
		s, _ := a.body["content"].(string)
		if a.status != 200 || s == "" {
			t.Fatalf("%s: %d %v", ref, a.status, a.body)
		}
		if got, _ := f.File("acme", "widgets", ref, "f"); string(got) != want {
			t.Errorf("%s: %q, want %q", ref, got, want)
		}
	}
	f.SetDefaultBranch("acme", "widgets", "trunk")
	if a := do(t, f, "GET", "/repos/acme/widgets", "Bearer "+pat, ""); a.body["default_branch"] != "trunk" {
		t.Fatalf("default_branch %v", a.body["default_branch"])
	}
}

// An expiring token's answers name its expiry; past it, 401.
func TestFakeTokenExpiry(t *testing.T) {
	f := ghfake.New()
	defer f.Close()
	f.AddRepo("acme", "widgets")
	f.Grant(pat, "acme", "widgets", true)
	exp := time.Date(2099, 1, 2, 3, 4, 5, 0, time.UTC)
	f.SetTokenExpiry(pat, exp)
	if a := do(t, f, "GET", "/repos/acme/widgets", "Bearer "+pat, ""); a.status != 200 || a.header.Get(ghfake.ExpiryHeader) != "2099-01-02 03:04:05 UTC" {
		t.Fatalf("%d %v", a.status, a.header)
	}
	f.SetTokenExpiry(pat, time.Now().Add(-time.Second))
	if a := do(t, f, "GET", "/repos/acme/widgets", "Bearer "+pat, ""); a.status != 401 || a.header.Get(ghfake.ExpiryHeader) != "" {
		t.Fatalf("expired: %d %v", a.status, a.header)
	}
}
