package ghfake

import (
	"net/http"
	"strconv"
	"time"
)

// GitHub's published secondary limits on content creation ("Rate limits
// for the REST API", about secondary rate limits): in general no more
// than 80 content-generating requests a minute and 500 an hour. The fake
// counts every POST, PATCH, PUT and DELETE of a token against them.
const (
	ContentPerMinute = 80
	ContentPerHour   = 500
)

// ExpiryHeader carries a fine-grained token's expiry on GitHub's answers,
// in ExpiryLayout ("2026-03-01 12:00:00 UTC").
const (
	ExpiryHeader = "GitHub-Authentication-Token-Expiration"
	ExpiryLayout = "2006-01-02 15:04:05 UTC"
)

func mutating(method string) bool {
	switch method {
	case http.MethodPost, http.MethodPatch, http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}

// enter counts a request of tok in flight (under f.mu). concurrent is set
// when it is a write and another write of tok is still being answered:
// GitHub asks clients to make requests serially ("Best practices for
// using the REST API": avoid concurrent requests) and may answer a burst
// with a secondary rate limit; the fake always does, so a client that
// writes concurrently fails its tests. leave ends the request (under
// f.mu).
func (f *Fake) enter(tok, method string) (concurrent bool, leave func()) {
	if tok == "" || !mutating(method) {
		return false, func() {}
	}
	concurrent = f.inflight[tok] > 0
	f.inflight[tok]++
	done := false
	return concurrent, func() {
		if !done {
			done = true
			if f.inflight[tok]--; f.inflight[tok] == 0 {
				delete(f.inflight, tok)
			}
		}
	}
}

// createContent counts one content-generating request of tok at now, or
// refuses it with GitHub's secondary limit answer while the token is over
// ContentPerMinute or ContentPerHour (under f.mu).
func (f *Fake) createContent(tok string, now time.Time) *apiError {
	times := f.created[tok]
	for len(times) > 0 && now.Sub(times[0]) >= time.Hour {
		times = times[1:]
	}
	inMinute := 0
	for _, t := range times {
		if now.Sub(t) < time.Minute {
			inMinute++
		}
	}
	var wait time.Duration
	switch {
	case len(times) >= ContentPerHour:
		wait = times[len(times)-ContentPerHour].Add(time.Hour).Sub(now)
	case inMinute >= ContentPerMinute:
		wait = times[len(times)-ContentPerMinute].Add(time.Minute).Sub(now)
	}
	f.created[tok] = times
	if wait > 0 {
		e := fail(http.StatusForbidden, msgSecondary)
		e.docURL = docSecondary
		e.header = map[string]string{"Retry-After": strconv.Itoa(int((wait + time.Second - 1) / time.Second))}
		return e
	}
	f.created[tok] = append(times, now)
	return nil
}

// SetTokenExpiry makes token expire at t: answers carry ExpiryHeader, and
// from t on the token gets 401 Bad credentials.
func (f *Fake) SetTokenExpiry(token string, t time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.expiry[token] = t
}

// AddTag commits files on top of main's head, on no branch, and tags that
// commit tag (a lightweight tag). It returns the commit SHA.
func (f *Fake) AddTag(owner, name, tag string, files map[string]string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.mustRepo(owner, name)
	parent := r.refs["refs/heads/main"]
	tree := map[string]string{}
	for p, s := range r.trees[r.commits[parent].Tree] {
		tree[p] = s
	}
	for p, c := range files {
		tree[p] = r.putBlob([]byte(c))
	}
	c := f.putCommit(r, r.putTree(tree), "tagged "+tag, []string{parent})
	r.refs["refs/tags/"+tag] = c
	return c
}

// SetDefaultBranch makes branch the repository's default branch, creating
// it at main's head if it does not exist.
func (f *Fake) SetDefaultBranch(owner, name, branch string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := f.mustRepo(owner, name)
	if _, ok := r.refs["refs/heads/"+branch]; !ok {
		r.refs["refs/heads/"+branch] = r.refs["refs/heads/main"]
	}
	r.defaultBranch = branch
}
