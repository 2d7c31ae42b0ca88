package process

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/inherited"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
)

// agentBinary is what sandboxes run as their agent: the real broker when
// ./cmd/sandbox-broker builds, else this test binary, whose `agent` mode
// is the same agent.Serve with the broker's flags (the real agent either
// way, never a fake).
var (
	agentBinary string
	testBase    string // 0711 parent of every test Root (bwrap runs as another uid)
)

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "agent" {
		os.Exit(agentMain(os.Args[2:]))
	}
	if os.Getenv("PROCESS_TEST_HELPER") == "orphan" {
		os.Exit(orphanHelper())
	}
	dir, err := os.MkdirTemp("", "process-test-")
	if err != nil {
		panic(err)
	}
	if err := os.Chmod(dir, 0o711); err != nil {
		panic(err)
	}
	testBase = dir
	agentBinary = buildAgent(dir)
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// buildAgent builds the agent (cmd/sandbox-agent, CGO off) or falls back to
// this binary.
func buildAgent(dir string) string {
	if v := os.Getenv("SANDBOX_TEST_AGENT_BINARY"); v != "" {
		return v
	}
	out := filepath.Join(dir, "sandbox-agent")
	cmd := exec.Command("go", "build", "-o", out, "github.com/sandbox-broker/sandbox-broker/cmd/sandbox-agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err == nil {
		return out
	} else {
		fmt.Fprintf(os.Stderr, "process tests: the agent does not build; the test binary serves as the agent:\n%s\n", lastLines(string(b), 5))
	}
	exe, err := os.Executable()
	if err != nil {
		panic(err)
	}
	return exe
}

// agentMain is cmd/sandbox-broker's `agent` subcommand.
func agentMain(args []string) int {
	if err := inherited.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	socket := fs.String("socket", filepath.Join(agent.SocketDir, agent.SocketName), "")
	language := fs.String("language", "", "")
	workdir := fs.String("workdir", agent.WorkDir, "")
	tmpdir := fs.String("tmpdir", "/tmp", "")
	sweep := fs.String("sweep", "auto", "")
	noZygote := fs.Bool("no-zygote", false, "")
	// The test binary's own flags may follow when it is re-executed.
	_ = fs.Parse(args)
	mode, err := agent.ParseSweepMode(*sweep)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	err = agent.Serve(ctx, agent.Options{Socket: *socket, Language: *language, WorkDir: *workdir,
		TmpDir: *tmpdir, Sweep: mode, NoZygote: *noZygote, Log: os.Stderr})
	if err != nil && ctx.Err() == nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

func inCI() bool { return os.Getenv("CI") == "true" }

func newRoot(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp(testBase, "root-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(d, 0o711); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

// newBackend starts a Backend on a fresh root. Without bwrap or user
// namespaces the test fails in CI and is skipped elsewhere.
func newBackend(t testing.TB, mod func(*Options)) *Backend {
	t.Helper()
	root := newRoot(t)
	o := Options{
		Root:        root,
		AgentBinary: agentBinary,
		UIDs:        newUIDs(t, root),
		Log:         zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel),
	}
	if mod != nil {
		mod(&o)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b, err := New(ctx, o)
	if err != nil {
		if inCI() {
			t.Fatalf("CI=true but bubblewrap sandboxes are unavailable: %v", err)
		}
		t.Skipf("bubblewrap sandboxes unavailable: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := b.Close(ctx); err != nil {
			t.Errorf("Close: %v", err)
		}
		b.mu.Lock()
		n := len(b.live)
		b.mu.Unlock()
		if n != 0 {
			t.Errorf("%d sandboxes still live after Close", n)
		}
	})
	return b
}

// testUIDBase and testUIDs are the sandbox uid range of these tests: as
// large as the broker's default, and beside it rather than on it, since the
// end-to-end tests' brokers (tests/) run their sandboxes from the default
// range while these run (go test runs packages in parallel), and
// RLIMIT_NPROC counts every thread of a uid (TestRlimits sets it to 48; a
// notebook kernel alone has a dozen).
const (
	testUIDBase = 1_901_000_000
	testUIDs    = 65536
)

// newUIDs opens a uid allocator in root's state database.
func newUIDs(t testing.TB, root string) *uids.Allocator {
	t.Helper()
	a, err := uids.Open(context.Background(), filepath.Join(root, "state.db"), testUIDBase, testUIDs)
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

func newRef(b *Backend) sandbox.SessionRef {
	id := randHex(16)
	return sandbox.SessionRef{WorkspaceID: id, Dir: filepath.Join(b.o.Root, "workspaces", id), Principal: "tester"}
}

func open(t testing.TB, b *Backend) *Session {
	t.Helper()
	s, err := b.Open(context.Background(), newRef(b))
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return s.(*Session)
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

// waitZygote runs Python in s until the sandbox's zygote (its command line
// says so) forks the runs, for at most two minutes: a benchmark then times
// warm runs, not python3 started while the preload is under way.
func waitZygote(t testing.TB, s sandbox.Session) {
	t.Helper()
	const fromZygote = "import os\nprint(b'Python zygote' in open('/proc/%d/cmdline' % os.getppid(), 'rb').read())"
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if string(exec1(t, s, "python", fromZygote, 20*time.Second).Stdout) == "True\n" {
			return
		}
	}
	t.Fatal("the zygote did not take a run within two minutes")
}

// current is the session's one running sandbox.
func current(t testing.TB, s *Session) *sbx {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.sbs) != 1 {
		t.Fatalf("session has %d sandboxes, want 1", len(s.sbs))
	}
	for _, sb := range s.sbs {
		return sb
	}
	return nil
}

func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// orphanHelper plays a broker that is killed: it starts a sandbox on the
// root given in PROCESS_TEST_ROOT, prints the bwrap pid and waits to die.
func orphanHelper() int {
	root := os.Getenv("PROCESS_TEST_ROOT")
	ids, err := uids.Open(context.Background(), filepath.Join(root, "state.db"), testUIDBase, testUIDs)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	b, err := New(context.Background(), Options{Root: root, AgentBinary: os.Getenv("PROCESS_TEST_AGENT"), UIDs: ids})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	ref := sandbox.SessionRef{WorkspaceID: "orphan", Dir: filepath.Join(b.o.Root, "workspaces", "orphan")}
	s, _ := b.Open(context.Background(), ref)
	if _, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: "true", Timeout: 10 * time.Second}); err != nil {
		fmt.Println("error:", err)
		return 1
	}
	for _, sb := range s.(*Session).sbs {
		fmt.Printf("pid %d\n", sb.pid)
	}
	select {}
}
