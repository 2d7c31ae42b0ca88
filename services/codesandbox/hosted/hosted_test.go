package hosted

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

const testKey = "csb_v1_hosted_test_key_0123456789"

// runnerTemplate is the operator's runner template in the fake.
const runnerTemplate = "runtpl"

const (
	wid1 = "0123456789abcdef0123456789abcdef"
	wid2 = "fedcba9876543210fedcba9876543210"
)

type env struct {
	t    testing.TB
	fake *csbfake.Server
	b    *Backend
	root string
	clk  *clock
}

// clock is the backends' clock of last uses: it moves when a test says.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) pass(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newEnv is a backend on a fake whose VMs run commands for real.
func newEnv(t testing.TB, mod func(*Options), fakeOpts ...csbfake.Option) *env {
	t.Helper()
	fake := csbfake.New(t, testKey, append([]csbfake.Option{csbfake.WithRealShell()}, fakeOpts...)...)
	fake.AddTemplate(runnerTemplate, nil, 0)
	root := t.TempDir()
	o := Options{
		API:             codesandbox.Options{BaseURL: fake.URL(), APIKey: testKey, RetryBase: time.Millisecond},
		Template:        runnerTemplate,
		DBPath:          filepath.Join(root, "state.db"),
		WorkspaceLimits: workspace.Limits{MaxFiles: 50, MaxBytes: 8 << 20, MaxFileBytes: 4 << 20},
		Log:             zerolog.Nop(),
	}
	if mod != nil {
		mod(&o)
	}
	e := &env{t: t, fake: fake, root: root, clk: &clock{t: time.UnixMilli(time.Now().UnixMilli())}}
	e.b = e.newBackend(o)
	return e
}

func (e *env) newBackend(o Options) *Backend {
	e.t.Helper()
	b, err := New(context.Background(), o)
	if err != nil {
		e.t.Fatal(err)
	}
	b.now = e.clk.now
	e.t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

// replica is a second broker replica: another backend on the same store,
// root, CodeSandbox and clock.
func (e *env) replica() *env {
	r := *e
	r.b = e.newBackend(e.b.o)
	return &r
}

// idleRelease releases s as the session manager does once s has been
// idle for the idle timeout.
func (e *env) idleRelease(s *Session) {
	e.t.Helper()
	e.clk.pass(e.b.o.IdleTimeout)
	if err := s.Release(ctx(e.t)); err != nil {
		e.t.Fatal(err)
	}
}

// vmID is the VM of workspace wid.
func (e *env) vmID(wid string) string {
	e.b.mu.Lock()
	defer e.b.mu.Unlock()
	return e.b.vms[wid].id()
}

func (e *env) dir(wid string) string { return filepath.Join(e.root, "workspaces", wid) }

func (e *env) open(wid, principal string) *Session {
	e.t.Helper()
	s, err := e.b.Open(ctx(e.t), sandbox.SessionRef{WorkspaceID: wid, Dir: e.dir(wid), Principal: principal})
	if err != nil {
		e.t.Fatal(err)
	}
	return s.(*Session)
}

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

func run(t *testing.T, s *Session, lang, code string) sandbox.ExecResult {
	t.Helper()
	res, err := s.Exec(ctx(t), sandbox.ExecRequest{Language: lang, Code: code, Timeout: 20 * time.Second})
	if err != nil {
		t.Fatalf("%s run: %v", lang, err)
	}
	return res
}

func wantCode(t *testing.T, err error, code brokererr.Code) *brokererr.Error {
	t.Helper()
	be := brokererr.As(err)
	if be == nil || be.Code != code {
		t.Fatalf("error %v, want %s", err, code)
	}
	return be
}

// helperRuns counts the runs and jobs the VMs were asked to start.
func helperRuns(f *csbfake.Server) int {
	n := 0
	for _, c := range f.PitcherCalls() {
		if cmd, _ := c.Params["command"].(string); c.Method == "shell/create" && strings.Contains(cmd, helperPath) {
			n++
		}
	}
	return n
}

func TestRunInVM(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	res := run(t, s, "python", "import sys\nsys.stdout.write('out\\r\\n\\x1b[31mred')\nsys.stderr.write('err')\nopen('data/r.csv','w').write('a,b') if __import__('os').makedirs('data', exist_ok=True) is None else 0\nsys.exit(3)")
	// The program's bytes come back exactly: no terminal on the way.
	if string(res.Stdout) != "out\r\n\x1b[31mred" || string(res.Stderr) != "err" || res.ExitCode != 3 || res.Signal != "" || res.TimedOut {
		t.Fatalf("result %+v stdout=%q stderr=%q", res, res.Stdout, res.Stderr)
	}
	if len(res.Changed) != 1 || res.Changed[0].Path != "data/r.csv" || res.Changed[0].Size != 3 {
		t.Fatalf("changed %+v", res.Changed)
	}
	if b, err := os.ReadFile(filepath.Join(e.dir(wid1), "data", "r.csv")); err != nil || string(b) != "a,b" {
		t.Fatalf("host copy %q %v", b, err)
	}
	// The other languages the template provides, and the documented aliases of the workspace.
	if r := run(t, s, "bash", "echo $((6*7)) > /mnt/data/b.txt; cat b.txt"); string(r.Stdout) != "42\n" || r.ExitCode != 0 {
		t.Fatalf("bash %+v %q", r, r.Stderr)
	}
	if r := run(t, s, "javascript", "console.log(require('fs').readFileSync('data/r.csv','utf8'))"); string(r.Stdout) != "a,b\n" {
		t.Fatalf("javascript %+v %q", r, r.Stderr)
	}
	// A language the template lacks (the fake's has no tsx) is a clear, non-retryable error.
	_, err := s.Exec(ctx(t), sandbox.ExecRequest{Language: "typescript", Code: "console.log(1)", Timeout: 10 * time.Second})
	if be := wantCode(t, err, brokererr.Unavailable); be.Retryable || !strings.Contains(be.Message, "tsx") {
		t.Fatalf("typescript: %+v", be)
	}
	_, err = s.Exec(ctx(t), sandbox.ExecRequest{Language: "python", Code: "1", Mode: sandbox.ModeNotebook})
	wantCode(t, err, brokererr.InvalidInput)
	_, err = s.Exec(ctx(t), sandbox.ExecRequest{Language: "cobol", Code: "1"})
	wantCode(t, err, brokererr.UnknownLanguage)
	if st, ok := e.fake.Sandbox(s.v.id()); !ok || !st.Running || st.Privacy != codesandbox.PrivacyPrivate || !st.PrivatePreview ||
		len(st.Tags) != 1 || st.Tags[0] != DefaultTag {
		t.Fatalf("VM %+v", st)
	}
}

func TestOutputCapAndTimeout(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	res, err := s.Exec(ctx(t), sandbox.ExecRequest{Language: "python", Code: "print('x'*100000)", MaxOutputBytes: 1000, Timeout: 20 * time.Second})
	if err != nil || len(res.Stdout) != 1000 || !res.Truncated || res.ExitCode != 0 {
		t.Fatalf("cap: %d bytes, %+v %v", len(res.Stdout), res.Truncated, err)
	}
	// The timeout kills the whole process group, background children too.
	start := time.Now()
	res, err = s.Exec(ctx(t), sandbox.ExecRequest{Language: "bash", Code: "(sleep 3; echo late > late.txt) & echo started; sleep 60", Timeout: time.Second})
	if err != nil || !res.TimedOut || res.Signal != "SIGKILL" || string(res.Stdout) != "started\n" {
		t.Fatalf("timeout: %+v %v", res, err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("timed-out run took %v", d)
	}
	time.Sleep(4 * time.Second) // past when the background child would have written
	if r := run(t, s, "bash", "ls"); strings.Contains(string(r.Stdout), "late.txt") {
		t.Fatalf("the background child outlived the timeout: %q", r.Stdout)
	}
}

func TestHostIsTheSourceOfTruth(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.MaxSyncFileBytes = 2000 })
	s := e.open(wid1, "alice")
	cx := ctx(t)
	// Written on the host (write_file, a signed upload): in the VM before the next run.
	if err := s.WriteFile(cx, "in/a.txt", []byte("from host"), false); err != nil {
		t.Fatal(err)
	}
	if r := run(t, s, "bash", "cat in/a.txt"); string(r.Stdout) != "from host" {
		t.Fatalf("pushed: %q %q", r.Stdout, r.Stderr)
	}
	// Deleted by a run: deleted on the host; deleted on the host: gone from the VM.
	run(t, s, "bash", "rm in/a.txt; echo b > b.txt; echo c > c.txt")
	if _, err := os.Stat(filepath.Join(e.dir(wid1), "in", "a.txt")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("deleted in the VM, kept on the host: %v", err)
	}
	if err := os.Remove(filepath.Join(e.dir(wid1), "b.txt")); err != nil {
		t.Fatal(err)
	}
	if r := run(t, s, "bash", "ls"); strings.TrimSpace(string(r.Stdout)) != "c.txt\nin" {
		t.Fatalf("VM after a host delete: %q", r.Stdout)
	}
	// Symlinks and files over the sync cap stay in the VM, and the run says so.
	res := run(t, s, "bash", "ln -s /etc/passwd pw; ln -s .. up; head -c 5000 /dev/zero > big.bin; echo small > ok.txt")
	if len(res.Changed) != 1 || res.Changed[0].Path != "ok.txt" {
		t.Fatalf("changed %+v", res.Changed)
	}
	for _, name := range []string{"pw", "up", "big.bin"} {
		if _, err := os.Lstat(filepath.Join(e.dir(wid1), name)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s reached the host: %v", name, err)
		}
		if !strings.Contains(string(res.Stderr), "sandbox-broker: "+name) {
			t.Fatalf("no note about %s: %q", name, res.Stderr)
		}
	}
	l, err := s.ListFiles(cx, "")
	if err != nil || len(l) != 2 {
		t.Fatalf("host files %+v %v", l, err)
	}
}

func TestQuotaOnCopyBack(t *testing.T) {
	e := newEnv(t, nil) // 50 files, 8 MiB
	s := e.open(wid1, "alice")
	if err := s.WriteFile(ctx(t), "keep.txt", []byte("k"), false); err != nil {
		t.Fatal(err)
	}
	_, err := s.Exec(ctx(t), sandbox.ExecRequest{Language: "bash", Code: "for i in $(seq 60); do echo $i > f$i.txt; done", Timeout: 20 * time.Second})
	wantCode(t, err, brokererr.QuotaExceeded)
	// Over the entry cap the VM is not believed: the next run makes it the host's again.
	if r := run(t, s, "bash", "ls | wc -l; cat keep.txt"); string(r.Stdout) != "1\nk" {
		t.Fatalf("VM after the quota error: %q", r.Stdout)
	}
	_, err = s.Exec(ctx(t), sandbox.ExecRequest{Language: "bash", Code: "head -c 3000000 /dev/urandom > a; head -c 3000000 /dev/urandom > b; head -c 3000000 /dev/urandom > c", Timeout: 20 * time.Second})
	wantCode(t, err, brokererr.QuotaExceeded)
	if l, _ := s.ListFiles(ctx(t), ""); len(l) != 1 || l[0].Path != "keep.txt" {
		t.Fatalf("host after the byte quota: %+v", l)
	}
	if r := run(t, s, "bash", "ls"); string(r.Stdout) != "keep.txt\n" {
		t.Fatalf("VM after the byte quota: %q", r.Stdout)
	}
}

func TestNetworkDeniedByDefault(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("hello"))
			c.Close()
		}
	}()
	code := fmt.Sprintf("import socket\ntry:\n  print(socket.create_connection(('127.0.0.1', %d), timeout=5).recv(5).decode())\nexcept OSError as e:\n  print('refused', type(e).__name__)\n", ln.Addr().(*net.TCPAddr).Port)
	for _, tc := range []struct {
		network, want string
		opts          []csbfake.Option
	}{
		{"", "refused", nil},
		{NetworkAllow, "hello", nil},
		// A VM user without privileges gets its network namespace inside a user namespace.
		{NetworkDeny, "refused", []csbfake.Option{csbfake.WithUnprivilegedShell()}},
	} {
		e := newEnv(t, func(o *Options) { o.Network = tc.network }, tc.opts...)
		r := run(t, e.open(wid1, "alice"), "python", code+"print(socket.create_server(('127.0.0.1', 0)).getsockname()[0])")
		// Loopback inside the command's own namespace still works.
		if !strings.HasPrefix(string(r.Stdout), tc.want) || !strings.HasSuffix(string(r.Stdout), "127.0.0.1\n") {
			t.Fatalf("network %q: %q %q", tc.network, r.Stdout, r.Stderr)
		}
	}
}

func TestHibernateAndResume(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	run(t, s, "bash", "echo one > a.txt")
	id := s.v.id()
	e.idleRelease(s)
	if st, _ := e.fake.Sandbox(id); st.Running {
		t.Fatal("released session's VM still running")
	}
	// The session manager opens the session again after an idle release.
	s = e.open(wid1, "alice")
	if r := run(t, s, "bash", "cat a.txt"); string(r.Stdout) != "one\n" {
		t.Fatalf("after resume %q", r.Stdout)
	}
	st, _ := e.fake.Sandbox(id)
	if strings.Join(st.Bootups, ",") != "FORK,RESUME" || s.v.id() != id {
		t.Fatalf("bootups %v", st.Bootups)
	}
	// The VM hibernating by itself (its own timeout) is the same.
	e.fake.HibernateVM(id)
	if r := run(t, s, "bash", "cat a.txt"); string(r.Stdout) != "one\n" {
		t.Fatalf("after a server-side hibernation %q", r.Stdout)
	}
}

func TestVMDeletedBehindTheBroker(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	run(t, s, "bash", "echo kept > a.txt")
	old := s.v.id()
	s.v.disconnect()
	if err := e.b.destroyVM(ctx(t), old); err != nil {
		t.Fatal(err)
	}
	// A new VM takes its place, with the host's files.
	if r := run(t, s, "bash", "cat a.txt"); string(r.Stdout) != "kept\n" || s.v.id() == old {
		t.Fatalf("%q, VM %s (was %s)", r.Stdout, s.v.id(), old)
	}
	if _, sb, _ := e.b.db.get(ctx(t), wid1); sb != s.v.id() {
		t.Fatalf("row names %s", sb)
	}
}

func TestSessionIsItsPrincipals(t *testing.T) {
	e := newEnv(t, nil)
	run(t, e.open(wid1, "alice"), "bash", "true")
	_, err := e.b.Open(ctx(t), sandbox.SessionRef{WorkspaceID: wid1, Dir: e.dir(wid1), Principal: "mallory"})
	wantCode(t, err, brokererr.SandboxNotFound)
	// Two sessions never share a VM.
	bob := e.open(wid2, "bob")
	run(t, bob, "bash", "true")
	if bob.v.id() == e.open(wid1, "alice").v.id() {
		t.Fatal("two sessions share a VM")
	}
	for _, bad := range []string{"", "../x", strings.Repeat("g", 32)} {
		if _, err := e.b.Open(ctx(t), sandbox.SessionRef{WorkspaceID: bad, Dir: e.dir("x"), Principal: "alice"}); err == nil {
			t.Fatalf("workspace id %q accepted", bad)
		}
	}
}

// TestReplicaJoinsTheSessionVM: two backends on one store and one root
// (two broker replicas). One opened the session before the other forked
// its VM: its first run joins that VM rather than forking a second. A row
// naming another principal is refused, as Open refuses it.
func TestReplicaJoinsTheSessionVM(t *testing.T) {
	e := newEnv(t, nil)
	replica := e.replica()
	early, mallory := e.open(wid1, "alice"), e.open(wid2, "mallory")
	run(t, replica.open(wid1, "alice"), "bash", "echo kept > f")
	run(t, replica.open(wid2, "bob"), "bash", "true")
	if r := run(t, early, "bash", "cat f"); string(r.Stdout) != "kept\n" {
		t.Fatalf("the joining replica's run: %q", r.Stdout)
	}
	forks := 0
	for _, r := range e.fake.Requests() {
		if r.Method == "POST" && r.Path == "/sandbox/"+runnerTemplate+"/fork" {
			forks++
		}
	}
	if early.v.id() != replica.vmID(wid1) || forks != 2 {
		t.Fatalf("VMs %s and %s, %d forks for two sessions", early.v.id(), replica.vmID(wid1), forks)
	}
	_, err := mallory.Exec(ctx(t), sandbox.ExecRequest{Language: "bash", Code: "true"})
	wantCode(t, err, brokererr.SandboxNotFound)
	if _, sb, _ := e.b.db.get(ctx(t), wid2); sb != replica.vmID(wid2) {
		t.Fatalf("bob's row names %q after the refusal, want %s", sb, replica.vmID(wid2))
	}
}

func TestDestroy(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	run(t, s, "bash", "echo x > a.txt")
	id := s.v.id()
	if err := s.Destroy(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if st, _ := e.fake.Sandbox(id); !st.Deleted {
		t.Fatal("VM not deleted")
	}
	if _, err := os.Stat(e.dir(wid1)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("workspace kept: %v", err)
	}
	if _, sb, _ := e.b.db.get(ctx(t), wid1); sb != "" {
		t.Fatal("row kept")
	}
	_, err := s.Exec(ctx(t), sandbox.ExecRequest{Language: "bash", Code: "true"})
	wantCode(t, err, brokererr.SandboxNotFound)
}

func TestSweepDeletesOrphans(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.SweepGrace = time.Nanosecond })
	s := e.open(wid1, "alice")
	run(t, s, "bash", "true")
	// A VM forked with the tag whose row never got written (a crash).
	fr, err := e.b.c.Fork(ctx(t), runnerTemplate, codesandbox.ForkRequest{Tags: []string{DefaultTag}})
	if err != nil {
		t.Fatal(err)
	}
	// And one of the project provider's, which this sweep must not touch.
	other, err := e.b.c.Fork(ctx(t), runnerTemplate, codesandbox.ForkRequest{Tags: []string{"sandbox-broker"}})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // created_at has whole seconds
	n, err := e.b.Sweep(ctx(t))
	if err != nil || n != 1 {
		t.Fatalf("swept %d, %v", n, err)
	}
	for id, gone := range map[string]bool{fr.ID: true, other.ID: false, s.v.id(): false} {
		if st, _ := e.fake.Sandbox(id); st.Deleted != gone {
			t.Fatalf("%s deleted=%v", id, st.Deleted)
		}
	}
}

// TestKeyNeverReachesTheVM checks every message to the VM's agent, and
// what a command in the VM can see.
func TestKeyNeverReachesTheVM(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	r := run(t, s, "bash", "env; cat /tmp/.sandbox-broker/* 2>/dev/null; grep -r csb_ /project 2>/dev/null")
	if bytes.Contains(r.Stdout, []byte(testKey)) {
		t.Fatal("the API key is visible in the VM")
	}
	for _, c := range e.fake.PitcherCalls() {
		if strings.Contains(fmt.Sprint(c.Params), testKey) {
			t.Fatalf("%s carried the API key", c.Method)
		}
	}
}

// TestReconcileAfterRestart: a new broker process knows nothing of the
// last sync; files changed on either side since are kept, the host's
// version winning where it changed.
func TestReconcileAfterRestart(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	if err := s.WriteFile(ctx(t), "both.txt", []byte("host v1"), false); err != nil {
		t.Fatal(err)
	}
	run(t, s, "bash", "echo vm > vm-only.txt; echo same > same.txt")
	// The broker stops; meanwhile a file is uploaded to the host, and the
	// VM holds a file the broker never copied back.
	if err := e.b.Close(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.dir(wid1), "both.txt"), []byte("host v2"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.fake.SetFile(s.v.id(), "lost.txt", []byte("from a run whose result was lost"))
	b2, err := New(ctx(t), e.b.o)
	if err != nil {
		t.Fatal(err)
	}
	defer b2.Close(ctx(t))
	e.b = b2
	s = e.open(wid1, "alice")
	r := run(t, s, "bash", "cat both.txt; echo; cat lost.txt")
	if string(r.Stdout) != "host v2\nfrom a run whose result was lost" {
		t.Fatalf("VM after restart: %q", r.Stdout)
	}
	if b, err := os.ReadFile(filepath.Join(e.dir(wid1), "lost.txt")); err != nil || !bytes.HasPrefix(b, []byte("from a run")) {
		t.Fatalf("the VM's file did not reach the host: %q %v", b, err)
	}
	if l, _ := s.ListFiles(ctx(t), ""); len(l) != 4 {
		t.Fatalf("host files %+v", l)
	}
}

// TestTemplateWorkspace: a new VM's workspace is the session's, but the
// template's own configuration (.codesandbox, its setup tasks) stays in
// the VM and never reaches the host.
func TestTemplateWorkspace(t *testing.T) {
	e := newEnv(t, nil)
	e.fake.AddTemplate("tplfiles", map[string][]byte{"README.md": []byte("template"), ".codesandbox/tasks.json": []byte(`{"setupTasks":[]}`)}, 0)
	e.b.o.Template = "tplfiles"
	s := e.open(wid1, "alice")
	if err := s.WriteFile(ctx(t), ".codesandbox/tasks.json", []byte("from the host"), false); err != nil {
		t.Fatal(err)
	}
	r := run(t, s, "bash", "ls -A; cat .codesandbox/tasks.json; echo > .codesandbox/new")
	if string(r.Stdout) != ".codesandbox\n{\"setupTasks\":[]}" || len(r.Changed) != 0 {
		t.Fatalf("VM workspace %q, changed %+v", r.Stdout, r.Changed)
	}
	if b, _ := os.ReadFile(filepath.Join(e.dir(wid1), ".codesandbox", "tasks.json")); string(b) != "from the host" {
		t.Fatalf("host copy %q", b)
	}
}
