package docker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
)

// agentBinary is what tests mount as /opt/sandbox/broker: the real broker
// when ./cmd/sandbox-broker builds, else this test binary, which runs the
// real agent package (agentmain_test.go).
var (
	agentBinary string
	agentKind   string
)

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "agent" {
		os.Exit(testAgentMain(os.Args[2:]))
	}
	dir, err := os.MkdirTemp("", "docker-engine-test-")
	if err != nil {
		panic(err)
	}
	agentBinary, agentKind = buildAgent(dir)
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// buildAgent builds the agent (cmd/sandbox-agent, CGO off, so it runs in
// any image) or falls back to this test binary.
// SANDBOX_TEST_AGENT=test-binary forces the fallback.
func buildAgent(dir string) (string, string) {
	if v := os.Getenv("SANDBOX_TEST_AGENT_BINARY"); v != "" {
		return v, "given"
	}
	if os.Getenv("SANDBOX_TEST_AGENT") != "test-binary" {
		out := filepath.Join(dir, "sandbox-agent")
		cmd := exec.Command("go", "build", "-o", out, "github.com/sandbox-broker/sandbox-broker/cmd/sandbox-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err == nil {
			return out, "real"
		} else {
			fmt.Fprintf(os.Stderr, "docker tests: the agent does not build, running the agent from this test binary:\n%s\n", lastLines(string(b), 5))
		}
	}
	exe, err := os.Executable()
	if err != nil {
		panic(err)
	}
	return exe, "test-binary"
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

func inCI() bool { return os.Getenv("CI") == "true" }

// needDocker returns a client for the real daemon: a missing daemon fails
// the test in CI and skips it elsewhere.
func needDocker(t testing.TB) *client.Client {
	t.Helper()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err = cli.Ping(ctx)
		cancel()
	}
	if err != nil {
		if inCI() {
			t.Fatalf("CI=true but the Docker daemon is not reachable: %v", err)
		}
		t.Skipf("docker not reachable: %v", err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	return cli
}

// needRunner requires a runner image for lang (CI: fail; else skip).
func needRunner(t testing.TB, e *Engine, lang string) {
	t.Helper()
	if _, err := e.runner(context.Background(), lang); err != nil {
		if inCI() {
			t.Fatalf("CI=true but no runner image for %q (label sandbox.runner=true, sandbox.language=%s): %v; build it with runners/build.sh", lang, lang, err)
		}
		t.Skipf("no runner image for %q: %v", lang, err)
	}
}

// forRuntimes runs fn once per OCI runtime: runc, and runsc (gVisor) when
// the daemon has it registered. CI must have it (.ci/run builds and
// registers it): there a missing runsc fails the test.
func forRuntimes(t *testing.T, fn func(t *testing.T, runtime string)) {
	t.Run("runc", func(t *testing.T) { fn(t, "runc") })
	t.Run(RuntimeRunsc, func(t *testing.T) {
		needRunsc(t)
		fn(t, RuntimeRunsc)
	})
}

// needRunsc requires the daemon to have runsc registered (CI: fail; else
// skip).
func needRunsc(t testing.TB) {
	t.Helper()
	cli := needDocker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := cli.Info(ctx)
	if err != nil {
		t.Fatalf("docker info: %v", err)
	}
	if _, ok := info.Runtimes[RuntimeRunsc]; !ok {
		if inCI() {
			t.Fatalf("CI=true but the Docker daemon has no runsc runtime (.ci/run builds gVisor and registers it)")
		}
		t.Skip("runsc (gVisor) is not registered with the Docker daemon")
	}
}

func newEngine(t testing.TB, mod func(*Options)) *Engine {
	t.Helper()
	needDocker(t)
	root := t.TempDir()
	o := Options{
		Root:        root,
		AgentBinary: agentBinary,
		UIDs:        newUIDs(t, root),
		PoolSize:    0,
		InstanceID:  "test-" + randHex(4),
		Log:         zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel),
	}
	if mod != nil {
		mod(&o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e, err := New(ctx, o)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := e.Close(ctx); err != nil {
			t.Errorf("Close: %v", err)
		}
		// Nothing of this engine may survive it.
		left := listContainers(t, e.cli, LabelRoot+"="+e.o.Root)
		for _, c := range left {
			_ = e.cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true})
		}
	})
	return e
}

// testUIDBase..+testUIDs is the tests' sandbox uid range (the broker's
// default).
const (
	testUIDBase = 1_900_000_000
	testUIDs    = 65536
)

// newUIDs opens a uid allocator in dir's state database.
func newUIDs(t testing.TB, dir string) *uids.Allocator {
	t.Helper()
	a, err := uids.Open(context.Background(), filepath.Join(dir, "state.db"), testUIDBase, testUIDs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func newRef(e *Engine) sandbox.SessionRef {
	id := randHex(16)
	return sandbox.SessionRef{WorkspaceID: id, Dir: filepath.Join(e.o.Root, "workspaces", id), Principal: "tester"}
}

func listContainers(t testing.TB, cli *client.Client, labels ...string) []container.Summary {
	t.Helper()
	f := filters.NewArgs()
	for _, l := range labels {
		f.Add("label", l)
	}
	list, err := cli.ContainerList(context.Background(), container.ListOptions{All: true, Filters: f})
	if err != nil {
		t.Fatalf("ContainerList: %v", err)
	}
	return list
}

func exec1(t testing.TB, s sandbox.Session, lang, code string, timeout time.Duration) sandbox.ExecResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout+time.Minute)
	defer cancel()
	res, err := s.Exec(ctx, sandbox.ExecRequest{Language: lang, Code: code, Timeout: timeout, MaxOutputBytes: 1 << 20})
	if err != nil {
		t.Fatalf("Exec(%s): %v", lang, err)
	}
	return res
}

// sessionContainer returns the single container of a session's workspace.
func sessionContainer(t testing.TB, s sandbox.Session) *ctr {
	t.Helper()
	ss := s.(*Session)
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for _, c := range ss.ctrs {
		return c
	}
	t.Fatal("session has no container")
	return nil
}

func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
