package github_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

func tenFiles(tag string) map[string][]byte {
	files := map[string][]byte{}
	for i := range github.MaxFiles {
		files[fmt.Sprintf("src/f%d.txt", i)] = []byte(fmt.Sprintf("%s file %d, naïve ✓\n", tag, i))
	}
	return files
}

func writes(reqs []ghfake.Request) []string {
	var out []string
	for _, r := range reqs {
		if r.Method != "GET" {
			out = append(out, r.Method+" "+r.Path[strings.Index(r.Path, "/git/")+1:])
		}
	}
	return out
}

// Text files travel inline in the tree: a 10-file commit is three
// mutating requests, not ten blob POSTs before them.
func TestTextFilesGoInlineInTheTree(t *testing.T) {
	e := setup(t, true)
	files := tenFiles("inline")
	files["src/empty.txt"] = nil // within MaxFiles once one is dropped
	delete(files, "src/f9.txt")
	if _, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch, Files: files, Message: "m"}); err != nil {
		t.Fatal(err)
	}
	reqs := e.fake.Requests()
	if got, want := strings.Join(writes(reqs), ", "), "POST git/trees, POST git/commits, POST git/refs"; got != want {
		t.Fatalf("writes: %s, want %s", got, want)
	}
	var tree struct {
		Tree []struct {
			Path    string
			SHA     *string
			Content *string
		}
	}
	for _, r := range reqs {
		if strings.HasSuffix(r.Path, "/git/trees") {
			_ = json.Unmarshal(r.Body, &tree)
		}
	}
	if len(tree.Tree) != len(files) {
		t.Fatalf("%d tree entries", len(tree.Tree))
	}
	for _, en := range tree.Tree {
		if en.SHA != nil || en.Content == nil || *en.Content != string(files[en.Path]) {
			t.Errorf("entry %s: sha %v content %v", en.Path, en.SHA, en.Content)
		}
	}
	got, _ := e.fake.Files(owner, name, branch)
	for p, b := range files {
		if string(got[p]) != string(b) {
			t.Errorf("%s = %q, want %q", p, got[p], b)
		}
	}
	// Binary files (invalid UTF-8, or NUL) need blobs, one after another.
	e.fake.ResetRequests()
	bin := map[string][]byte{"a.bin": {0xff, 0xfe}, "b.bin": []byte("nul\x00inside"), "c.txt": []byte("text")}
	if _, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch, Files: bin, Message: "m"}); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(writes(e.fake.Requests()), ", "), "POST git/blobs, POST git/blobs, POST git/trees, POST git/commits, PATCH git/refs/heads/sandbox/feature"; got != want {
		t.Fatalf("writes: %s, want %s", got, want)
	}
	got, _ = e.fake.Files(owner, name, branch)
	for p, b := range bin {
		if string(got[p]) != string(b) {
			t.Errorf("%s = %q, want %q", p, got[p], b)
		}
	}
}

// GitHub allows about 80 content-generating requests a minute (the fake
// enforces it). Eight 10-file commits in a row must all land: with a blob
// per file they would be 13 writes each, 104 in all.
func TestTenFileCommitsStayUnderTheContentCreationLimit(t *testing.T) {
	e := setup(t, true)
	for i := range 8 {
		if _, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
			Files: tenFiles(fmt.Sprint(i)), Message: fmt.Sprintf("c%d", i)}); err != nil {
			t.Fatalf("commit %d: %v", i, err)
		}
	}
	if n := len(writes(e.fake.Requests())); n != 8*3 {
		t.Fatalf("%d writes, want %d", n, 8*3)
	}
}

// Repos that share a token share its write lock: GitHub asks for one
// user's requests to be serial, and the fake refuses a concurrent write.
// While a commit to one repo holds the lock, a commit to the other waits
// for it and writes nothing.
func TestCommitsSharingATokenAreSerial(t *testing.T) {
	const list = `[{"repo_id":"widgets","owner":"acme","name":"widgets","allowed_branches":["sandbox/*"],"base_branch":"main","token_env":"WIDGETS_TOKEN"},
		{"repo_id":"gadgets","owner":"acme","name":"gadgets","allowed_branches":["sandbox/*"],"base_branch":"main","token_env":"WIDGETS_TOKEN"}]`
	e := setupWith(t, list, map[string]string{env: token}, func(f *ghfake.Fake) {
		f.AddRepo(owner, "gadgets")
		f.Grant(token, owner, "gadgets", true)
	})
	// Both repos have had their write check, so the second commit would
	// go straight to its writes.
	for _, id := range []string{repoID, "gadgets"} {
		if _, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: id, Branch: "sandbox/warm",
			Files: map[string][]byte{"w.txt": []byte("w")}, Message: "m"}); err != nil {
			t.Fatal(err)
		}
	}
	inTree := make(chan struct{})
	release := make(chan struct{})
	var releaseOnce, once sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before the fake's Close, which waits for the held request
	e.fake.OnRequest(func(method, path string) {
		if method == "POST" && strings.HasSuffix(path, "/widgets/git/trees") {
			once.Do(func() { close(inTree); <-release })
		}
	})
	first := make(chan error, 1)
	go func() {
		_, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: repoID, Branch: branch,
			Files: map[string][]byte{"a.txt": []byte("a")}, Message: "m"})
		first <- err
	}()
	<-inTree
	e.fake.ResetRequests()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err := e.m.Commit(ctx, github.CommitRequest{RepoID: "gadgets", Branch: branch,
		Files: map[string][]byte{"b.txt": []byte("b")}, Message: "m"})
	cancel()
	wantCode(t, err, brokererr.Unavailable)
	if reqs := e.fake.Requests(); len(reqs) != 0 {
		t.Fatalf("the second commit reached GitHub while the first held the token: %v", calls(reqs))
	}
	unblock()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Commit(context.Background(), github.CommitRequest{RepoID: "gadgets", Branch: branch,
		Files: map[string][]byte{"b.txt": []byte("b")}, Message: "m"}); err != nil {
		t.Fatal(err)
	}
}
