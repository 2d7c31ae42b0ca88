// Package ghfake is an in-memory stand-in for the GitHub REST API, exactly
// as much of it as services/github uses: repositories, Git refs, blobs,
// trees, commits, pull requests and contents. It is strict the way GitHub
// is (tokens, permissions, request shapes, fast-forward-only ref updates,
// git's ref resolution, the secondary limits on content creation and on
// concurrent writes; see limits.go), sends the X-RateLimit-* and token
// expiry headers GitHub sends, can answer with each shape of GitHub's
// rate limits, and records every request, so tests can assert what
// reached "GitHub".
package ghfake

import (
	"bytes"
	"crypto/sha1"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// LimitKind is a rate-limit answer the fake can give.
type LimitKind int

// GitHub answers an exceeded limit with 403 or 429: for the primary limit
// with X-RateLimit-Remaining: 0 and X-RateLimit-Reset; for a secondary limit
// with a message (and documentation_url) naming it, and Retry-After when
// GitHub chooses to send one. Every kind below is one of those shapes.
const (
	// PrimaryLimit answers 403 with X-RateLimit-Remaining: 0 and a reset
	// PrimaryReset from now.
	PrimaryLimit LimitKind = iota
	// SecondaryLimit answers 403 with Retry-After and the secondary-limit
	// message and documentation URL.
	SecondaryLimit
	// TooManyRequests answers 429 with Retry-After and the secondary-limit
	// message and documentation URL.
	TooManyRequests
	// PrimaryLimit429 is PrimaryLimit answered with 429.
	PrimaryLimit429
	// SecondaryNoRetryAfter answers 403 with the secondary-limit message
	// and neither Retry-After nor X-RateLimit-Remaining: 0; GitHub then
	// asks clients to wait at least a minute.
	SecondaryNoRetryAfter
)

// Rate-limit timings the fake announces.
const (
	PrimaryReset = 60 * time.Second
	RetryAfter   = 30 * time.Second
)

// maxContentSize is where the contents API stops inlining files.
const maxContentSize = 1 << 20

// rateLimit is the primary limit the fake announces on every answer, as
// GitHub does for a fine-grained token.
const rateLimit = 5000

const (
	docSecondary = "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api#about-secondary-rate-limits"
	docPrimary   = "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api#about-the-primary-rate-limit"
	msgSecondary = "You have exceeded a secondary rate limit. Please wait a few minutes before you try again."
)

// Request is one recorded request. The Authorization header is not kept.
type Request struct {
	Method string
	Path   string
	Query  string
	Body   []byte
	Status int
}

// Commit is a commit as the fake stores it.
type Commit struct {
	SHA     string
	Tree    string
	Message string
	Parents []string
}

// PullRequest is a pull request as the fake stores it.
type PullRequest struct {
	Number  int
	Title   string
	Body    string
	Head    string
	Base    string
	State   string
	HTMLURL string
}

// Fake is the server. Its zero value is not usable; call New.
type Fake struct {
	srv *httptest.Server

	mu       sync.Mutex
	repos    map[string]*repo           // lower-case "owner/name"
	tokens   map[string]map[string]bool // token → repo key → push
	requests []Request
	limits   []LimitKind
	failures []int
	hook     func(method, path string)
	seq      int
	nextID   int64
	used     int                    // requests counted against the primary limit
	reset    time.Time              // when the primary window resets
	inflight map[string]int         // token → mutating requests being answered
	created  map[string][]time.Time // token → its content-creating requests, last hour
	expiry   map[string]time.Time   // token → when it expires (SetTokenExpiry)
}

type repo struct {
	owner, name   string
	id            int64
	archived      bool
	defaultBranch string
	// rolePush, per token, is the push bit GET /repos reports: the token
	// owner's role. It can differ from what the token may do (the grant),
	// as with a fine-grained token made without contents:write.
	rolePush map[string]bool
	blobs    map[string][]byte
	trees    map[string]map[string]string // tree SHA → path → blob SHA
	commits  map[string]*Commit
	refs     map[string]string // "refs/heads/x" → commit SHA
	pulls    []*PullRequest
}

// New starts a fake on a loopback port.
func New() *Fake {
	f := &Fake{repos: map[string]*repo{}, tokens: map[string]map[string]bool{}, nextID: 1000,
		reset: time.Now().Add(time.Hour), inflight: map[string]int{}, created: map[string][]time.Time{}, expiry: map[string]time.Time{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	return f
}

// URL is the API base URL, with the trailing slash go-github needs.
func (f *Fake) URL() string { return f.srv.URL + "/" }

// Close stops the server.
func (f *Fake) Close() { f.srv.Close() }

// AddRepo creates a repository whose main branch has one commit holding
// README.md.
func (f *Fake) AddRepo(owner, name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextID++
	r := &repo{owner: owner, name: name, id: f.nextID, defaultBranch: "main", rolePush: map[string]bool{}, blobs: map[string][]byte{},
		trees: map[string]map[string]string{}, commits: map[string]*Commit{}, refs: map[string]string{}}
	f.repos[key(owner, name)] = r
	readme := r.putBlob([]byte("# " + name + "\n"))
	tree := r.putTree(map[string]string{"README.md": readme})
	c := f.putCommit(r, tree, "Initial commit", nil)
	r.refs["refs/heads/main"] = c
}

// Archive marks a repository archived.
func (f *Fake) Archive(owner, name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.mustRepo(owner, name).archived = true
}

// Grant lets token reach the repository, with or without push access.
// Only fine-grained token shapes are accepted, as the broker sends no other.
func (f *Fake) Grant(token, owner, name string, push bool) {
	f.GrantRole(token, owner, name, push, push)
}

// GrantRole is Grant with the two push bits apart: tokenWrite is what the
// token may do (writes without it get 403 "Resource not accessible by
// personal access token"), rolePush what GET /repos reports as
// permissions.push (the user's role on the repository).
func (f *Fake) GrantRole(token, owner, name string, tokenWrite, rolePush bool) {
	if !strings.HasPrefix(token, "github_pat_") {
		panic("ghfake: only fine-grained tokens (github_pat_…) can be granted")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.mustRepo(owner, name)
	if f.tokens[token] == nil {
		f.tokens[token] = map[string]bool{}
	}
	f.tokens[token][key(owner, name)] = tokenWrite
	r.rolePush[token] = rolePush
}

// Revoke forgets a token: it is then answered 401 Bad credentials.
func (f *Fake) Revoke(token string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.tokens, token)
}

// PushCommit commits files (path → content) on top of branch, creating the
// branch from main if needed, as someone else pushing would. It returns
// the new commit SHA.
func (f *Fake) PushCommit(owner, name, branch string, files map[string]string, message string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.mustRepo(owner, name)
	parent, ok := r.refs["refs/heads/"+branch]
	if !ok {
		parent = r.refs["refs/heads/main"]
	}
	tree := map[string]string{}
	for p, s := range r.trees[r.commits[parent].Tree] {
		tree[p] = s
	}
	for p, c := range files {
		tree[p] = r.putBlob([]byte(c))
	}
	c := f.putCommit(r, r.putTree(tree), message, []string{parent})
	r.refs["refs/heads/"+branch] = c
	return c
}

// LimitNext makes the next n requests fail with the given rate limit.
func (f *Fake) LimitNext(n int, kind LimitKind) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := 0; i < n; i++ {
		f.limits = append(f.limits, kind)
	}
}

// FailNext makes the next n requests fail with status (e.g. 502).
func (f *Fake) FailNext(n, status int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := 0; i < n; i++ {
		f.failures = append(f.failures, status)
	}
}

// OnRequest calls hook before each request is handled, outside the fake's
// lock, so a test can change the repository at an exact point of a flow.
func (f *Fake) OnRequest(hook func(method, path string)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hook = hook
}

// Requests returns a copy of every request so far.
func (f *Fake) Requests() []Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Request(nil), f.requests...)
}

// ResetRequests forgets the recorded requests.
func (f *Fake) ResetRequests() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = nil
}

// Head returns the commit a branch points at.
func (f *Fake) Head(owner, name, branch string) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sha, ok := f.mustRepo(owner, name).refs["refs/heads/"+branch]
	return sha, ok
}

// CommitByRef returns the commit named by a SHA or branch name.
func (f *Fake) CommitByRef(owner, name, ref string) (Commit, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.mustRepo(owner, name)
	c, ok := r.commits[r.resolve(ref)]
	if !ok {
		return Commit{}, false
	}
	out := *c
	out.Parents = append([]string(nil), c.Parents...)
	return out, true
}

// Files returns every file of the tree at ref (a SHA or branch name).
func (f *Fake) Files(owner, name, ref string) (map[string][]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.mustRepo(owner, name)
	c, ok := r.commits[r.resolve(ref)]
	if !ok {
		return nil, false
	}
	out := map[string][]byte{}
	for p, s := range r.trees[c.Tree] {
		out[p] = append([]byte(nil), r.blobs[s]...)
	}
	return out, true
}

// File reads one file at ref.
func (f *Fake) File(owner, name, ref, path string) ([]byte, bool) {
	files, ok := f.Files(owner, name, ref)
	if !ok {
		return nil, false
	}
	b, ok := files[path]
	return b, ok
}

// CommitCount counts the commits on a branch, following first parents.
func (f *Fake) CommitCount(owner, name, branch string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.mustRepo(owner, name)
	n := 0
	for sha, ok := r.refs["refs/heads/"+branch]; ok; {
		n++
		c := r.commits[sha]
		if len(c.Parents) == 0 {
			break
		}
		sha = c.Parents[0]
	}
	return n
}

// PullRequests lists the repository's pull requests.
func (f *Fake) PullRequests(owner, name string) []PullRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []PullRequest
	for _, p := range f.mustRepo(owner, name).pulls {
		out = append(out, *p)
	}
	return out
}

func key(owner, name string) string { return strings.ToLower(owner + "/" + name) }

func (f *Fake) mustRepo(owner, name string) *repo {
	r, ok := f.repos[key(owner, name)]
	if !ok {
		panic("ghfake: no repo " + owner + "/" + name)
	}
	return r
}

// Object IDs are real git SHA-1s for blobs, and stable digests for trees
// and commits.
func (r *repo) putBlob(b []byte) string {
	h := sha1.New()
	fmt.Fprintf(h, "blob %d\x00", len(b))
	h.Write(b)
	sha := hex.EncodeToString(h.Sum(nil))
	r.blobs[sha] = append([]byte(nil), b...)
	return sha
}

func (r *repo) putTree(files map[string]string) string {
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	h := sha1.New()
	io.WriteString(h, "tree\x00")
	for _, p := range paths {
		fmt.Fprintf(h, "100644 %s\x00%s\n", p, files[p])
	}
	sha := hex.EncodeToString(h.Sum(nil))
	r.trees[sha] = files
	return sha
}

func (f *Fake) putCommit(r *repo, tree, message string, parents []string) string {
	f.seq++
	h := sha1.New()
	fmt.Fprintf(h, "commit\x00%s\x00%s\x00%s\x00%d", tree, strings.Join(parents, ","), message, f.seq)
	sha := hex.EncodeToString(h.Sum(nil))
	r.commits[sha] = &Commit{SHA: sha, Tree: tree, Message: message, Parents: append([]string(nil), parents...)}
	return sha
}

// resolve maps a ref to a commit SHA ("" if none) the way git does
// (gitrevisions: <refname>, refs/<refname>, refs/tags/<refname>,
// refs/heads/<refname>), so a bare name that is both a tag and a branch
// is the tag; then a commit SHA.
func (r *repo) resolve(ref string) string {
	for _, k := range []string{ref, "refs/" + ref, "refs/tags/" + ref, "refs/heads/" + ref} {
		if sha, ok := r.refs[k]; ok && strings.HasPrefix(k, "refs/") {
			return sha
		}
	}
	if _, ok := r.commits[ref]; ok {
		return ref
	}
	return ""
}

// isAncestor reports whether a is b or reachable from b.
func (r *repo) isAncestor(a, b string) bool {
	seen := map[string]bool{}
	stack := []string{b}
	for len(stack) > 0 {
		s := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if s == a {
			return true
		}
		if seen[s] {
			continue
		}
		seen[s] = true
		if c, ok := r.commits[s]; ok {
			stack = append(stack, c.Parents...)
		}
	}
	return false
}

// --- HTTP ---

type apiError struct {
	status  int
	message string
	header  map[string]string
	errors  []map[string]string
	docURL  string
}

func (e *apiError) Error() string { return e.message }

func fail(status int, format string, args ...any) *apiError {
	return &apiError{status: status, message: fmt.Sprintf(format, args...)}
}

func notFound() *apiError { return fail(http.StatusNotFound, "Not Found") }

func invalid(resource, field, code string) *apiError {
	e := fail(http.StatusUnprocessableEntity, "Validation Failed")
	e.errors = []map[string]string{{"resource": resource, "field": field, "code": code}}
	return e
}

func (f *Fake) serve(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(io.LimitReader(req.Body, 64<<20))
	tok := tokenOf(req.Header.Get("Authorization"))
	f.mu.Lock()
	hook := f.hook
	concurrent, leave := f.enter(tok, req.Method)
	f.mu.Unlock()
	if hook != nil {
		hook(req.Method, req.URL.Path)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	rec := Request{Method: req.Method, Path: req.URL.Path, Query: req.URL.RawQuery, Body: body}
	status, v, hdr := f.handle(req, body, concurrent)
	leave() // answered: the next write of this token is no longer concurrent
	rec.Status = status
	f.requests = append(f.requests, rec)
	for k, val := range hdr {
		w.Header().Set(k, val)
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// rateHeaders are the primary-limit headers GitHub sends on every
// authenticated answer; each request counts against the limit.
func (f *Fake) rateHeaders(hdr map[string]string) map[string]string {
	now := time.Now()
	if !now.Before(f.reset) {
		f.used, f.reset = 0, now.Add(time.Hour)
	}
	if f.used < rateLimit {
		f.used++
	}
	if hdr == nil {
		hdr = map[string]string{}
	}
	set := func(k, v string) {
		if _, ok := hdr[k]; !ok {
			hdr[k] = v
		}
	}
	set("X-RateLimit-Limit", strconv.Itoa(rateLimit))
	set("X-RateLimit-Remaining", strconv.Itoa(rateLimit-f.used))
	set("X-RateLimit-Used", strconv.Itoa(f.used))
	set("X-RateLimit-Reset", strconv.FormatInt(f.reset.Unix(), 10))
	set("X-RateLimit-Resource", "core")
	return hdr
}

// handle answers one request under f.mu, with the token's expiry header
// on every authenticated answer, as GitHub sends it for tokens that expire.
func (f *Fake) handle(req *http.Request, body []byte, concurrent bool) (int, any, map[string]string) {
	status, v, hdr := f.answer(req, body, concurrent)
	if exp, ok := f.expiry[tokenOf(req.Header.Get("Authorization"))]; ok && status != http.StatusUnauthorized {
		if hdr == nil {
			hdr = map[string]string{}
		}
		hdr[ExpiryHeader] = exp.UTC().Format(ExpiryLayout)
	}
	return status, v, hdr
}

func (f *Fake) answer(req *http.Request, body []byte, concurrent bool) (int, any, map[string]string) {
	if concurrent {
		st, v, hdr := limitAnswer(SecondaryNoRetryAfter)
		return st, v, f.rateHeaders(hdr)
	}
	if len(f.limits) > 0 {
		kind := f.limits[0]
		f.limits = f.limits[1:]
		st, v, hdr := limitAnswer(kind)
		return st, v, f.rateHeaders(hdr)
	}
	if len(f.failures) > 0 {
		st := f.failures[0]
		f.failures = f.failures[1:]
		return st, map[string]string{"message": http.StatusText(st)}, nil
	}
	v, hdr, status, err := f.route(req, body)
	if err != nil {
		out := map[string]any{"message": err.message, "status": strconv.Itoa(err.status),
			"documentation_url": "https://docs.github.com/rest"}
		if err.docURL != "" {
			out["documentation_url"] = err.docURL
		}
		if len(err.errors) > 0 {
			out["errors"] = err.errors
		}
		status, v, hdr = err.status, out, err.header
	}
	if status != http.StatusUnauthorized {
		hdr = f.rateHeaders(hdr)
	}
	return status, v, hdr
}

func limitAnswer(kind LimitKind) (int, any, map[string]string) {
	retry := strconv.Itoa(int(RetryAfter / time.Second))
	primary := func(status int) (int, any, map[string]string) {
		reset := time.Now().Add(PrimaryReset).Unix()
		return status, map[string]string{
				"message":           "API rate limit exceeded for user ID 1. If you reach out to GitHub Support for help, please include the request ID.",
				"documentation_url": docPrimary, "status": strconv.Itoa(status),
			}, map[string]string{"X-RateLimit-Limit": strconv.Itoa(rateLimit), "X-RateLimit-Remaining": "0",
				"X-RateLimit-Used": strconv.Itoa(rateLimit), "X-RateLimit-Reset": strconv.FormatInt(reset, 10), "X-RateLimit-Resource": "core"}
	}
	secondary := func(status int, hdr map[string]string) (int, any, map[string]string) {
		return status, map[string]string{"message": msgSecondary, "documentation_url": docSecondary, "status": strconv.Itoa(status)}, hdr
	}
	switch kind {
	case PrimaryLimit:
		return primary(http.StatusForbidden)
	case PrimaryLimit429:
		return primary(http.StatusTooManyRequests)
	case SecondaryLimit:
		return secondary(http.StatusForbidden, map[string]string{"Retry-After": retry})
	case SecondaryNoRetryAfter:
		return secondary(http.StatusForbidden, nil)
	default:
		return secondary(http.StatusTooManyRequests, map[string]string{"Retry-After": retry})
	}
}

// route authenticates, authorises and dispatches.
func (f *Fake) route(req *http.Request, body []byte) (any, map[string]string, int, *apiError) {
	if v := req.Header.Get("X-GitHub-Api-Version"); v != "" && v != "2022-11-28" && v != "2026-03-10" {
		return nil, nil, 0, fail(http.StatusBadRequest, "Invalid API version: %s", v)
	}
	grants, aerr := f.auth(req.Header.Get("Authorization"))
	if aerr != nil {
		return nil, nil, 0, aerr
	}
	parts := strings.Split(strings.TrimPrefix(req.URL.Path, "/"), "/")
	if len(parts) < 3 || parts[0] != "repos" {
		return nil, nil, 0, notFound()
	}
	k := key(parts[1], parts[2])
	push, granted := grants[k]
	r, exists := f.repos[k]
	if !granted || !exists {
		// GitHub hides repositories a token cannot see.
		return nil, nil, 0, notFound()
	}
	rest := parts[3:]
	write := req.Method != http.MethodGet && req.Method != http.MethodHead
	if write && !push {
		perm := "contents=write"
		if len(rest) > 0 && rest[0] == "pulls" {
			perm = "pull_requests=write"
		}
		e := fail(http.StatusForbidden, "Resource not accessible by personal access token")
		e.header = map[string]string{"X-Accepted-GitHub-Permissions": perm}
		return nil, nil, 0, e
	}
	if write && r.archived {
		return nil, nil, 0, fail(http.StatusForbidden, "Repository was archived so is read-only.")
	}
	if write {
		if e := f.createContent(tokenOf(req.Header.Get("Authorization")), time.Now()); e != nil {
			return nil, nil, 0, e
		}
	}
	m := req.Method
	switch {
	case len(rest) == 0 && m == http.MethodGet:
		return f.getRepo(r, r.rolePush[tokenOf(req.Header.Get("Authorization"))]), nil, http.StatusOK, nil
	case len(rest) >= 3 && rest[0] == "git" && rest[1] == "ref" && m == http.MethodGet:
		return f.getRef(r, strings.Join(rest[2:], "/"))
	case len(rest) == 2 && rest[0] == "git" && rest[1] == "refs" && m == http.MethodPost:
		return f.createRef(r, body)
	case len(rest) >= 3 && rest[0] == "git" && rest[1] == "refs" && m == http.MethodPatch:
		return f.updateRef(r, strings.Join(rest[2:], "/"), body)
	case len(rest) == 2 && rest[0] == "git" && rest[1] == "blobs" && m == http.MethodPost:
		return f.createBlob(r, body)
	case len(rest) == 2 && rest[0] == "git" && rest[1] == "trees" && m == http.MethodPost:
		return f.createTree(r, body)
	case len(rest) == 2 && rest[0] == "git" && rest[1] == "commits" && m == http.MethodPost:
		return f.createCommit(r, body)
	case len(rest) == 3 && rest[0] == "git" && rest[1] == "commits" && m == http.MethodGet:
		c, ok := r.commits[rest[2]]
		if !ok {
			return nil, nil, 0, notFound()
		}
		return f.commitJSON(r, c), nil, http.StatusOK, nil
	case len(rest) == 1 && rest[0] == "pulls" && m == http.MethodPost:
		return f.createPull(r, body)
	case len(rest) == 1 && rest[0] == "pulls" && m == http.MethodGet:
		return f.listPulls(r, req)
	case len(rest) >= 1 && rest[0] == "contents" && m == http.MethodGet:
		return f.getContents(r, strings.Join(rest[1:], "/"), req.URL.Query().Get("ref"))
	}
	return nil, nil, 0, notFound()
}

// tokenOf is the token in an Authorization header ("" if none).
func tokenOf(h string) string {
	for _, scheme := range []string{"Bearer ", "token "} {
		if strings.HasPrefix(h, scheme) {
			return strings.TrimPrefix(h, scheme)
		}
	}
	return ""
}

func (f *Fake) auth(h string) (map[string]bool, *apiError) {
	if h == "" {
		return nil, fail(http.StatusUnauthorized, "Requires authentication")
	}
	tok := tokenOf(h)
	if tok == "" {
		return nil, fail(http.StatusUnauthorized, "Bad credentials")
	}
	grants, ok := f.tokens[tok]
	if exp, expires := f.expiry[tok]; !ok || expires && !time.Now().Before(exp) {
		return nil, fail(http.StatusUnauthorized, "Bad credentials")
	}
	return grants, nil
}

// decode reads a JSON body strictly, as GitHub's schema validation does:
// syntax errors are 400 "Problems parsing JSON"; unknown keys and values of
// the wrong type are 422 "Invalid request".
func decode(body []byte, v any) *apiError {
	if !json.Valid(body) {
		return fail(http.StatusBadRequest, "Problems parsing JSON")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var te *json.UnmarshalTypeError
		msg := err.Error()
		switch {
		case errors.As(err, &te):
			msg = fmt.Sprintf("For '%s', %s is not %s.", te.Field, te.Value, jsonKind(te.Type.Kind()))
		case strings.HasPrefix(msg, "json: unknown field "):
			msg = strings.TrimPrefix(msg, "json: unknown field ") + " is not a permitted key."
		}
		return fail(http.StatusUnprocessableEntity, "Invalid request.\n\n%s", msg)
	}
	return nil
}

func jsonKind(k reflect.Kind) string {
	switch k {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Pointer:
		return "a valid value"
	}
	return "a number"
}

func (f *Fake) base(r *repo) string {
	return f.srv.URL + "/repos/" + r.owner + "/" + r.name
}

func (f *Fake) getRepo(r *repo, push bool) any {
	return map[string]any{
		"id": r.id, "node_id": fmt.Sprintf("R_%d", r.id), "name": r.name, "full_name": r.owner + "/" + r.name,
		"private": true, "owner": map[string]any{"login": r.owner, "id": 1, "type": "User"},
		"html_url": "https://github.com/" + r.owner + "/" + r.name, "url": f.base(r),
		"default_branch": r.defaultBranch, "archived": r.archived, "visibility": "private",
		"permissions": map[string]bool{"admin": false, "maintain": false, "push": push, "triage": push, "pull": true},
	}
}

func (f *Fake) refJSON(r *repo, ref, sha string) any {
	return map[string]any{"ref": ref, "node_id": "REF_" + sha[:8], "url": f.base(r) + "/git/" + ref,
		"object": map[string]string{"type": "commit", "sha": sha, "url": f.base(r) + "/git/commits/" + sha}}
}

func (f *Fake) getRef(r *repo, ref string) (any, map[string]string, int, *apiError) {
	sha, ok := r.refs["refs/"+ref]
	if !ok {
		return nil, nil, 0, notFound()
	}
	return f.refJSON(r, "refs/"+ref, sha), nil, http.StatusOK, nil
}

// validRefName is a compact git check-ref-format for the fake.
func validRefName(ref string) bool {
	if !strings.HasPrefix(ref, "refs/") || strings.Count(ref, "/") < 2 || strings.HasSuffix(ref, "/") ||
		strings.Contains(ref, "..") || strings.Contains(ref, "//") || strings.HasSuffix(ref, ".lock") || strings.Contains(ref, "@{") {
		return false
	}
	for _, c := range ref {
		if c <= ' ' || c == 0x7f || strings.ContainsRune("~^:?*[\\", c) {
			return false
		}
	}
	return true
}

func (f *Fake) createRef(r *repo, body []byte) (any, map[string]string, int, *apiError) {
	var in struct {
		Ref *string `json:"ref"`
		SHA *string `json:"sha"`
	}
	if e := decode(body, &in); e != nil {
		return nil, nil, 0, e
	}
	if in.Ref == nil || in.SHA == nil {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid request.\n\n\"ref\" and \"sha\" are required.")
	}
	if !validRefName(*in.Ref) {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "%s is not a valid ref name.", *in.Ref)
	}
	if _, ok := r.commits[*in.SHA]; !ok {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Object does not exist")
	}
	if _, ok := r.refs[*in.Ref]; ok {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Reference already exists")
	}
	r.refs[*in.Ref] = *in.SHA
	return f.refJSON(r, *in.Ref, *in.SHA), nil, http.StatusCreated, nil
}

func (f *Fake) updateRef(r *repo, ref string, body []byte) (any, map[string]string, int, *apiError) {
	var in struct {
		SHA   *string `json:"sha"`
		Force *bool   `json:"force"`
	}
	if e := decode(body, &in); e != nil {
		return nil, nil, 0, e
	}
	if in.SHA == nil {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid request.\n\n\"sha\" wasn't supplied.")
	}
	full := "refs/" + ref
	old, ok := r.refs[full]
	if !ok {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Reference does not exist")
	}
	if _, ok := r.commits[*in.SHA]; !ok {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Object does not exist")
	}
	if (in.Force == nil || !*in.Force) && !r.isAncestor(old, *in.SHA) {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Update is not a fast forward")
	}
	r.refs[full] = *in.SHA
	return f.refJSON(r, full, *in.SHA), nil, http.StatusOK, nil
}

func (f *Fake) createBlob(r *repo, body []byte) (any, map[string]string, int, *apiError) {
	var in struct {
		Content  *string `json:"content"`
		Encoding *string `json:"encoding"`
	}
	if e := decode(body, &in); e != nil {
		return nil, nil, 0, e
	}
	if in.Content == nil {
		return nil, nil, 0, invalid("Blob", "content", "missing_field")
	}
	data := []byte(*in.Content)
	enc := "utf-8"
	if in.Encoding != nil {
		enc = *in.Encoding
	}
	switch enc {
	case "utf-8":
	case "base64":
		var err error
		if data, err = base64.StdEncoding.DecodeString(*in.Content); err != nil {
			return nil, nil, 0, invalid("Blob", "content", "invalid")
		}
	default:
		return nil, nil, 0, invalid("Blob", "encoding", "invalid")
	}
	sha := r.putBlob(data)
	return map[string]string{"sha": sha, "url": f.base(r) + "/git/blobs/" + sha}, nil, http.StatusCreated, nil
}

type treeEntryIn struct {
	Path    *string         `json:"path"`
	Mode    *string         `json:"mode"`
	Type    *string         `json:"type"`
	SHA     json.RawMessage `json:"sha"`
	Content *string         `json:"content"`
}

func validTreePath(p string) bool {
	if p == "" || strings.HasPrefix(p, "/") || strings.HasSuffix(p, "/") {
		return false
	}
	for _, c := range strings.Split(p, "/") {
		if c == "" || c == "." || c == ".." || c == ".git" || strings.ContainsRune(c, 0) {
			return false
		}
	}
	return true
}

func (f *Fake) createTree(r *repo, body []byte) (any, map[string]string, int, *apiError) {
	var in struct {
		BaseTree *string       `json:"base_tree"`
		Tree     []treeEntryIn `json:"tree"`
	}
	if e := decode(body, &in); e != nil {
		return nil, nil, 0, e
	}
	if in.Tree == nil {
		return nil, nil, 0, invalid("Tree", "tree", "missing_field")
	}
	files := map[string]string{}
	if in.BaseTree != nil {
		base, ok := r.trees[*in.BaseTree]
		if !ok {
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid tree info: base_tree %s does not exist", *in.BaseTree)
		}
		for p, s := range base {
			files[p] = s
		}
	}
	for i, e := range in.Tree {
		if e.Path == nil || !validTreePath(*e.Path) {
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "tree.path contains a malformed path component (entry %d)", i)
		}
		if e.Mode == nil || *e.Mode != "100644" && *e.Mode != "100755" {
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid tree info: tree.mode must be a file mode (entry %d)", i)
		}
		if e.Type == nil || *e.Type != "blob" {
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid tree info: tree.type must be blob (entry %d)", i)
		}
		hasSHA := len(e.SHA) > 0
		isNull := hasSHA && string(e.SHA) == "null"
		switch {
		case hasSHA && !isNull && e.Content != nil, !hasSHA && e.Content == nil:
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Must supply either tree.sha or tree.content (entry %d)", i)
		case isNull && e.Content == nil:
			delete(files, *e.Path)
		case e.Content != nil:
			files[*e.Path] = r.putBlob([]byte(*e.Content))
		default:
			var sha string
			if err := json.Unmarshal(e.SHA, &sha); err != nil {
				return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid request.\n\ntree.sha must be a string (entry %d)", i)
			}
			if _, ok := r.blobs[sha]; !ok {
				return nil, nil, 0, fail(http.StatusUnprocessableEntity, "tree.sha %s is not a valid blob", sha)
			}
			files[*e.Path] = sha
		}
	}
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for i := 1; i < len(paths); i++ {
		if strings.HasPrefix(paths[i], paths[i-1]+"/") {
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid tree info: %s is both a file and a directory", paths[i-1])
		}
	}
	sha := r.putTree(files)
	entries := []map[string]any{}
	for _, p := range paths {
		entries = append(entries, map[string]any{"path": p, "mode": "100644", "type": "blob", "sha": files[p],
			"size": len(r.blobs[files[p]]), "url": f.base(r) + "/git/blobs/" + files[p]})
	}
	return map[string]any{"sha": sha, "url": f.base(r) + "/git/trees/" + sha, "tree": entries, "truncated": false},
		nil, http.StatusCreated, nil
}

type person struct {
	Name  *string `json:"name"`
	Email *string `json:"email"`
	Date  *string `json:"date"`
}

func (f *Fake) createCommit(r *repo, body []byte) (any, map[string]string, int, *apiError) {
	var in struct {
		Message   *string  `json:"message"`
		Tree      *string  `json:"tree"`
		Parents   []string `json:"parents"`
		Author    *person  `json:"author"`
		Committer *person  `json:"committer"`
		Signature *string  `json:"signature"`
	}
	if e := decode(body, &in); e != nil {
		return nil, nil, 0, e
	}
	if in.Message == nil || in.Tree == nil {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid request.\n\n\"message\" and \"tree\" are required.")
	}
	if _, ok := r.trees[*in.Tree]; !ok {
		return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Tree SHA does not exist")
	}
	for _, p := range in.Parents {
		if _, ok := r.commits[p]; !ok {
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Parent SHA does not exist or is not a commit object")
		}
	}
	sha := f.putCommit(r, *in.Tree, *in.Message, in.Parents)
	return f.commitJSON(r, r.commits[sha]), nil, http.StatusCreated, nil
}

func (f *Fake) commitJSON(r *repo, c *Commit) any {
	parents := []map[string]string{}
	for _, p := range c.Parents {
		parents = append(parents, map[string]string{"sha": p, "url": f.base(r) + "/git/commits/" + p})
	}
	who := map[string]string{"name": "Fake User", "email": "fake@example.invalid", "date": "2026-01-01T00:00:00Z"}
	return map[string]any{"sha": c.SHA, "node_id": "C_" + c.SHA[:8], "url": f.base(r) + "/git/commits/" + c.SHA,
		"html_url": "https://github.com/" + r.owner + "/" + r.name + "/commit/" + c.SHA,
		"author":   who, "committer": who, "message": c.Message,
		"tree":    map[string]string{"sha": c.Tree, "url": f.base(r) + "/git/trees/" + c.Tree},
		"parents": parents, "verification": map[string]any{"verified": false, "reason": "unsigned"}}
}

func (f *Fake) pullJSON(r *repo, p *PullRequest) any {
	return map[string]any{"id": 5000 + p.Number, "number": p.Number, "state": p.State, "title": p.Title, "body": p.Body,
		"html_url": p.HTMLURL, "url": f.base(r) + "/pulls/" + strconv.Itoa(p.Number), "draft": false,
		"head": map[string]any{"ref": p.Head, "sha": r.refs["refs/heads/"+p.Head], "label": r.owner + ":" + p.Head},
		"base": map[string]any{"ref": p.Base, "sha": r.refs["refs/heads/"+p.Base], "label": r.owner + ":" + p.Base}}
}

func (f *Fake) createPull(r *repo, body []byte) (any, map[string]string, int, *apiError) {
	var in struct {
		Title               *string `json:"title"`
		Head                *string `json:"head"`
		HeadRepo            *string `json:"head_repo"`
		Base                *string `json:"base"`
		Body                *string `json:"body"`
		Issue               *int    `json:"issue"`
		MaintainerCanModify *bool   `json:"maintainer_can_modify"`
		Draft               *bool   `json:"draft"`
	}
	if e := decode(body, &in); e != nil {
		return nil, nil, 0, e
	}
	if in.Head == nil || in.Base == nil {
		return nil, nil, 0, invalid("PullRequest", "head", "missing_field")
	}
	if in.Title == nil || strings.TrimSpace(*in.Title) == "" {
		return nil, nil, 0, invalid("PullRequest", "title", "missing_field")
	}
	head := *in.Head
	if owner, branch, ok := strings.Cut(head, ":"); ok {
		if !strings.EqualFold(owner, r.owner) {
			return nil, nil, 0, invalid("PullRequest", "head", "invalid")
		}
		head = branch
	}
	headSHA, ok := r.refs["refs/heads/"+head]
	if !ok {
		return nil, nil, 0, invalid("PullRequest", "head", "invalid")
	}
	baseSHA, ok := r.refs["refs/heads/"+*in.Base]
	if !ok {
		return nil, nil, 0, invalid("PullRequest", "base", "invalid")
	}
	for _, p := range r.pulls {
		if p.State == "open" && p.Head == head && p.Base == *in.Base {
			e := invalid("PullRequest", "", "custom")
			e.errors[0]["message"] = "A pull request already exists for " + r.owner + ":" + head + "."
			return nil, nil, 0, e
		}
	}
	if r.isAncestor(headSHA, baseSHA) {
		e := invalid("PullRequest", "", "custom")
		e.errors[0]["message"] = "No commits between " + *in.Base + " and " + head
		return nil, nil, 0, e
	}
	p := &PullRequest{Number: len(r.pulls) + 1, Title: *in.Title, Head: head, Base: *in.Base, State: "open"}
	if in.Body != nil {
		p.Body = *in.Body
	}
	p.HTMLURL = "https://github.com/" + r.owner + "/" + r.name + "/pull/" + strconv.Itoa(p.Number)
	r.pulls = append(r.pulls, p)
	return f.pullJSON(r, p), nil, http.StatusCreated, nil
}

// listPulls is stricter than GitHub in one way, on purpose: GitHub ignores
// query parameters it does not know, which would hide a misspelt filter
// (and list every pull request); the fake refuses them.
func (f *Fake) listPulls(r *repo, req *http.Request) (any, map[string]string, int, *apiError) {
	q := req.URL.Query()
	for k := range q {
		switch k {
		case "state", "head", "base", "sort", "direction", "per_page", "page":
		default:
			return nil, nil, 0, fail(http.StatusUnprocessableEntity, "Invalid request.\n\nUnknown parameter %q.", k)
		}
	}
	state := q.Get("state")
	if state == "" {
		state = "open"
	}
	if state != "open" && state != "closed" && state != "all" {
		return nil, nil, 0, invalid("PullRequest", "state", "invalid")
	}
	out := []any{}
	for _, p := range r.pulls {
		if state != "all" && p.State != state {
			continue
		}
		if h := q.Get("head"); h != "" {
			owner, branch, ok := strings.Cut(h, ":")
			if !ok || !strings.EqualFold(owner, r.owner) || branch != p.Head {
				continue
			}
		}
		if b := q.Get("base"); b != "" && b != p.Base {
			continue
		}
		out = append(out, f.pullJSON(r, p))
	}
	return out, nil, http.StatusOK, nil
}

func (f *Fake) getContents(r *repo, path, ref string) (any, map[string]string, int, *apiError) {
	if ref == "" {
		ref = r.defaultBranch
	}
	sha := r.resolve(ref)
	if sha == "" {
		e := fail(http.StatusNotFound, "No commit found for the ref %s", ref)
		return nil, nil, 0, e
	}
	files := r.trees[r.commits[sha].Tree]
	url := f.base(r) + "/contents/" + path + "?ref=" + ref
	if blob, ok := files[path]; ok {
		data := r.blobs[blob]
		out := map[string]any{"type": "file", "size": len(data), "name": path[strings.LastIndex(path, "/")+1:],
			"path": path, "sha": blob, "url": url, "git_url": f.base(r) + "/git/blobs/" + blob,
			"html_url":     "https://github.com/" + r.owner + "/" + r.name + "/blob/" + ref + "/" + path,
			"download_url": "https://raw.githubusercontent.com/" + r.owner + "/" + r.name + "/" + ref + "/" + path}
		if len(data) > maxContentSize {
			out["encoding"], out["content"] = "none", ""
		} else {
			out["encoding"], out["content"] = "base64", wrap60(base64.StdEncoding.EncodeToString(data))
		}
		return out, nil, http.StatusOK, nil
	}
	// A directory: list its direct children.
	prefix := path + "/"
	if path == "" {
		prefix = ""
	}
	seen := map[string]bool{}
	list := []any{}
	for p, blob := range files {
		if !strings.HasPrefix(p, prefix) {
			continue
		}
		child, _, isDir := strings.Cut(p[len(prefix):], "/")
		if seen[child] {
			continue
		}
		seen[child] = true
		typ := "file"
		if isDir {
			typ, blob = "dir", ""
		}
		list = append(list, map[string]any{"type": typ, "name": child, "path": prefix + child, "sha": blob})
	}
	if len(list) == 0 {
		return nil, nil, 0, notFound()
	}
	return list, nil, http.StatusOK, nil
}

// wrap60 breaks base64 into lines of 60 as the contents API does.
func wrap60(s string) string {
	var b strings.Builder
	for len(s) > 60 {
		b.WriteString(s[:60])
		b.WriteByte('\n')
		s = s[60:]
	}
	b.WriteString(s)
	b.WriteByte('\n')
	return b.String()
}
