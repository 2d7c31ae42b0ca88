package process

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

func TestHelloPythonAndBash(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	res := exec1(t, s, "python", "print(1)", 20*time.Second)
	if string(res.Stdout) != "1\n" || res.ExitCode != 0 {
		t.Fatalf("python: %+v stderr=%q", res, res.Stderr)
	}
	res = exec1(t, s, "bash", "echo hello from bash", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "hello from bash" || res.ExitCode != 0 {
		t.Fatalf("bash: %+v stderr=%q", res, res.Stderr)
	}
}

func TestRunnersAndUnknownLanguage(t *testing.T) {
	b := newBackend(t, nil)
	rs, _ := b.Runners(context.Background())
	got := map[string]bool{}
	for _, r := range rs {
		got[r.Language] = true
	}
	for lang, bin := range map[string]string{"python": "python3", "bash": "bash", "javascript": "node"} {
		_, err := exec.LookPath("/usr/bin/" + bin)
		if (err == nil) != got[lang] {
			t.Errorf("runner %s listed=%v but /usr/bin/%s present=%v", lang, got[lang], bin, err == nil)
		}
	}
	s := open(t, b)
	_, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "cobol", Code: "x"})
	if brokererr.CodeOf(err) != brokererr.UnknownLanguage {
		t.Fatalf("unknown language: %v", err)
	}
	if b.Name() != "process" {
		t.Fatal(b.Name())
	}
}

func TestFilesPersistAndChanged(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	res := exec1(t, s, "python", "open('out.txt','w').write('hello')", 20*time.Second)
	if len(res.Changed) != 1 || res.Changed[0].Path != "out.txt" || res.Changed[0].Size != 5 {
		t.Fatalf("Changed = %+v", res.Changed)
	}
	res = exec1(t, s, "bash", "cat /mnt/data/out.txt; cat /data/out.txt", 20*time.Second)
	if string(res.Stdout) != "hellohello" {
		t.Fatalf("second run: %q %q", res.Stdout, res.Stderr)
	}
	f, err := s.ReadFile(context.Background(), "out.txt", 0, 0)
	if err != nil || string(f.Data) != "hello" {
		t.Fatalf("ReadFile: %v %q", err, f.Data)
	}
	if err := s.WriteFile(context.Background(), "in.txt", []byte("from host"), false); err != nil {
		t.Fatal(err)
	}
	res = exec1(t, s, "bash", "cat in.txt", 20*time.Second)
	if string(res.Stdout) != "from host" {
		t.Fatalf("host-written file: %q %q", res.Stdout, res.Stderr)
	}
	list, err := s.ListFiles(context.Background(), "")
	if err != nil || len(list) != 2 {
		t.Fatalf("ListFiles: %v %+v", err, list)
	}
}

func TestNoNetwork(t *testing.T) {
	eachRoot(t, nil, func(t *testing.T, b *Backend) { testNoNetwork(t, b) })
}

func testNoNetwork(t *testing.T, b *Backend) {
	s := open(t, b)
	res := exec1(t, s, "python", `
import socket
try:
    socket.create_connection(("1.1.1.1", 53), timeout=3)
    print("CONNECTED")
except OSError as e:
    print("refused", e.errno)
print([n for _, n in socket.if_nameindex()])
`, 20*time.Second)
	out := string(res.Stdout)
	if strings.Contains(out, "CONNECTED") || !strings.Contains(out, "refused") {
		t.Fatalf("network reachable: %q %q", out, res.Stderr)
	}
	if !strings.Contains(out, "['lo']") {
		t.Fatalf("interfaces other than lo: %q", out)
	}
}

func TestHostInvisible(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	other := open(t, b)
	if err := other.WriteFile(context.Background(), "secret.txt", []byte("s3cret"), false); err != nil {
		t.Fatal(err)
	}
	home, _ := os.UserHomeDir()
	paths := []string{"/root", "/home", filepath.Join(home, ".ssh"), filepath.Join(home, ".aws"), b.o.Root,
		other.ref.Dir, filepath.Join(other.ref.Dir, "secret.txt"), "/etc/shadow", "/etc/ssh", "/etc/sudoers",
		"/etc/resolv.conf", "/var", "/sys", "/opt/sandbox/other", testBase}
	code := "import os, json\nres = {}\nfor p in json.loads(" + strconv.Quote(mustJSON(paths)) + "):\n" +
		"    try:\n        open(p).read()\n        res[p] = 'READ'\n    except IsADirectoryError:\n        res[p] = 'DIR'\n    except OSError as e:\n        res[p] = e.errno\n" +
		"print(json.dumps(res))\nprint(sorted(os.listdir('/etc')))\nprint(sorted(os.listdir('/')))\n"
	res := exec1(t, s, "python", code, 20*time.Second)
	lines := strings.Split(strings.TrimSpace(string(res.Stdout)), "\n")
	if len(lines) != 3 {
		t.Fatalf("output: %q %q", res.Stdout, res.Stderr)
	}
	var got map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &got); err != nil {
		t.Fatal(err)
	}
	for _, p := range paths {
		if got[p] != float64(syscall.ENOENT) {
			t.Errorf("%s: %v, want ENOENT (not present in the sandbox)", p, got[p])
		}
	}
	wantEtc := "['alternatives', 'group', 'hostname', 'hosts', 'ld.so.cache', 'localtime', 'nsswitch.conf', 'passwd', 'ssl']"
	if _, err := os.Stat("/etc/matplotlibrc"); err == nil { // bound when the host has matplotlib
		wantEtc = strings.Replace(wantEtc, "'localtime', ", "'localtime', 'matplotlibrc', ", 1)
	}
	if lines[1] != wantEtc {
		t.Errorf("/etc = %s\nwant %s", lines[1], wantEtc)
	}
	if lines[2] != "['bin', 'data', 'dev', 'etc', 'lib', 'lib64', 'mnt', 'opt', 'proc', 'run', 'sbin', 'tmp', 'usr']" {
		t.Errorf("/ = %s", lines[2])
	}
	res = exec1(t, s, "bash", "id -u; id -g; cat /etc/passwd | cut -d: -f1 | tr '\\n' ,", 20*time.Second)
	if string(res.Stdout) != "1000\n1000\nroot,sandbox,nobody," {
		t.Errorf("identity: %q %q", res.Stdout, res.Stderr)
	}
}

// TestCredentialsInEveryRunner: code in every runner runs as uid and gid
// 1000 with no capabilities (not even bounding ones to regain by exec)
// and no_new_privs set, on both roots.
func TestCredentialsInEveryRunner(t *testing.T) {
	eachRoot(t, nil, func(t *testing.T, b *Backend) {
		rs, err := b.Runners(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		s := open(t, b)
		want := "Uid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n" +
			"CapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\n"
		for _, r := range rs {
			// Each language's own process reads its status.
			code := `grep -E '^(Uid|Gid|Cap[A-Za-z]+|NoNewPrivs):' /proc/self/status`
			switch r.Language {
			case "python":
				code = "import re; print(''.join(l for l in open('/proc/self/status') if re.match(r'(Uid|Gid|Cap[A-Za-z]+|NoNewPrivs):', l)), end='')"
			case "typescript", "javascript":
				code = "process.stdout.write(require('fs').readFileSync('/proc/self/status', 'utf8').split('\\n').filter(l => /^(Uid|Gid|Cap[A-Za-z]+|NoNewPrivs):/.test(l)).map(l => l + '\\n').join(''));"
			}
			res := exec1(t, s, r.Language, code, 60*time.Second)
			if string(res.Stdout) != want {
				t.Errorf("%s: credentials\n%s%s\nwant\n%s", r.Language, res.Stdout, res.Stderr, want)
			}
		}
	})
}

// TestNoNestedUserNamespaces: code cannot make a user namespace of its own
// (and so regain capabilities in it), on both roots.
func TestNoNestedUserNamespaces(t *testing.T) {
	eachRoot(t, nil, func(t *testing.T, b *Backend) {
		s := open(t, b)
		res := exec1(t, s, "python", `import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, flag in (("user", 0x10000000), ("user+net", 0x10000000 | 0x40000000)):
    rc = libc.unshare(flag)
    print(name, rc, os.strerror(ctypes.get_errno()) if rc else "UNSHARED")`, 20*time.Second)
		if want := "user -1 No space left on device\nuser+net -1 No space left on device\n"; string(res.Stdout) != want {
			t.Fatalf("unshare: %q %q, want %q", res.Stdout, res.Stderr, want)
		}
		res = exec1(t, s, "bash", "unshare -Urn id 2>&1; echo rc=$?", 20*time.Second)
		if string(res.Stdout) != "unshare: unshare failed: No space left on device\nrc=1\n" {
			t.Fatalf("unshare -Urn: %q %q", res.Stdout, res.Stderr)
		}
	})
}

// TestStrayDescriptorNeverReachesSandbox: the launch chain (wrapper,
// prlimit, bwrap) passes on whatever the broker holds without
// close-on-exec; the agent closes all of it before any code runs, so a
// host directory the broker leaked is out of reach (issue 15, defect 1,
// here without the broker's own close-on-exec pass).
func TestStrayDescriptorNeverReachesSandbox(t *testing.T) {
	eachRoot(t, nil, func(t *testing.T, b *Backend) { testStrayDescriptorNeverReachesSandbox(t, b) })
}

func testStrayDescriptorNeverReachesSandbox(t *testing.T, b *Backend) {
	dir := filepath.Join(newRoot(t), "hostdir")
	if err := os.Mkdir(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY, 0) // no O_CLOEXEC
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	s := open(t, b)
	res := exec1(t, s, "bash", fmt.Sprintf(`touch /proc/self/fd/%d/ESCAPED
ls /proc/$$/fd >/tmp/own-fds; echo "own: $(sort -n /tmp/own-fds | tr '\n' ' ')"
for f in /proc/[0-9]*/fd/*; do touch "$f/ESCAPED" 2>/dev/null && echo "wrote via $f"; done; true`, fd), 20*time.Second)
	if _, err := os.Lstat(filepath.Join(dir, "ESCAPED")); err == nil {
		t.Errorf("the sandbox wrote into the host directory: %q", res.Stdout)
	}
	if !strings.Contains(string(res.Stdout), "own: 0 1 2 255 \n") { // 255: bash's handle on its script
		t.Errorf("the run's descriptors: %q %q", res.Stdout, res.Stderr)
	}
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

func TestWritableOnlyWorkspaceAndTmp(t *testing.T) {
	eachRoot(t, nil, func(t *testing.T, b *Backend) { testWritableOnlyWorkspaceAndTmp(t, b) })
}

func testWritableOnlyWorkspaceAndTmp(t *testing.T, b *Backend) {
	s := open(t, b)
	res := exec1(t, s, "bash", `
for p in /x /usr/x /etc/x /etc/passwd /etc/shadow /opt/sandbox/broker /opt/x /run/x /run/sandbox-egress/x /dev/x /proc/x /mnt/x /bin/x /home/sandbox/x /var/tmp/x /run/lock/x /root/x; do
  if (echo hi > "$p") 2>/dev/null; then echo "WROTE $p"; fi
done
echo ok > /mnt/data/w && echo ok > /tmp/w && echo ok > /dev/shm/w && echo writable-ok
`, 20*time.Second)
	out := string(res.Stdout)
	if strings.Contains(out, "WROTE") || !strings.Contains(out, "writable-ok") {
		t.Fatalf("writes: %q %q", out, res.Stderr)
	}
}

func TestPidNamespace(t *testing.T) {
	eachRoot(t, nil, func(t *testing.T, b *Backend) { testPidNamespace(t, b) })
}

func testPidNamespace(t *testing.T, b *Backend) {
	s := open(t, b)
	res := exec1(t, s, "python", `
import os
pids = [int(p) for p in os.listdir('/proc') if p.isdigit()]
print(os.getpid() < 100, len(pids) < 20, max(pids) < 100)
`, 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "True True True" {
		t.Fatalf("pid namespace: %q %q", res.Stdout, res.Stderr)
	}
	// The test process (host pid) must be invisible.
	res = exec1(t, s, "bash", fmt.Sprintf("test -e /proc/%d/cmdline && grep -q process.test /proc/%d/cmdline && echo VISIBLE; echo done", os.Getpid(), os.Getpid()), 20*time.Second)
	if string(res.Stdout) != "done\n" {
		t.Fatalf("host process visible: %q", res.Stdout)
	}
}

// hostProcsWith lists host pids whose command line contains marker.
func hostProcsWith(marker string) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err == nil && strings.Contains(string(b), marker) {
			if st, ok := procStat(pid, pid); ok && st.State != 'Z' {
				out = append(out, pid)
			}
		}
	}
	return out
}

func TestTimeoutKillsSetsidDaemon(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	marker := strconv.Itoa(100000 + int(time.Now().UnixNano()%800000))
	res := exec1(t, s, "bash", "setsid sleep "+marker+" & disown; nohup sleep "+marker+" & sleep "+marker, time.Second)
	if !res.TimedOut {
		t.Fatalf("not timed out: %+v", res)
	}
	waitFor(t, 15*time.Second, "the daemon to die", func() bool { return len(hostProcsWith("sleep\x00"+marker)) == 0 })
	// The session still works (a fresh sandbox).
	if out := exec1(t, s, "python", "print(2)", 20*time.Second); string(out.Stdout) != "2\n" {
		t.Fatalf("after timeout: %q", out.Stdout)
	}
}

func TestDaemonAfterNormalExitIsSwept(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	marker := strconv.Itoa(100000 + int(time.Now().UnixNano()%800000))
	exec1(t, s, "bash", "setsid sleep "+marker+" >/dev/null 2>&1 < /dev/null & disown; echo started", 20*time.Second)
	waitFor(t, 15*time.Second, "the daemon to die", func() bool { return len(hostProcsWith("sleep\x00"+marker)) == 0 })
}

func TestRlimits(t *testing.T) {
	eachRoot(t, func(o *Options) {
		o.NProc = 48
		o.FSizeBytes = 1 << 20
		o.NoFile = 512
		o.CPUSeconds = 120
		o.AddressSpace = 3 << 30
	}, testRlimits)
}

func testRlimits(t *testing.T, b *Backend) {
	s := open(t, b)
	res := exec1(t, s, "bash", "cat /proc/self/limits", 20*time.Second)
	limits := string(res.Stdout)
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`Max cpu time\s+120\s+120\s+seconds`),
		regexp.MustCompile(`Max file size\s+1048576\s+1048576\s+bytes`),
		regexp.MustCompile(`Max processes\s+48\s+48\s+processes`),
		regexp.MustCompile(`Max open files\s+512\s+512\s+files`),
		regexp.MustCompile(`Max address space\s+3221225472\s+3221225472\s+bytes`),
		regexp.MustCompile(`Max core file size\s+0\s+0\s+bytes`),
	} {
		if !want.MatchString(limits) {
			t.Errorf("limits lack %s:\n%s", want, limits)
		}
	}
	// fsize: a 2 MiB write fails with EFBIG (python ignores SIGXFSZ).
	res = exec1(t, s, "python", `
import errno
try:
    with open('big', 'wb') as f:
        f.write(b'x' * (2 << 20))
    print("WROTE")
except OSError as e:
    print(errno.errorcode[e.errno])
`, 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "EFBIG" && res.Signal != "SIGXFSZ" {
		t.Fatalf("fsize: %+v", res)
	}
	if fi, err := os.Stat(filepath.Join(s.ref.Dir, "big")); err != nil || fi.Size() > 1<<20 {
		t.Fatalf("fsize: file %v %v", fi, err)
	}
	// nproc: forking stops with EAGAIN below the limit.
	res = exec1(t, s, "python", `
import os, signal, errno
kids = []
try:
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        kids.append(pid)
    print("UNLIMITED")
except OSError as e:
    print(errno.errorcode[e.errno], len(kids))
for k in kids:
    os.kill(k, 9)
`, 30*time.Second)
	f := strings.Fields(string(res.Stdout))
	if len(f) != 2 || f[0] != "EAGAIN" {
		t.Fatalf("nproc: %q %q", res.Stdout, res.Stderr)
	}
	if n, _ := strconv.Atoi(f[1]); n >= 48 || n < 1 {
		t.Fatalf("forked %d children under RLIMIT_NPROC 48", n)
	}
}

func TestForkBombContained(t *testing.T) {
	b := newBackend(t, func(o *Options) { o.NProc = 64 })
	s := open(t, b)
	start := time.Now()
	res := exec1(t, s, "bash", ":(){ :|:& };:; sleep 100", 3*time.Second)
	if !res.TimedOut {
		t.Fatalf("fork bomb run: %+v", res)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Fatalf("fork bomb took %s to contain", d)
	}
	if out := exec1(t, s, "python", "print(3)", 20*time.Second); string(out.Stdout) != "3\n" {
		t.Fatalf("after fork bomb: %q %q", out.Stdout, out.Stderr)
	}
}

func TestSessionsIsolated(t *testing.T) {
	b := newBackend(t, nil)
	a, c := open(t, b), open(t, b)
	exec1(t, a, "bash", "echo mine > a.txt", 20*time.Second)
	res := exec1(t, c, "bash", "ls -A /mnt/data; find / -path /proc -prune -o -name a.txt -print 2>/dev/null | wc -l", 20*time.Second)
	if string(res.Stdout) != "0\n" {
		t.Fatalf("session B sees A: %q", res.Stdout)
	}
	if current(t, a).id == current(t, c).id {
		t.Fatal("sessions share a sandbox")
	}
}

// liveTree returns the live processes of a sandbox and checks its cgroup
// holds them.
func liveTree(t *testing.T, sb *sbx) []procKey {
	tree := descendants(sb.pid)
	if len(tree) < 3 { // wrapper/bwrap, bwrap init, agent
		t.Fatalf("sandbox tree too small: %v", tree)
	}
	return tree
}

func allDead(tree []procKey) bool {
	for _, p := range tree {
		if alive(p) {
			return false
		}
	}
	return true
}

func TestReleaseAndDestroyLeaveNoProcesses(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	exec1(t, s, "bash", "echo kept > f.txt", 20*time.Second)
	sb := current(t, s)
	tree := liveTree(t, sb)
	cgDirs := []string{}
	if sb.cg != nil {
		cgDirs = sb.cg.dirs
		if n := len(sb.cg.pids()); n < len(tree) {
			t.Errorf("cgroup holds %d processes, tree has %d", n, len(tree))
		}
	}
	if err := s.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !allDead(tree) {
		t.Fatalf("processes survive Release: %v", tree)
	}
	for _, d := range append(cgDirs, sb.runDir, sb.pidFile) {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("%s still exists after Release", d)
		}
	}
	res := exec1(t, s, "bash", "cat f.txt", 20*time.Second)
	if string(res.Stdout) != "kept\n" {
		t.Fatalf("files after Release: %q", res.Stdout)
	}
	tree = liveTree(t, current(t, s))
	if err := s.Destroy(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !allDead(tree) {
		t.Fatalf("processes survive Destroy: %v", tree)
	}
	if _, err := os.Stat(s.ref.Dir); !os.IsNotExist(err) {
		t.Fatal("workspace survives Destroy")
	}
	if _, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: "true"}); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatalf("Exec after Destroy: %v", err)
	}
}

func TestCloseStopsEverySandbox(t *testing.T) {
	b := newBackend(t, nil)
	var trees [][]procKey
	for range 2 {
		s := open(t, b)
		exec1(t, s, "bash", "true", 20*time.Second)
		trees = append(trees, liveTree(t, current(t, s)))
	}
	if err := b.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, tr := range trees {
		if !allDead(tr) {
			t.Fatalf("processes survive Close: %v", tr)
		}
	}
	if _, err := b.Open(context.Background(), newRef(b)); brokererr.CodeOf(err) != brokererr.Unavailable {
		t.Fatalf("Open after Close: %v", err)
	}
}

func runEntries(t *testing.T, root string) []string {
	ents, err := os.ReadDir(filepath.Join(root, "run"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func TestOrphansSweptByNextNew(t *testing.T) {
	b1 := newBackend(t, nil)
	s := open(t, b1)
	exec1(t, s, "bash", "true", 20*time.Second)
	sb := current(t, s)
	tree := liveTree(t, sb)
	// A second broker on the same root (the first one crashed, as far as
	// it knows) kills the first one's sandboxes and clears run/.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b2, err := New(ctx, b1.o)
	if err != nil {
		t.Fatal(err)
	}
	defer b2.Close(ctx)
	if !allDead(tree) {
		t.Fatalf("orphans survive New: %v", tree)
	}
	if sb.cg != nil {
		for _, d := range sb.cg.dirs {
			if _, err := os.Stat(d); !os.IsNotExist(err) {
				t.Errorf("orphan cgroup %s survives", d)
			}
		}
	}
	if e := runEntries(t, b1.o.Root); len(e) != 0 {
		t.Fatalf("run dir not swept: %v", e)
	}
}

func TestBrokerDeathKillsSandbox(t *testing.T) {
	b := newBackend(t, nil) // checks bwrap; its root is reused
	root := b.o.Root
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "PROCESS_TEST_HELPER=orphan", "PROCESS_TEST_ROOT="+root, "PROCESS_TEST_AGENT="+agentBinary)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	var pid int
	line, err := bufio.NewReader(out).ReadString('\n')
	if _, serr := fmt.Sscanf(line, "pid %d", &pid); err != nil || serr != nil {
		t.Fatalf("helper: %q %v", line, err)
	}
	tree := descendants(pid)
	if len(tree) < 3 {
		t.Fatalf("helper's sandbox tree: %v", tree)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	waitFor(t, 15*time.Second, "the dead broker's sandbox to die", func() bool { return allDead(tree) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b2, err := New(ctx, b.o)
	if err != nil {
		t.Fatal(err)
	}
	defer b2.Close(ctx)
	if e := runEntries(t, root); len(e) != 0 {
		t.Fatalf("run dir not swept: %v", e)
	}
}

func TestAgentSocketSymlinkRefused(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	exec1(t, s, "bash", "true", 20*time.Second)
	// A host socket the sandbox must not make the broker dial.
	hostSock := filepath.Join(testBase, "host-"+randHex(4)+".sock")
	ln, err := net.Listen("unix", hostSock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- struct{}{}
			c.Close()
		}
	}()
	exec1(t, s, "bash", "ln -sf "+hostSock+" /run/sandbox/agent.sock.new && mv -f /run/sandbox/agent.sock.new /run/sandbox/agent.sock", 20*time.Second)
	_, err = s.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: "true", Timeout: 5 * time.Second})
	if brokererr.CodeOf(err) != brokererr.Unavailable {
		t.Fatalf("Exec through a swapped socket: %v", err)
	}
	select {
	case <-accepted:
		t.Fatal("the broker dialled the host socket the sandbox pointed it at")
	default:
	}
	// The next call gets a fresh sandbox.
	if res := exec1(t, s, "bash", "echo ok", 20*time.Second); string(res.Stdout) != "ok\n" {
		t.Fatalf("after swap: %q", res.Stdout)
	}
}

func TestBwrapArgsBindOnlyWhatTheyShould(t *testing.T) {
	b := &Backend{o: withDefaults(Options{Root: "/srv/root"}), etcDir: "/srv/root/etc-sandbox", agent: "/srv/root/bin/sandbox-agent"}
	args := b.bwrapArgs(&runner{}, "/srv/root/workspaces/w", "/srv/root/run/p-1", []string{"/cmd"})
	allowed := map[string]bool{"/usr": true, "/srv/root/workspaces/w": true, "/srv/root/run/p-1": true, "/srv/root/bin/sandbox-agent": true}
	for _, p := range hostEtc {
		allowed[p] = true
	}
	for n := range etcFiles {
		allowed["/srv/root/etc-sandbox/"+n] = true
	}
	for _, d := range usrLinks {
		if fi, err := os.Lstat("/" + d); err == nil && fi.IsDir() {
			allowed["/"+d] = true
		}
	}
	flags := map[string]bool{}
	for i := 0; i < len(args); i++ {
		a := args[i]
		flags[a] = true
		switch a {
		case "--bind", "--ro-bind", "--ro-bind-try", "--dev-bind", "--bind-try", "--dev-bind-try":
			if !allowed[args[i+1]] {
				t.Errorf("unexpected host path bound: %s %s", a, args[i+1])
			}
			if a == "--bind" && args[i+1] != "/srv/root/workspaces/w" && args[i+1] != "/srv/root/run/p-1" {
				t.Errorf("writable bind of %s", args[i+1])
			}
			i += 2
		case "--":
			if strings.Join(args[i+1:], " ") != "/cmd" {
				t.Errorf("command: %v", args[i+1:])
			}
			i = len(args)
		}
	}
	for _, f := range []string{"--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
		"--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "--remount-ro"} {
		if !flags[f] {
			t.Errorf("missing %s", f)
		}
	}
	if flags["--share-net"] || flags["--dev-bind"] {
		t.Error("forbidden flag present")
	}
}

func TestEgressListenerReachableFromSandbox(t *testing.T) {
	eachRoot(t, nil, testEgressListenerReachableFromSandbox)
}

func testEgressListenerReachableFromSandbox(t *testing.T, b *Backend) {
	s := open(t, b)
	exec1(t, s, "python", "pass", 20*time.Second) // the sandbox python runs in (one per runner on runner file systems)
	sb := current(t, s)
	name := "egress-" + sandbox.NewID() + ".sock"
	ln, err := b.egressListener(filepath.Join(sb.runDir, name), s.uid, s.gid)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	fi, err := os.Lstat(filepath.Join(sb.runDir, name))
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); fi.Mode()&os.ModeSocket == 0 || int(st.Uid) != s.uid {
		t.Fatalf("socket mode %v owner %d, want a socket owned by the session's uid %d", fi.Mode(), st.Uid, s.uid)
	}
	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			got <- err.Error()
			return
		}
		defer c.Close()
		buf := make([]byte, 16)
		n, _ := c.Read(buf)
		got <- string(buf[:n])
	}()
	res := exec1(t, s, "python", `
import socket
c = socket.socket(socket.AF_UNIX)
c.connect("/run/sandbox/`+name+`")
c.sendall(b"via-egress")
c.close()
print("sent")
`, 20*time.Second)
	if string(res.Stdout) != "sent\n" {
		t.Fatalf("sandbox could not reach the egress socket: %q %q", res.Stdout, res.Stderr)
	}
	if m := <-got; m != "via-egress" {
		t.Fatalf("host received %q", m)
	}
}

func BenchmarkExecPrint(b *testing.B) {
	be := newBackend(b, nil)
	s := open(b, be)
	waitZygote(b, s)
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		res := exec1(b, s, "python", "print(1)", 20*time.Second)
		lat = append(lat, time.Since(start))
		if string(res.Stdout) != "1\n" {
			b.Fatalf("stdout %q", res.Stdout)
		}
	}
	b.StopTimer()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*95/100].Microseconds())/1000, "p95-ms")
}

// BenchmarkExecPrintRootfs interleaves, per iteration, print(1) on the
// host's Python, print(1) on the python runner's file system and
// console.log(1) on the typescript runner's, each in a warm sandbox: the
// backend alone, without the broker, under the same load.
func BenchmarkExecPrintRootfs(b *testing.B) {
	host, rootfs := open(b, newBackend(b, nil)), open(b, newRootfsBackend(b, nil))
	cases := []struct {
		name, lang, code string
		s                *Session
	}{
		{"host-py", "python", "print(1)", host},
		{"rootfs-py", "python", "print(1)", rootfs},
		{"rootfs-ts", "typescript", "console.log(1)", rootfs},
	}
	lat := make([][]time.Duration, len(cases))
	for _, c := range cases {
		exec1(b, c.s, c.lang, c.code, time.Minute) // start + warm
	}
	waitZygote(b, host)
	waitZygote(b, rootfs)
	b.ResetTimer()
	for range b.N {
		for i, c := range cases {
			start := time.Now()
			res := exec1(b, c.s, c.lang, c.code, time.Minute)
			lat[i] = append(lat[i], time.Since(start))
			if string(res.Stdout) != "1\n" {
				b.Fatalf("%s: stdout %q stderr %q", c.name, res.Stdout, res.Stderr)
			}
		}
	}
	b.StopTimer()
	for i, c := range cases {
		l := lat[i]
		sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
		b.ReportMetric(float64(l[len(l)/2].Microseconds())/1000, c.name+"-p50-ms")
		b.ReportMetric(float64(l[len(l)*95/100].Microseconds())/1000, c.name+"-p95-ms")
	}
	b.ReportMetric(0, "ns/op")
}

// Each session runs as a host uid of its own, so one session's processes
// count against its own RLIMIT_NPROC, and it cannot signal another's.
func TestSessionsRunAsTheirOwnHostUIDs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("per-session uids need a root broker")
	}
	eachRoot(t, func(o *Options) { o.NProc = 40 }, testSessionsRunAsTheirOwnHostUIDs)
}

func testSessionsRunAsTheirOwnHostUIDs(t *testing.T, b *Backend) {
	s1, s2 := open(t, b), open(t, b)
	uidOf := func(s *Session) int {
		out := exec1(t, s, "bash", "echo started", 20*time.Second)
		if string(out.Stdout) != "started\n" {
			t.Fatalf("run: %+v", out)
		}
		// The real uid of the sandbox's outer process, as the kernel sees it.
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", current(t, s).pid))
		if err != nil {
			t.Fatal(err)
		}
		var uid int
		for _, l := range strings.Split(string(status), "\n") {
			if f := strings.Fields(l); len(f) > 1 && f[0] == "Uid:" {
				uid, _ = strconv.Atoi(f[1])
			}
		}
		if uid != s.uid {
			t.Fatalf("sandbox runs as uid %d, session's is %d", uid, s.uid)
		}
		return uid
	}
	u1, u2 := uidOf(s1), uidOf(s2)
	if u1 == u2 || u1 < b.uid || u1 >= b.uid+testUIDs || u2 < b.uid || u2 >= b.uid+testUIDs {
		t.Fatalf("uids %d and %d (range %d+%d)", u1, u2, b.uid, testUIDs)
	}
	// The same workspace keeps its uid (its files stay writable).
	if a, _, err := b.sessionIDs(context.Background(), s1.ref.WorkspaceID); err != nil || a != u1 {
		t.Fatalf("uid %d, then %d (%v)", u1, a, err)
	}
	// While s1 holds every process its limit allows, s2 still starts some.
	hog := `import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        n += 1
except OSError:
    pass
open("hogging", "w").write(str(n))
time.sleep(20)
`
	hogDone := make(chan sandbox.ExecResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		res, _ := s1.Exec(ctx, sandbox.ExecRequest{Language: "python", Code: hog, Timeout: 5 * time.Second, MaxOutputBytes: 1 << 10})
		hogDone <- res
	}()
	marker := filepath.Join(s1.ref.Dir, "hogging")
	waitFor(t, 20*time.Second, "s1 to reach its process limit", func() bool { _, err := os.Stat(marker); return err == nil })
	if n, _ := os.ReadFile(marker); string(n) == "1000" {
		t.Fatalf("s1 was not limited: %s processes", n)
	}
	res := exec1(t, s2, "bash", "for i in 1 2 3 4 5; do sleep 0.1 & done; wait; echo ok", 20*time.Second)
	if string(res.Stdout) != "ok\n" {
		t.Fatalf("s2 starved by s1's processes: %+v", res)
	}
	if r := <-hogDone; !r.TimedOut {
		t.Fatalf("hog: %+v", r)
	}
}
