package process

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/runnerfs"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// prebuiltRunners is where `make runners` left the runner file systems:
// $SANDBOX_TEST_RUNNERS_DIR, else the repository's data/runners (the
// default of SANDBOX_ROOT=./data). CI builds them (.ci/run); elsewhere the
// tests that need them are skipped.
func prebuiltRunners(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("SANDBOX_TEST_RUNNERS_DIR")
	if dir == "" {
		dir = filepath.Join("..", "..", "data", "runners")
	}
	list, err := runnerfs.Open(dir, Layout())
	if err == nil && len(list) < 3 {
		err = os.ErrNotExist
	}
	if err != nil {
		if inCI() {
			t.Fatalf("CI=true but the runner file systems (python, typescript, bash) are missing or invalid in %s: %v (runners/rootfs.sh builds them)", dir, err)
		}
		t.Skipf("no runner file systems in %s (run make runners): %v", dir, err)
	}
	return dir
}

// linkRunners hard-links the prebuilt runners into root/runners (fast, and
// inside the root like the default SANDBOX_RUNNERS_DIR). Nothing may write
// through the links: they share the prebuilt trees' inodes.
func linkRunners(t testing.TB, root string) string {
	t.Helper()
	src := prebuiltRunners(t)
	dst := filepath.Join(root, "runners")
	if err := copyRunners(src, dst); err != nil {
		t.Fatal(err)
	}
	return dst
}

func newRootfsBackend(t testing.TB, mod func(*Options)) *Backend {
	t.Helper()
	return newBackend(t, func(o *Options) {
		o.RunnersDir = linkRunners(t, o.Root)
		if mod != nil {
			mod(o)
		}
	})
}

// eachRoot runs fn on a backend of each kind of sandbox root: the host's
// /usr, and the runner file systems.
func eachRoot(t *testing.T, mod func(*Options), fn func(t *testing.T, b *Backend)) {
	t.Run("host", func(t *testing.T) { fn(t, newBackend(t, mod)) })
	t.Run("rootfs", func(t *testing.T) { fn(t, newRootfsBackend(t, mod)) })
}

// TestRunnerRootfsRunsTheImages: with runner file systems, each language
// runs on its image's tree (pandas and matplotlib for python, tsx for
// typescript, jq for bash), each in a sandbox of its own like the Docker
// backend's containers, and nothing of the host's /usr is there.
func TestRunnerRootfsRunsTheImages(t *testing.T) {
	b := newRootfsBackend(t, nil)
	rs, err := b.Runners(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range rs {
		got = append(got, r.Language+"="+r.Image)
		if !strings.HasPrefix(r.Source, "rootfs sha256:") {
			t.Errorf("%s: source %q, want the exported image's", r.Language, r.Source)
		}
	}
	if strings.Join(got, ",") != "bash=sandbox-broker/runner-bash:latest,python=sandbox-broker/runner-python:latest,typescript=sandbox-broker/runner-typescript:latest" {
		t.Fatalf("runners: %v", got)
	}
	s := open(t, b)
	res := exec1(t, s, "python", `import pandas, matplotlib, scipy, shutil, os
import matplotlib.pyplot as plt
plt.plot([1, 2]); plt.savefig("chart.png")
print(pandas.__version__, scipy.__version__, shutil.which("node"), os.path.exists("/usr/bin/bwrap"))`, 60*time.Second)
	if res.ExitCode != 0 || !strings.HasSuffix(string(res.Stdout), " None False\n") {
		t.Fatalf("python: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	if len(res.Changed) != 1 || res.Changed[0].Path != "chart.png" {
		t.Errorf("changed: %+v", res.Changed)
	}
	res = exec1(t, s, "typescript", `const n: number = 41; console.log(n + 1, typeof require)`, 60*time.Second)
	if res.ExitCode != 0 || string(res.Stdout) != "42 function\n" {
		t.Fatalf("typescript: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	res = exec1(t, s, "bash", `echo '{"a":[1,2]}' | jq -c .a; command -v python3 node || echo neither; ls /data/chart.png`, 30*time.Second)
	if res.ExitCode != 0 || string(res.Stdout) != "[1,2]\nneither\n/data/chart.png\n" {
		t.Fatalf("bash: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	s.mu.Lock()
	n := len(s.sbs)
	s.mu.Unlock()
	if n != 3 {
		t.Errorf("%d sandboxes for three runners", n)
	}
	if err := s.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "javascript", Code: "1", Timeout: time.Second}); brokererr.CodeOf(err) != brokererr.UnknownLanguage {
		t.Errorf("javascript (no runner image has it): %v", err)
	}
}

// TestRunnerRootfsHostInvisible: on a runner file system nothing of the
// host's shows: its /etc (machine-id, resolver, accounts, ssh, sudoers),
// its binaries, SANDBOX_ROOT, other sessions or the runners dir; what
// the image has under /etc is the image's, with the synthetic accounts
// and host name over it.
func TestRunnerRootfsHostInvisible(t *testing.T) {
	b := newRootfsBackend(t, nil)
	s, other := open(t, b), open(t, b)
	if err := other.WriteFile(context.Background(), "secret.txt", []byte("s3cret"), false); err != nil {
		t.Fatal(err)
	}
	home, _ := os.UserHomeDir()
	absent := []string{filepath.Join(home, ".ssh"), b.o.Root, b.o.RunnersDir, other.ref.Dir, filepath.Join(other.ref.Dir, "secret.txt"),
		"/etc/ssh", "/etc/sudoers", "/usr/bin/bwrap", "/usr/bin/docker", "/usr/sbin/debootstrap", "/usr/local/go", "/.dockerenv", testBase}
	code := "import os, json\nres = {}\nfor p in json.loads(" + strconv.Quote(mustJSON(absent)) + "):\n" +
		"    res[p] = os.path.lexists(p)\n" +
		"print(json.dumps(res))\n" +
		"print(repr(open('/etc/machine-id').read()), repr(open('/etc/resolv.conf').read()), repr(open('/etc/hostname').read()))\n" +
		"try:\n    open('/etc/shadow').read(); print('shadow READ')\nexcept OSError as e:\n    print('shadow', e.errno)\n" +
		"print(','.join(l.split(':')[0] for l in open('/etc/passwd')))\n"
	res := exec1(t, s, "python", code, 30*time.Second)
	lines := strings.Split(strings.TrimSpace(string(res.Stdout)), "\n")
	if len(lines) != 4 {
		t.Fatalf("output: %q %q", res.Stdout, res.Stderr)
	}
	var got map[string]bool
	if err := json.Unmarshal([]byte(lines[0]), &got); err != nil {
		t.Fatal(err)
	}
	for _, p := range absent {
		if got[p] {
			t.Errorf("%s is visible in the sandbox", p)
		}
	}
	if lines[1] != "'' '' 'sandbox\\n'" {
		t.Errorf("machine-id, resolv.conf, hostname: %s", lines[1])
	}
	if lines[2] != "shadow 13" { // the image's, root-only
		t.Errorf("/etc/shadow: %s", lines[2])
	}
	if lines[3] != "root,sandbox,nobody" {
		t.Errorf("/etc/passwd: %s", lines[3])
	}
}

// TestRunnerRootfsLimits: every runner's sandbox has the rlimits; Node's
// has the address space V8's WebAssembly reservations need (tsx fails
// without), the others the configured one.
func TestRunnerRootfsLimits(t *testing.T) {
	b := newRootfsBackend(t, func(o *Options) { o.AddressSpace = 3 << 30; o.NoFile = 512 })
	s := open(t, b)
	for lang, code := range map[string]string{
		"python":     "print(open('/proc/self/limits').read())",
		"typescript": "import { readFileSync } from 'fs'; console.log(readFileSync('/proc/self/limits', 'utf8'))",
		"bash":       "cat /proc/self/limits",
	} {
		as := "3221225472"
		if lang == "typescript" {
			as = strconv.Itoa(nodeAddressSpace)
		}
		res := exec1(t, s, lang, code, 60*time.Second)
		for _, want := range []string{`Max address space\s+` + as + `\s+` + as, `Max open files\s+512\s+512`, `Max core file size\s+0\s+0`} {
			if !regexp.MustCompile(want).Match(res.Stdout) {
				t.Errorf("%s: limits lack %s:\n%s%s", lang, want, res.Stdout, res.Stderr)
			}
		}
	}
}

// TestNewRefusesChangedRunner: a runner file system that changed since
// it was sealed stops the backend, with an error that says which and
// names no host path; the next start after a rebuild works.
func TestNewRefusesChangedRunner(t *testing.T) {
	root := newRoot(t)
	dir := linkRunners(t, root)
	gen, err := os.Readlink(filepath.Join(dir, "bash"))
	if err != nil {
		t.Fatal(err)
	}
	// A new inode through a rename: the prebuilt tree shares the old one.
	jq := filepath.Join(dir, gen, "rootfs/usr/bin/jq")
	data, err := os.ReadFile(jq)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(jq+".new", append(data, 0), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(jq+".new", jq); err != nil {
		t.Fatal(err)
	}
	_, err = New(context.Background(), Options{Root: root, RunnersDir: dir, AgentBinary: agentBinary, UIDs: newUIDs(t, root)})
	if brokererr.CodeOf(err) != brokererr.Unavailable || !strings.Contains(err.Error(), "runner bash: the tree does not match its manifest") {
		t.Fatalf("New with a changed runner: %v", err)
	}
	if strings.Contains(err.Error(), root) {
		t.Errorf("the error names a host path: %v", err)
	}
}

// TestNoRunnersFallsBackToHostAndSaysSo: without runner file systems the
// host's interpreters run the code, one sandbox for all of them, and
// list_runners says so.
func TestNoRunnersFallsBackToHostAndSaysSo(t *testing.T) {
	b := newBackend(t, nil)
	rs, err := b.Runners(context.Background())
	if err != nil || len(rs) == 0 {
		t.Fatalf("runners: %v %v", rs, err)
	}
	for _, r := range rs {
		if r.Source != hostSource || !strings.HasPrefix(r.Image, "process:") {
			t.Errorf("%+v: want the host fallback named", r)
		}
	}
	s := open(t, b)
	exec1(t, s, "python", "print(1)", 20*time.Second)
	exec1(t, s, "bash", "echo 1", 20*time.Second)
	current(t, s) // one sandbox serves both
}

func TestBwrapArgsRootfsBindOnlyWhatTheyShould(t *testing.T) {
	b := &Backend{o: withDefaults(Options{Root: "/srv/root"}), etcDir: "/srv/root/etc-sandbox", agent: "/srv/root/bin/sandbox-agent"}
	r := &runner{lang: "python", fs: &runnerfs.Runner{Rootfs: "/srv/root/runners/python.0123456789ab/rootfs",
		Manifest: runnerfs.Manifest{Env: []string{"MPLBACKEND=Agg", "PATH=/image/path"}}}}
	args := b.bwrapArgs(r, "/srv/root/workspaces/w", "/srv/root/run/p-1", []string{"/cmd"})
	binds := map[string]string{}
	env := map[string]string{}
	for i := 0; i < len(args); i++ {
		switch args[i] {
		case "--bind", "--ro-bind", "--ro-bind-try", "--dev-bind", "--bind-try", "--dev-bind-try":
			binds[args[i+2]] = args[i] + " " + args[i+1]
			i += 2
		case "--setenv":
			env[args[i+1]] = args[i+2]
			i += 2
		case "--symlink":
			t.Errorf("symlink %s %s: the runner file system has its own", args[i+1], args[i+2])
		case "--":
			i = len(args)
		}
	}
	want := map[string]string{
		"/":                  "--ro-bind " + r.fs.Rootfs,
		"/mnt/data":          "--bind /srv/root/workspaces/w",
		"/run/sandbox":       "--bind /srv/root/run/p-1",
		AgentPath:            "--ro-bind /srv/root/bin/sandbox-agent",
		"/etc/passwd":        "--ro-bind /srv/root/etc-sandbox/passwd",
		"/etc/group":         "--ro-bind /srv/root/etc-sandbox/group",
		"/etc/hosts":         "--ro-bind /srv/root/etc-sandbox/hosts",
		"/etc/hostname":      "--ro-bind /srv/root/etc-sandbox/hostname",
		"/etc/nsswitch.conf": "--ro-bind /srv/root/etc-sandbox/nsswitch.conf",
	}
	if mustJSON(binds) != mustJSON(want) {
		t.Errorf("binds:\n%v\nwant\n%v", binds, want)
	}
	if args[slices.Index(args, "--ro-bind")+2] != "/" {
		t.Error("the root must be bound before anything is mounted on it")
	}
	if env["PATH"] != runnerPath || env["MPLBACKEND"] != "Agg" || env["HOME"] != "/tmp" {
		t.Errorf("env: %v", env)
	}
	for _, l := range Layout().Files {
		if _, ok := binds[l]; !ok {
			t.Errorf("layout file %s is not mounted over", l)
		}
	}
}

// copyRunners copies the runners in src to dst: as hard links when both
// are on one filesystem, else in full.
func copyRunners(src, dst string) error {
	if exec.Command("cp", "-a", "-l", src, dst).Run() == nil {
		return nil
	}
	_ = os.RemoveAll(dst)
	if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("copy the runners: %v: %s", err, out)
	}
	return nil
}

// TestRunnersOutsideRootWarned: sandboxes read a bind's source path in
// their mount table, so runner file systems outside SANDBOX_ROOT (and
// not on a filesystem of their own) are logged as visible; inside, they
// are not.
func TestRunnersOutsideRootWarned(t *testing.T) {
	for name, outside := range map[string]bool{"inside": false, "outside": true} {
		t.Run(name, func(t *testing.T) {
			var logs strings.Builder
			newBackend(t, func(o *Options) {
				dir := o.Root
				if outside {
					dir = newRoot(t)
				}
				o.RunnersDir = linkRunners(t, dir)
				o.Log = zerolog.New(&syncWriter{w: &logs})
			})
			if warned := strings.Contains(logs.String(), "runner_rootfs_path_visible_to_sandboxes"); warned != outside {
				t.Errorf("warned=%v for runners %s the root:\n%s", warned, name, logs.String())
			}
		})
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
