package docker

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

func ownerOf(t testing.TB, p string) int {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	if st.Uid != st.Gid {
		t.Fatalf("%s owned by %d:%d", p, st.Uid, st.Gid)
	}
	return int(st.Uid)
}

// runUID runs code that reports the sandbox's uid and gid and writes a file,
// and checks the container, the host file and the lease agree.
func runUID(t *testing.T, e *Engine, s sandbox.Session, lang, file string) int {
	t.Helper()
	code := map[string]string{
		"python": fmt.Sprintf("import os\nopen(%q, 'w').write('x')\nprint(os.getuid(), os.getgid())", file),
		"bash":   fmt.Sprintf("echo x > %q; echo $(id -u) $(id -g)", file),
	}[lang]
	res := exec1(t, s, lang, code, 20*time.Second)
	var uid, gid int
	if _, err := fmt.Sscan(string(res.Stdout), &uid, &gid); err != nil || uid != gid || res.ExitCode != 0 {
		t.Fatalf("%s run: %+v %s", lang, res, res.Stderr)
	}
	ss := s.(*Session)
	if c := sessionContainerOf(t, ss, lang); c.uid != uid {
		t.Fatalf("container records uid %d, runs as %d", c.uid, uid)
	}
	if got := ownerOf(t, filepath.Join(ss.ref.Dir, file)); got != uid {
		t.Fatalf("file written by the sandbox owned by %d, sandbox uid %d", got, uid)
	}
	if leased, err := e.o.UIDs.Lease(context.Background(), ss.ref.WorkspaceID); err != nil || leased != uid {
		t.Fatalf("workspace leases uid %d (%v), sandbox runs as %d", leased, err, uid)
	}
	if uid < testUIDBase || uid >= testUIDBase+testUIDs {
		t.Fatalf("uid %d outside the sandbox range", uid)
	}
	return uid
}

func sessionContainerOf(t testing.TB, s *Session, lang string) *ctr {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.ctrs[lang]
	if c == nil {
		t.Fatalf("session has no %s container", lang)
	}
	return c
}

// Each session's containers run as a host uid of its own, whether claimed
// from the warm pool or started cold; a session keeps its uid across a
// broker restart, and a workspace left by the old shared uid 1000 is given
// to its session's uid.
func TestSessionsRunAsTheirOwnUIDs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("workspace ownership needs a root broker")
	}
	e := newEngine(t, func(o *Options) { o.PoolSize = 1; o.Languages = []string{"python", "bash"} })
	needRunner(t, e, "python")
	needRunner(t, e, "bash")
	waitPoolReady(t, e, "python", 1)
	ctx := context.Background()

	ref1, ref2 := newRef(e), newRef(e)
	s1, _ := e.Open(ctx, ref1)
	u1 := runUID(t, e, s1, "python", "a.txt") // a pool claim
	if st := e.Stats(); st.Claims != 1 {
		t.Fatalf("stats %+v, want a claim", st)
	}
	s2, _ := e.Open(ctx, ref2)
	if err := s2.WriteFile(ctx, "in.txt", []byte("B"), false); err != nil {
		t.Fatal(err)
	}
	u2 := runUID(t, e, s2, "python", "b.txt") // a cold start: the workspace has files
	if u1 == u2 {
		t.Fatalf("two live sessions share uid %d", u1)
	}
	if got := ownerOf(t, filepath.Join(ref2.Dir, "in.txt")); got != u2 {
		t.Fatalf("file written by the broker owned by %d, want %d", got, u2)
	}
	// A second language of a session runs as the session's uid.
	if u := runUID(t, e, s1, "bash", "c.txt"); u != u1 {
		t.Fatalf("bash runs as %d, python as %d", u, u1)
	}
	// The refilled warm container has a uid of its own.
	waitPoolReady(t, e, "python", 1)
	p := e.pools["python"]
	p.mu.Lock()
	warm := p.ready[0].uid
	p.mu.Unlock()
	if warm == u1 || warm == u2 {
		t.Fatalf("warm container runs as a session's uid %d", warm)
	}

	// A workspace from before per-session uids: everything owned by 1000.
	ref3 := newRef(e)
	w, err := workspace.Create(ref3.Dir, workspace.WithOwner(1000, 1000))
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write("old/notes.txt", []byte("old"), false); err != nil {
		t.Fatal(err)
	}
	w.Close()

	// Restart: a new engine on the same root and state database.
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}
	e2, err := New(ctx, Options{Root: e.o.Root, AgentBinary: agentBinary, InstanceID: "restarted",
		UIDs: newUIDs(t, e.o.Root), Languages: []string{"python", "bash"}, Log: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e2.Close(context.Background()) })
	s1b, _ := e2.Open(ctx, ref1)
	res := exec1(t, s1b, "bash", "cat a.txt c.txt && echo more >> a.txt && echo ok", 20*time.Second)
	if string(res.Stdout) != "xx\nok\n" {
		t.Fatalf("after restart: %+v %s", res, res.Stderr)
	}
	if u := runUID(t, e2, s1b, "bash", "d.txt"); u != u1 {
		t.Fatalf("session ran as %d, after the restart as %d", u1, u)
	}
	s3, _ := e2.Open(ctx, ref3)
	res = exec1(t, s3, "bash", "cat old/notes.txt && echo new > old/notes.txt && mkdir old/sub && echo ok", 20*time.Second)
	if string(res.Stdout) != "oldok\n" {
		t.Fatalf("old workspace: %+v %s", res, res.Stderr)
	}
	u3 := runUID(t, e2, s3, "bash", "e.txt")
	for _, rel := range []string{"", "old", "old/notes.txt"} {
		if got := ownerOf(t, filepath.Join(ref3.Dir, rel)); got != u3 {
			t.Errorf("%q of the old workspace owned by %d, want %d", rel, got, u3)
		}
	}
	if u3 == u1 || u3 == u2 {
		t.Fatalf("old workspace shares uid %d", u3)
	}
	// Destroy frees the uid; the next lease does not hand it out at once.
	if err := s3.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if next, err := e2.o.UIDs.Lease(ctx, "someone-new"); err != nil || next == u3 {
		t.Fatalf("next lease %d (%v) right after freeing %d", next, err, u3)
	}
}

// The live-container cap counts warm containers and sessions' ones: a
// session's cold start takes a warm container's place, and with none left
// it is refused with a retryable QUOTA_EXCEEDED that says when a session may
// go idle. Destroying a session makes room again.
func TestContainerCap(t *testing.T) {
	slots := sandbox.NewSlots(2)
	e := newEngine(t, func(o *Options) {
		o.PoolSize = 1
		o.Languages = []string{"python", "bash"}
		o.Slots = slots
		o.IdleTimeout = 10 * time.Minute
	})
	needRunner(t, e, "python")
	needRunner(t, e, "bash")
	ctx := context.Background()
	waitFor(t, 90*time.Second, "both warm containers", func() bool {
		st := e.Stats()
		return st.PoolReady["python"] == 1 && st.PoolReady["bash"] == 1
	})
	live := func() int {
		n := 0
		for _, c := range listContainers(t, e.cli, LabelRoot+"="+e.o.Root) {
			if c.State == "running" || c.State == "restarting" {
				n++
			}
		}
		return n
	}
	if n := live(); n != 2 || slots.InUse() != 2 {
		t.Fatalf("%d containers, %d slots held, want 2", n, slots.InUse())
	}
	a, _ := e.Open(ctx, newRef(e))
	exec1(t, a, "bash", "true", 20*time.Second) // claims the warm bash container
	b, _ := e.Open(ctx, newRef(e))
	exec1(t, b, "bash", "true", 20*time.Second) // cold: evicts the warm python one
	if n := live(); n != 2 || slots.InUse() != 2 {
		t.Fatalf("%d containers, %d slots held after eviction, want 2", n, slots.InUse())
	}
	c, _ := e.Open(ctx, newRef(e))
	_, err := c.Exec(ctx, sandbox.ExecRequest{Language: "python", Code: "print(1)", Timeout: 10 * time.Second})
	be := brokererr.As(err)
	if be == nil || be.Code != brokererr.QuotaExceeded || !be.Retryable {
		t.Fatalf("at the cap: %v, want a retryable QUOTA_EXCEEDED", err)
	}
	if be.RetryAfter < 9*time.Minute || be.RetryAfter > 10*time.Minute {
		t.Fatalf("retry after %v, want about the idle timeout", be.RetryAfter)
	}
	if n := live(); n != 2 {
		t.Fatalf("%d containers after a refusal, want 2", n)
	}
	if err := a.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	res := exec1(t, c, "python", "print(1)", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "1" {
		t.Fatalf("after room was made: %+v", res)
	}
	if n := live(); n > 2 {
		t.Fatalf("%d containers, cap 2", n)
	}
}
