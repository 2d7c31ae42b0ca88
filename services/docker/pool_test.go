package docker

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

func poolIDs(t testing.TB, e *Engine, lang string) map[string]bool {
	t.Helper()
	ids := map[string]bool{}
	for _, c := range listContainers(t, e.cli, LabelRoot+"="+e.o.Root, LabelWorkspace+"=pool", LabelLanguage+"="+lang) {
		if c.State == "running" {
			ids[c.ID] = true
		}
	}
	return ids
}

func waitPoolReady(t testing.TB, e *Engine, lang string, n int) {
	t.Helper()
	waitFor(t, 90*time.Second, "warm pool", func() bool { return e.Stats().PoolReady[lang] >= n })
}

func TestPoolClaimAndRefill(t *testing.T) {
	e := newEngine(t, func(o *Options) { o.PoolSize = 1 })
	needRunner(t, e, "python")
	waitPoolReady(t, e, "python", 1)
	ref := newRef(e)
	s, err := e.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	res := exec1(t, s, "python", "open('a.txt','w').write('A'); print('ok')", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "ok" {
		t.Fatalf("%+v %s", res, res.Stderr)
	}
	st := e.Stats()
	if st.Claims != 1 || st.ColdStarts != 0 {
		t.Fatalf("stats = %+v, want one claim", st)
	}
	t.Logf("claim latency %s", st.LastClaim)
	claimed := sessionContainer(t, s).dockerID
	if b, err := os.ReadFile(filepath.Join(ref.Dir, "a.txt")); err != nil || string(b) != "A" {
		t.Fatalf("file not in the session workspace after claim: %q %v", b, err)
	}
	// A replacement appears, distinct from the claimed one.
	waitFor(t, 90*time.Second, "pool refill", func() bool {
		ids := poolIDs(t, e, "python")
		delete(ids, claimed)
		return len(ids) == 1 && e.Stats().PoolReady["python"] == 1
	})
	// Files written by the broker are visible in the sandbox.
	if err := s.WriteFile(context.Background(), "in/b.txt", []byte("B"), false); err != nil {
		t.Fatal(err)
	}
	res = exec1(t, s, "python", "print(open('in/b.txt').read() + open('/data/a.txt').read())", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "BA" {
		t.Fatalf("%+v %s", res, res.Stderr)
	}
	f, err := s.ReadFile(context.Background(), "a.txt", 0, 100)
	if err != nil || string(f.Data) != "A" {
		t.Fatalf("ReadFile: %+v %v", f, err)
	}
	list, err := s.ListFiles(context.Background(), "")
	if err != nil || len(list) != 2 || list[0].Path != "a.txt" || list[1].Path != "in/b.txt" {
		t.Fatalf("ListFiles: %+v %v", list, err)
	}
}

// TestPoolFollowsDemand: sessions taking containers raise the pool to
// their number (within poolDemandWindow, at most poolMaxScale times the
// floor); once the window has passed without demand it falls back to
// SANDBOX_POOL_SIZE.
func TestPoolFollowsDemand(t *testing.T) {
	e := newEngine(t, func(o *Options) { o.PoolSize = 1 })
	needRunner(t, e, "python")
	waitPoolReady(t, e, "python", 1)
	const sessions = 3
	for range sessions {
		s, err := e.Open(context.Background(), newRef(e))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Destroy(context.Background()) })
		exec1(t, s, "python", "print(1)", 20*time.Second)
	}
	waitPoolReady(t, e, "python", sessions)
	if n := e.Stats().PoolReady["python"]; n > sessions {
		t.Fatalf("%d warm containers for %d sessions in the window", n, sessions)
	}
	waitFor(t, poolDemandWindow+90*time.Second, "pool back to its floor", func() bool {
		return e.Stats().PoolReady["python"] == 1
	})
}

// TestColdStartExistingWorkspace: a workspace that already has files is
// never replaced by a pool dir; it gets a fresh container with it mounted.
func TestColdStartExistingWorkspace(t *testing.T) {
	e := newEngine(t, func(o *Options) { o.PoolSize = 1 })
	needRunner(t, e, "python")
	waitPoolReady(t, e, "python", 1)
	ref := newRef(e)
	s, err := e.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.WriteFile(context.Background(), "keep.txt", []byte("kept"), false); err != nil {
		t.Fatal(err)
	}
	res := exec1(t, s, "python", "print(open('keep.txt').read())", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "kept" {
		t.Fatalf("%+v %s", res, res.Stderr)
	}
	if st := e.Stats(); st.Claims != 0 || st.ColdStarts != 1 || st.PoolReady["python"] != 1 {
		t.Fatalf("stats = %+v, want one cold start and the pool untouched", st)
	}
	t.Logf("cold start latency %s", e.Stats().LastColdStart)
}

func TestReleaseDestroyLeaveNoContainer(t *testing.T) {
	e := newEngine(t, func(o *Options) { o.PoolSize = 1 })
	needRunner(t, e, "python")
	waitPoolReady(t, e, "python", 1)
	ref := newRef(e)
	s, err := e.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	exec1(t, s, "python", "open('x','w').write('1')", 20*time.Second)
	if _, err := e.runner(context.Background(), "bash"); err == nil {
		exec1(t, s, "bash", "cat x", 20*time.Second) // a second language: cold start on the same dir
	}
	ids := []string{}
	for _, c := range s.(*Session).ctrs {
		ids = append(ids, c.dockerID)
	}
	if err := s.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if _, err := e.cli.ContainerInspect(context.Background(), id); !isNotFound(err) {
			t.Errorf("container %s survived Release: %v", shortID(id), err)
		}
	}
	if _, err := os.Stat(filepath.Join(ref.Dir, "x")); err != nil {
		t.Fatalf("Release lost files: %v", err)
	}
	// Usable again after Release (cold start: the dir has files).
	res := exec1(t, s, "python", "print(open('x').read())", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "1" {
		t.Fatalf("%+v", res)
	}
	id := sessionContainer(t, s).dockerID
	if err := s.Destroy(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := e.cli.ContainerInspect(context.Background(), id); !isNotFound(err) {
		t.Errorf("container survived Destroy: %v", err)
	}
	if _, err := os.Stat(ref.Dir); !os.IsNotExist(err) {
		t.Errorf("Destroy kept the workspace: %v", err)
	}
	if left := listContainers(t, e.cli, LabelRoot+"="+e.o.Root, LabelWorkspace+"="+ref.WorkspaceID); len(left) != 0 {
		t.Errorf("containers left for the workspace: %d", len(left))
	}
	// Close removes the pool too.
	if err := e.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if left := listContainers(t, e.cli, LabelRoot+"="+e.o.Root); len(left) != 0 {
		t.Errorf("containers left after Close: %d", len(left))
	}
}

func TestOrphanSweep(t *testing.T) {
	cli := needDocker(t)
	e0 := newEngine(t, nil) // only to find an image
	needRunner(t, e0, "python")
	r, _ := e0.runner(context.Background(), "python")
	root := t.TempDir()
	id := sandbox.NewID()
	runDir := filepath.Join(root, "run", id)
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		t.Fatal(err)
	}
	// Left behind by a "previous instance": labelled, running, with a run dir.
	resp, err := cli.ContainerCreate(context.Background(), &container.Config{
		Image: r.ID, Entrypoint: []string{}, Cmd: []string{"sleep", "300"}, NetworkDisabled: true,
		Labels: map[string]string{LabelBroker: "1", LabelInstance: "previous", LabelID: id},
	}, &container.HostConfig{NetworkMode: "none"}, nil, nil, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.ContainerRemove(context.Background(), resp.ID, container.RemoveOptions{Force: true}) })
	if err := cli.ContainerStart(context.Background(), resp.ID, container.StartOptions{}); err != nil {
		t.Fatal(err)
	}
	e, err := New(context.Background(), Options{Root: root, AgentBinary: agentBinary, InstanceID: "next",
		UIDs: newUIDs(t, root), Log: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	if _, err := cli.ContainerInspect(context.Background(), resp.ID); !isNotFound(err) {
		t.Fatalf("orphan survived New: %v", err)
	}
	if _, err := os.Stat(runDir); !os.IsNotExist(err) {
		t.Errorf("orphan run dir survived: %v", err)
	}
}

func benchEngine(b *testing.B, pool int) (*Engine, string) {
	e := newEngine(b, func(o *Options) { o.PoolSize = pool; o.Log = zerolog.Nop() })
	needRunner(b, e, "python")
	return e, "python"
}

// BenchmarkClaimFromPool: Open + first Exec when a warm container is ready.
// The pool refill is not timed.
func BenchmarkClaimFromPool(b *testing.B) {
	e, lang := benchEngine(b, 1)
	for b.Loop() {
		b.StopTimer()
		waitPoolReady(b, e, lang, 1)
		b.StartTimer()
		s := benchRun(b, e, lang)
		b.StopTimer()
		_ = s.Destroy(context.Background())
		b.StartTimer()
	}
	b.ReportMetric(float64(e.Stats().LastClaim.Microseconds()), "µs/claim")
}

// BenchmarkColdStart: Open + first Exec with no pool.
func BenchmarkColdStart(b *testing.B) {
	e, lang := benchEngine(b, 0)
	for b.Loop() {
		s := benchRun(b, e, lang)
		b.StopTimer()
		_ = s.Destroy(context.Background())
		b.StartTimer()
	}
}

func benchRun(b *testing.B, e *Engine, lang string) sandbox.Session {
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		b.Fatal(err)
	}
	res, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: lang, Code: "print(1)", Timeout: 20 * time.Second})
	if err != nil || strings.TrimSpace(string(res.Stdout)) != "1" {
		b.Fatalf("%+v %v", res, err)
	}
	return s
}
