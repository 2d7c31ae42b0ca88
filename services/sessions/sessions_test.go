package sessions

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/docker"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/uids"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// clock is a settable time source, so reaping needs no sleeps.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// newManager runs against the real Docker engine with the real agent.
func newManager(t *testing.T, clk *clock, onCreate func(context.Context, string) error) (*Manager, string) {
	t.Helper()
	return newManagerOn(t, "", clk, onCreate)
}

// newManagerOn is newManager with the state in the store at loc ("" for
// state.db in the root).
func newManagerOn(t *testing.T, loc string, clk *clock, onCreate func(context.Context, string) error) (*Manager, string) {
	t.Helper()
	if err := exec.Command("docker", "info").Run(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("Docker is required in CI")
		}
		t.Skip("no Docker daemon")
	}
	root := t.TempDir()
	bin := filepath.Join(t.TempDir(), "sandbox-agent")
	build := exec.Command("go", "build", "-o", bin, "github.com/sandbox-broker/sandbox-broker/cmd/sandbox-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build agent: %v\n%s", err, out)
	}
	ctx := context.Background()
	if loc == "" {
		loc = filepath.Join(root, "state.db")
	}
	ids, err := uids.Open(ctx, loc, 1_900_000_000, 65536)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ids.Close() })
	eng, err := docker.New(ctx, docker.Options{Root: root, AgentBinary: bin, InstanceID: "sessions-test", UIDs: ids, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close(context.Background()) })
	m, err := Open(ctx, Options{DBPath: loc, Root: root, Backend: eng,
		IdleTimeout: 10 * time.Minute, MaxAge: time.Hour, OnCreate: onCreate, Now: clk.Now, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close(context.Background()) })
	return m, root
}

func containers(t *testing.T, root string) int {
	out, err := exec.Command("docker", "ps", "-aq", "--filter", "label=sandbox.root="+root).Output()
	if err != nil {
		t.Fatal(err)
	}
	return len(strings.Fields(string(out)))
}

func exec1(t *testing.T, l *Lease, code string) string {
	t.Helper()
	res, err := l.Session.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: code, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return string(res.Stdout)
}

func TestOwnershipAndGeneratedIDs(t *testing.T) { eachStore(t, testOwnershipAndGeneratedIDs) }

func testOwnershipAndGeneratedIDs(t *testing.T, loc func(testing.TB) string) {
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	var created []string
	m, _ := newManagerOn(t, loc(t), clk, func(_ context.Context, p string) error { created = append(created, p); return nil })
	ctx := context.Background()
	l, err := m.Acquire(ctx, "alice", "", true)
	if err != nil {
		t.Fatal(err)
	}
	if !IDPattern.MatchString(l.ID) || !strings.HasPrefix(l.ID, "sess_") || len(l.ID) != len("sess_")+12 || !l.Created {
		t.Fatalf("generated id %q created=%v", l.ID, l.Created)
	}
	exec1(t, l, "echo mine > f.txt")
	l.Release()
	if _, err := m.Acquire(ctx, "bob", l.ID, false); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatalf("bob reading alice's session: %v", err)
	}
	if err := m.Remove(ctx, "bob", l.ID); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatalf("bob removing alice's session: %v", err)
	}
	lb, err := m.Acquire(ctx, "bob", l.ID, true) // bob's own session of the same name
	if err != nil {
		t.Fatal(err)
	}
	if lb.WorkspaceID == l.WorkspaceID || strings.Contains(exec1(t, lb, "cat f.txt 2>&1"), "mine") {
		t.Fatal("bob's session shares alice's workspace")
	}
	lb.Release()
	// Each workspace names its owner (signed uploads audit under it).
	for _, c := range []struct{ wid, principal string }{{l.WorkspaceID, "alice"}, {lb.WorkspaceID, "bob"}} {
		if p, sid, err := m.Owner(ctx, c.wid); err != nil || p != c.principal || sid != l.ID {
			t.Errorf("Owner(%s) = %q %q %v, want %s", c.wid, p, sid, err, c.principal)
		}
	}
	if _, _, err := m.Owner(ctx, strings.Repeat("0", 32)); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Errorf("Owner of an unknown workspace: %v", err)
	}
	if len(created) != 2 || created[0] != "alice" || created[1] != "bob" {
		t.Fatalf("OnCreate calls = %v", created)
	}
	for _, bad := range []string{"../x", "a b", strings.Repeat("x", 65), "é"} {
		if _, err := m.Acquire(ctx, "alice", bad, true); brokererr.CodeOf(err) != brokererr.InvalidInput {
			t.Errorf("id %q: %v", bad, err)
		}
	}
}

func TestQuotaRefusalCreatesNothing(t *testing.T) {
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	m, root := newManager(t, clk, func(context.Context, string) error {
		return brokererr.New(brokererr.QuotaExceeded, "no more")
	})
	if _, err := m.Acquire(context.Background(), "alice", "s1", true); brokererr.CodeOf(err) != brokererr.QuotaExceeded {
		t.Fatalf("want QUOTA_EXCEEDED, got %v", err)
	}
	entries, _ := os.ReadDir(filepath.Join(root, "workspaces"))
	if len(entries) != 0 {
		t.Fatalf("workspace created despite the refusal: %v", entries)
	}
}

func TestReaperReleasesIdleAndExpiresOld(t *testing.T) {
	eachStore(t, testReaperReleasesIdleAndExpiresOld)
}

func testReaperReleasesIdleAndExpiresOld(t *testing.T, loc func(testing.TB) string) {
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	m, root := newManagerOn(t, loc(t), clk, nil)
	var reaped []Reaped // the operator view's feed; Reap calls it synchronously
	m.o.OnReap = func(r Reaped) { reaped = append(reaped, r) }
	ctx := context.Background()
	l, err := m.Acquire(ctx, "alice", "s1", true)
	if err != nil {
		t.Fatal(err)
	}
	exec1(t, l, "echo kept > f.txt")
	l.Release()
	if containers(t, root) != 1 {
		t.Fatalf("containers = %d, want 1", containers(t, root))
	}
	clk.Add(9 * time.Minute)
	m.Reap(ctx)
	if containers(t, root) != 1 {
		t.Fatal("released before the idle timeout")
	}
	clk.Add(2 * time.Minute)
	m.Reap(ctx)
	if containers(t, root) != 0 {
		t.Fatal("idle session kept its container")
	}
	if len(reaped) != 1 || reaped[0].Action != ReapIdleReleased || reaped[0].Principal != "alice" || reaped[0].SessionID != "s1" {
		t.Fatalf("reaper decisions %+v", reaped)
	}
	// Files survive idling, and the session comes back on use.
	l, err = m.Acquire(ctx, "alice", "s1", false)
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(exec1(t, l, "cat f.txt")); got != "kept" {
		t.Fatalf("after idle release: %q", got)
	}
	l.Release()
	busy, err := m.Acquire(ctx, "alice", "s2", true) // in use while the reaper runs: skipped, not reported
	if err != nil {
		t.Fatal(err)
	}
	clk.Add(time.Hour)
	m.Reap(ctx)
	busy.Release()
	if containers(t, root) != 0 {
		t.Fatal("expired session kept its container")
	}
	// s1 idled again before it expired; s2, in use, appears nowhere.
	last := reaped[len(reaped)-1]
	if len(reaped) != 3 || reaped[1].Action != ReapIdleReleased || last.Action != ReapExpired || last.SessionID != "s1" {
		t.Fatalf("reaper decisions %+v", reaped)
	}
	if _, err := os.Stat(m.WorkspaceDir(l.WorkspaceID)); !os.IsNotExist(err) {
		t.Fatalf("expired workspace still on disk: %v", err)
	}
	if _, err := m.Acquire(ctx, "alice", "s1", false); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatalf("expired session still acquirable: %v", err)
	}
}

func TestSessionsSurviveReopen(t *testing.T) { eachStore(t, testSessionsSurviveReopen) }

func testSessionsSurviveReopen(t *testing.T, loc func(testing.TB) string) {
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	m, root := newManagerOn(t, loc(t), clk, nil)
	ctx := context.Background()
	l, err := m.Acquire(ctx, "alice", "persist", true)
	if err != nil {
		t.Fatal(err)
	}
	wid := l.WorkspaceID
	exec1(t, l, "echo durable > d.txt")
	l.Release()
	if err := m.Close(ctx); err != nil {
		t.Fatal(err)
	}
	m2, err := Open(ctx, Options{DBPath: m.o.DBPath, Root: root, Backend: m.o.Backend, Now: clk.Now, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close(ctx)
	l2, err := m2.Acquire(ctx, "alice", "persist", false)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release()
	if l2.WorkspaceID != wid || strings.TrimSpace(exec1(t, l2, "cat d.txt")) != "durable" {
		t.Fatal("session or workspace lost across reopen")
	}
}

// TestClockSteppedBack: after the wall clock is stepped back (two days
// here), the reaper neither releases nor deletes a live session early; a
// session created before the step lives at most MaxAge from the step, not
// MaxAge plus the step; one created after it keeps its own age.
func TestClockSteppedBack(t *testing.T) {
	clk := &clock{now: time.Unix(1_800_000_000, 0)}
	m, root := newManager(t, clk, nil)
	ctx := context.Background()
	l, err := m.Acquire(ctx, "alice", "before", true)
	if err != nil {
		t.Fatal(err)
	}
	exec1(t, l, "echo kept > f.txt")
	l.Release()

	clk.Add(-48 * time.Hour)
	m.Reap(ctx)
	if containers(t, root) != 1 {
		t.Fatal("the step released a live session")
	}
	clk.Add(30 * time.Minute)
	later, err := m.Acquire(ctx, "alice", "after", true)
	if err != nil {
		t.Fatal(err)
	}
	later.Release()
	m.Reap(ctx)
	l, err = m.Acquire(ctx, "alice", "before", false)
	if err != nil {
		t.Fatalf("the step expired a live session: %v", err)
	}
	if got := strings.TrimSpace(exec1(t, l, "cat f.txt")); got != "kept" {
		t.Fatalf("files after the step: %q", got)
	}
	l.Release()

	// MaxAge (an hour) after the step: the older session is gone, the
	// one created after the step (31 minutes old) is not.
	clk.Add(31 * time.Minute)
	m.Reap(ctx)
	if l, err := m.Acquire(ctx, "alice", "before", false); err == nil {
		l.Release()
		t.Fatal("a session from before the step outlived MaxAge after it")
	} else if brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatal(err)
	}
	l, err = m.Acquire(ctx, "alice", "after", false)
	if err != nil {
		t.Fatalf("a session from after the step expired early: %v", err)
	}
	l.Release()
}

// eachStore runs fn once per store (a state.db file, a PostgreSQL
// database), handing it that store's location maker.
func eachStore(t *testing.T, fn func(t *testing.T, loc func(testing.TB) string)) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) { fn(t, st.Loc) })
}
