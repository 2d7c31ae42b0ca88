package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// syncBuf collects the agent's log for failing tests.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type testAgent struct {
	sock    string
	workDir string
	zygotes chan int // pids of zygotes that became ready
	log     *syncBuf
}

// startAgent runs Serve in descendants sweep mode in a goroutine and waits
// until it answers. With python and the zygote enabled it also waits for
// the first zygote.
func startAgent(tb testing.TB, opts Options) *testAgent {
	tb.Helper()
	if _, err := exec.LookPath("python3"); err != nil && opts.Language == LangPython {
		tb.Fatalf("python3 is required for these tests: %v", err)
	}
	dir := tb.TempDir()
	ta := &testAgent{
		sock:    filepath.Join(dir, "agent.sock"),
		workDir: filepath.Join(dir, "work"),
		zygotes: make(chan int, 16),
	}
	if err := os.Mkdir(ta.workDir, 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "tmp"), 0o700); err != nil {
		tb.Fatal(err)
	}
	log := &syncBuf{}
	ta.log = log
	opts.Socket = ta.sock
	opts.WorkDir = ta.workDir
	opts.TmpDir = filepath.Join(dir, "tmp")
	opts.Sweep = SweepDescendants
	opts.Log = log
	opts.zygoteReady = func(pid int) {
		select {
		case ta.zygotes <- pid:
		default:
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- Serve(ctx, opts) }()
	tb.Cleanup(func() {
		cancel()
		if err := <-errc; err != nil {
			tb.Errorf("Serve: %v", err)
		}
		if tb.Failed() {
			tb.Logf("agent log:\n%s", log.String())
		}
	})
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if err := WaitReady(wctx, ta.sock); err != nil {
		tb.Fatal(err)
	}
	return ta
}

// zygotePID waits for the next zygote to become ready.
func (ta *testAgent) zygotePID(tb testing.TB) int {
	tb.Helper()
	select {
	case pid := <-ta.zygotes:
		return pid
	case <-time.After(60 * time.Second):
		tb.Fatal("no zygote became ready")
	}
	return 0
}

func (ta *testAgent) run(tb testing.TB, req Request) Response {
	tb.Helper()
	resp, err := Run(context.Background(), ta.sock, req)
	if err != nil {
		tb.Fatalf("Run: %v", err)
	}
	return resp
}

func py(code string) Request { return Request{Language: LangPython, Code: code, TimeoutMS: 20_000} }

// leftovers lists live (non-zombie) descendants of the test process that
// are not protected zygotes or their idle spares.
func leftovers(tb testing.TB) []procInfo {
	tb.Helper()
	procs, _, err := listProcs("/proc")
	if err != nil {
		tb.Fatal(err)
	}
	spawnMu.Lock()
	defer spawnMu.Unlock()
	var out []procInfo
	targets, _ := sweepTargets(SweepDescendants, procs, os.Getpid())
	for _, p := range targets {
		if !protected[p.pid] && !spareOfZygote(p) && p.state != 'Z' && p.state != 'X' {
			out = append(out, p)
		}
	}
	return out
}

func describe(ps []procInfo) string {
	var b strings.Builder
	for _, p := range ps {
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.pid))
		fmt.Fprintf(&b, "  pid %d ppid %d state %c: %q\n", p.pid, p.ppid, p.state, bytes.ReplaceAll(cmd, []byte{0}, []byte{' '}))
	}
	return b.String()
}

func assertNoLeftovers(tb testing.TB) {
	tb.Helper()
	if ps := leftovers(tb); len(ps) > 0 {
		tb.Fatalf("processes left after the run:\n%s", describe(ps))
	}
}

// bothModes runs f against a zygote agent and a direct-spawn agent.
func bothModes(t *testing.T, f func(t *testing.T, ta *testAgent)) {
	t.Run("zygote", func(t *testing.T) {
		ta := startAgent(t, Options{Language: LangPython})
		ta.zygotePID(t)
		f(t, ta)
	})
	t.Run("direct", func(t *testing.T) {
		f(t, startAgent(t, Options{Language: LangPython, NoZygote: true}))
	})
}

func TestPythonBasics(t *testing.T) {
	bothModes(t, func(t *testing.T, ta *testAgent) {
		wantZygote := strings.HasSuffix(t.Name(), "/zygote")
		cases := []struct {
			name, code   string
			exit         int
			stdout       string
			stderrSubstr []string
		}{
			{"print", "print(1)", 0, "1\n", nil},
			{"stderr", "import sys\nprint('out')\nprint('err', file=sys.stderr)", 0, "out\n", []string{"err\n"}},
			{"exit3", "import sys\nsys.exit(3)", 3, "", nil},
			{"exitmsg", "import sys\nsys.exit('bye')", 1, "", []string{"bye"}},
			{"exception", "print('before')\ndef f():\n    raise ValueError('boom')\nf()", 1, "before\n",
				[]string{"Traceback (most recent call last):", "main.py\", line 4, in <module>", "ValueError: boom"}},
			{"cwd", "import os\nprint(os.getcwd())", 0, ta.workDir + "\n", nil},
			{"argv-main", "import sys\nprint(__name__, sys.argv[0].endswith('main.py'))", 0, "__main__ True\n", nil},
			{"syspath", "import sys, os\nprint(sys.path[0] == os.path.dirname(__file__), '' not in sys.path)", 0, "True True\n", nil},
			{"stdin-devnull", "import sys\nprint(repr(sys.stdin.read()))", 0, "''\n", nil},
			{"env", "import os\nprint(os.environ['HOME'], os.environ['MPLBACKEND'], os.environ['PYTHONUNBUFFERED'])", 0, "/tmp " + figuresBackend + " 1\n", nil},
			{"atexit", "import atexit\natexit.register(lambda: print('bye'))\nprint('hi')", 0, "hi\nbye\n", nil},
			{"thread-joined", "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.05), print('t'))).start()", 0, "t\n", nil},
			{"unicode", "print('h\\u00e9\\u2603')", 0, "h\u00e9\u2603\n", nil},
		}
		for _, c := range cases {
			resp := ta.run(t, py(c.code))
			if resp.Error != "" || resp.ExitCode != c.exit || string(resp.Stdout) != c.stdout || resp.TimedOut || resp.Truncated {
				t.Errorf("%s: got exit %d stdout %q stderr %q error %q timedOut %v", c.name, resp.ExitCode, resp.Stdout, resp.Stderr, resp.Error, resp.TimedOut)
			}
			for _, s := range c.stderrSubstr {
				if !strings.Contains(string(resp.Stderr), s) {
					t.Errorf("%s: stderr %q lacks %q", c.name, resp.Stderr, s)
				}
			}
			if c.stderrSubstr == nil && len(resp.Stderr) != 0 {
				t.Errorf("%s: unexpected stderr %q", c.name, resp.Stderr)
			}
			if resp.Zygote != wantZygote {
				t.Errorf("%s: Zygote = %v, want %v", c.name, resp.Zygote, wantZygote)
			}
		}
		if strings.Contains(t.Name(), "zygote") {
			// No zygote frames leak into tracebacks.
			resp := ta.run(t, py("raise KeyError(1)"))
			if strings.Count(string(resp.Stderr), "File ") != 1 {
				t.Errorf("traceback has foreign frames:\n%s", resp.Stderr)
			}
		}
	})
}

func TestBash(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	resp := ta.run(t, Request{Code: "echo hello\necho oops >&2\nexit 4", TimeoutMS: 5000})
	if resp.Error != "" || resp.ExitCode != 4 || string(resp.Stdout) != "hello\n" || string(resp.Stderr) != "oops\n" {
		t.Fatalf("got %+v", resp)
	}
	resp = ta.run(t, Request{Language: LangBash, Code: "kill -SEGV $$"})
	if resp.ExitCode != -1 || resp.Signal != "SIGSEGV" {
		t.Fatalf("self-kill: got exit %d signal %q", resp.ExitCode, resp.Signal)
	}
	resp = ta.run(t, Request{Language: LangBash, Code: "pwd; echo $HOME $LANG"})
	if got, want := string(resp.Stdout), ta.workDir+"\n/tmp C.UTF-8\n"; got != want {
		t.Fatalf("stdout %q, want %q", got, want)
	}
}

func TestNodeLanguages(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	if _, err := exec.LookPath("node"); err != nil {
		t.Fatalf("node is required for this test: %v", err)
	}
	resp := ta.run(t, Request{Language: LangJavaScript, Code: "console.log(1+1); console.error('e'); process.exit(2)"})
	if resp.Error != "" || resp.ExitCode != 2 || string(resp.Stdout) != "2\n" || string(resp.Stderr) != "e\n" {
		t.Fatalf("javascript: got %+v", resp)
	}
	resp = ta.run(t, Request{Language: LangTypeScript, Code: "const x: number = 1; console.log(x)"})
	if _, err := exec.LookPath("tsx"); err != nil {
		if !strings.Contains(resp.Error, `typescript: interpreter "tsx" not found`) {
			t.Fatalf("typescript without tsx: want a clear Error, got %+v", resp)
		}
	} else if resp.Error != "" || string(resp.Stdout) != "1\n" {
		t.Fatalf("typescript with tsx: got %+v", resp)
	}
	resp = ta.run(t, Request{Language: "cobol", Code: "x"})
	if !strings.Contains(resp.Error, `unknown language "cobol"`) {
		t.Fatalf("unknown language: got %+v", resp)
	}
}

func TestInjectedCommands(t *testing.T) {
	ta := startAgent(t, Options{Language: "shish", Commands: map[string]Command{
		"shish": {Argv: []string{"sh", "-e"}, Ext: ".sh"},
	}})
	resp := ta.run(t, Request{Code: "case $0 in *main.sh) echo ok;; esac; false; echo unreachable"})
	if resp.ExitCode != 1 || string(resp.Stdout) != "ok\n" {
		t.Fatalf("got %+v", resp)
	}
}

func TestOutputCap(t *testing.T) {
	bothModes(t, func(t *testing.T, ta *testAgent) {
		start := time.Now()
		req := py("import sys\nchunk = 'x' * 1023 + '\\n'\nfor _ in range(10 * 1024):\n    sys.stdout.write(chunk)\n    sys.stderr.write(chunk)\nprint('done', file=sys.stderr)")
		req.MaxOutputBytes = 1000
		resp := ta.run(t, req)
		if resp.Error != "" || resp.ExitCode != 0 || !resp.Truncated || len(resp.Stdout) != 1000 || len(resp.Stderr) != 1000 {
			t.Fatalf("got exit %d truncated %v len(stdout) %d len(stderr) %d error %q", resp.ExitCode, resp.Truncated, len(resp.Stdout), len(resp.Stderr), resp.Error)
		}
		if d := time.Since(start); d > 15*time.Second {
			t.Fatalf("took %v", d)
		}
		// Default cap.
		resp = ta.run(t, py("print('y' * (1 << 20))"))
		if !resp.Truncated || len(resp.Stdout) != DefaultMaxOutputBytes {
			t.Fatalf("default cap: truncated %v len %d", resp.Truncated, len(resp.Stdout))
		}
		// Exactly at the cap is not truncated.
		req = py("import sys; sys.stdout.write('z' * 500)")
		req.MaxOutputBytes = 500
		if resp = ta.run(t, req); resp.Truncated || len(resp.Stdout) != 500 {
			t.Fatalf("at cap: truncated %v len %d", resp.Truncated, len(resp.Stdout))
		}
	})
}

func TestTimeoutBusyLoop(t *testing.T) {
	bothModes(t, func(t *testing.T, ta *testAgent) {
		req := py("while True:\n    pass")
		req.TimeoutMS = 500
		start := time.Now()
		resp := ta.run(t, req)
		elapsed := time.Since(start)
		if !resp.TimedOut || resp.ExitCode != -1 || resp.Signal != "SIGKILL" || resp.Error != "" {
			t.Fatalf("got %+v", resp)
		}
		if elapsed > 2500*time.Millisecond || resp.DurationMS < 500 {
			t.Fatalf("elapsed %v, duration %d ms", elapsed, resp.DurationMS)
		}
		assertNoLeftovers(t)
	})
}

func TestTimeoutTrapTerm(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	start := time.Now()
	resp := ta.run(t, Request{Code: "trap '' TERM INT HUP\nsleep 1000", TimeoutMS: 500})
	if !resp.TimedOut || resp.Signal != "SIGKILL" || time.Since(start) > 2500*time.Millisecond {
		t.Fatalf("got %+v after %v", resp, time.Since(start))
	}
	assertNoLeftovers(t)
}

func TestSweepDaemons(t *testing.T) {
	t.Run("bash", func(t *testing.T) {
		ta := startAgent(t, Options{Language: LangBash})
		start := time.Now()
		// The setsid'd sleep keeps the stdout pipe open: the run must still
		// end promptly (the sweep kills it) and report the output.
		resp := ta.run(t, Request{Code: "(setsid sleep 1000 &)\n(setsid bash -c 'trap \"\" TERM; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &)\nfor i in $(seq 20); do sleep 1000 & done\necho started", TimeoutMS: 10_000})
		if resp.Error != "" || resp.ExitCode != 0 || resp.TimedOut || string(resp.Stdout) != "started\n" {
			t.Fatalf("got %+v", resp)
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("took %v", time.Since(start))
		}
		assertNoLeftovers(t)
	})
	bothModes(t, func(t *testing.T, ta *testAgent) {
		// A classic double-fork daemon, and a small fork chain.
		code := `import os, time, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.closerange(0, 3)
        while True:
            time.sleep(1)
    os._exit(0)
for _ in range(5):
    if os.fork() != 0:
        break
    os.setsid()
else:
    time.sleep(1000)
print('parent', os.getpid(), flush=True)
`
		resp := ta.run(t, py(code))
		if resp.Error != "" || resp.TimedOut || !strings.Contains(string(resp.Stdout), "parent") {
			t.Fatalf("got %+v", resp)
		}
		assertNoLeftovers(t)
	})
	t.Run("fork-bomb", func(t *testing.T) {
		ta := startAgent(t, Options{Language: LangBash})
		// Bounded so that a broken sweep cannot take the host down.
		resp := ta.run(t, Request{Code: "b() { [ $1 -gt 0 ] && { b $(($1-1)) & b $(($1-1)) & }; sleep 1000; }\nb 5", TimeoutMS: 1000})
		if !resp.TimedOut {
			t.Fatalf("got %+v", resp)
		}
		assertNoLeftovers(t)
	})
}

func TestZygote(t *testing.T) {
	ta := startAgent(t, Options{Language: LangPython})
	zpid := ta.zygotePID(t)

	t.Run("marker", func(t *testing.T) {
		resp := ta.run(t, py("import os\nprint(os.getppid(), os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid())"))
		if want := fmt.Sprintf("%d True True\n", zpid); string(resp.Stdout) != want || !resp.Zygote {
			t.Fatalf("stdout %q zygote %v, want %q (child of the zygote, own session)", resp.Stdout, resp.Zygote, want)
		}
		if ok, err := Ping(context.Background(), ta.sock, false); err != nil || !ok {
			t.Fatalf("Ping = %v, %v; want zygote ready", ok, err)
		}
	})
	t.Run("no-state-leak", func(t *testing.T) {
		resp := ta.run(t, py("import builtins, sys, csv\nbuiltins.LEAK = 1\nsys.modules['leaky'] = sys\nGLOBAL = 2\nprint('set')"))
		if string(resp.Stdout) != "set\n" {
			t.Fatalf("run 1: %+v", resp)
		}
		resp = ta.run(t, py("import builtins, sys\nprint(hasattr(builtins, 'LEAK'), 'leaky' in sys.modules, 'GLOBAL' in globals(), 'csv' in sys.modules)"))
		if string(resp.Stdout) != "False False False False\n" {
			t.Fatalf("state leaked between runs: %q %q", resp.Stdout, resp.Stderr)
		}
	})
	t.Run("random-reseeded", func(t *testing.T) {
		code := "import random\nprint(random.random())"
		a, b := ta.run(t, py(code)), ta.run(t, py(code))
		if bytes.Equal(a.Stdout, b.Stdout) {
			t.Fatalf("two runs produced the same random number %q", a.Stdout)
		}
	})
	t.Run("code-kills-zygote", func(t *testing.T) {
		// The run kills its own zygote: the run still completes with its
		// status (the orphan is re-parented to the agent) and a new zygote
		// comes up.
		// Kill the zygote by pid, not via getppid(): under load the run
		// may fall back to a direct spawn whose parent is this test binary.
		// The marker file proves the code ran exactly once: a zygote that
		// dies before the agent learns the child's pid must not lead to the
		// fallback running the code a second time.
		resp := ta.run(t, py(fmt.Sprintf("import os, signal\nopen('runs.txt', 'a').write('x')\nos.kill(%d, signal.SIGKILL)\nprint('survived')\nraise SystemExit(5)", zpid)))
		if string(resp.Stdout) != "survived\n" || resp.ExitCode != 5 {
			t.Fatalf("got %+v", resp)
		}
		if b, err := os.ReadFile(filepath.Join(ta.workDir, "runs.txt")); err != nil || string(b) != "x" {
			t.Fatalf("the code ran %q times (want exactly once): %v", b, err)
		}
		newPID := ta.zygotePID(t)
		if newPID == zpid {
			t.Fatal("zygote pid did not change")
		}
		zpid = newPID
		resp = ta.run(t, py("import os\nprint(os.getppid())"))
		if string(resp.Stdout) != fmt.Sprintf("%d\n", zpid) || !resp.Zygote {
			t.Fatalf("after restart: %+v (zygote %d)", resp, zpid)
		}
	})
	t.Run("pages-learnt", func(t *testing.T) {
		// The zygote learnt which pages a run writes (this kernel has
		// pagemap's exclusive bit and MADV_POPULATE_WRITE); its spares
		// copy them while idle.
		m := regexp.MustCompile(fmt.Sprintf(`zygote %d preloaded .*; its spares copy (\d+) pages ahead`, zpid)).FindStringSubmatch(ta.log.String())
		if m == nil || m[1] == "0" {
			t.Fatalf("no pages learnt: %q in\n%s", m, ta.log.String())
		}
	})
	t.Run("tampered-spare", func(t *testing.T) {
		// Code of a run tampers with the idle spare that will take the
		// next run: a signal left pending for it, or its limits changed.
		// The spare turns the job down and the run goes to another
		// spare, exactly once.
		for i, tamper := range []string{"os.kill(pid, signal.SIGUSR1)", "resource.prlimit(pid, resource.RLIMIT_NOFILE, (64, 64))"} {
			resp := ta.run(t, py(findSpare+tamper+"\nprint(pid)"))
			if resp.ExitCode != 0 {
				t.Fatalf("tampering run: %+v", resp)
			}
			runs := fmt.Sprintf("runs%d.txt", i)
			resp = ta.run(t, py(fmt.Sprintf("import os\nopen(%q, 'a').write('x')\nprint(os.getppid())", runs)))
			if resp.ExitCode != 0 || !resp.Zygote || string(resp.Stdout) != fmt.Sprintf("%d\n", zpid) {
				t.Fatalf("%s: the next run: %+v", tamper, resp)
			}
			if b, err := os.ReadFile(filepath.Join(ta.workDir, runs)); err != nil || string(b) != "x" {
				t.Fatalf("%s: the code ran %q times (want exactly once): %v", tamper, b, err)
			}
			if n := strings.Count(ta.log.String(), "did not take the run"); n != i+1 {
				t.Fatalf("%s: %d runs turned down, want %d", tamper, n, i+1)
			}
		}
	})
	t.Run("tampered-zygote", func(t *testing.T) {
		// Code of a run lowers its zygote's limits, which every later
		// spare would be born with: the zygote exits at its next fork,
		// and no run gets the lowered limits.
		resp := ta.run(t, py("import os, resource\nresource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (64, 64))\nprint(os.getppid())"))
		if resp.ExitCode != 0 || string(resp.Stdout) != fmt.Sprintf("%d\n", zpid) {
			t.Fatalf("tampering run: %+v", resp)
		}
		for range 3 {
			resp = ta.run(t, py("import resource\nopen('runs-z.txt', 'a').write('x')\nprint(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"))
			if resp.ExitCode != 0 || string(resp.Stdout) == "64\n" {
				t.Fatalf("a run with the zygote's lowered limits: %+v", resp)
			}
		}
		if b, err := os.ReadFile(filepath.Join(ta.workDir, "runs-z.txt")); err != nil || string(b) != "xxx" {
			t.Fatalf("three runs wrote %q (want each exactly once): %v", b, err)
		}
		newPID := ta.zygotePID(t)
		if newPID == zpid {
			t.Fatal("zygote pid did not change")
		}
		// Its replacement starts once the old one is waited for, stderr
		// and all.
		if !strings.Contains(ta.log.String(), fmt.Sprintf("zygote %d: its limits were changed", zpid)) {
			t.Fatalf("the zygote did not say why it left:\n%s", ta.log.String())
		}
		zpid = newPID
	})
	t.Run("killed-zygote", func(t *testing.T) {
		if err := syscall.Kill(zpid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		// The next run works whether or not the replacement is ready yet.
		resp := ta.run(t, py("print('ok')"))
		if string(resp.Stdout) != "ok\n" || resp.ExitCode != 0 {
			t.Fatalf("got %+v", resp)
		}
		newPID := ta.zygotePID(t)
		if newPID == zpid {
			t.Fatal("zygote pid did not change")
		}
		zpid = newPID
		resp = ta.run(t, py("import os\nprint(os.getppid())"))
		if string(resp.Stdout) != fmt.Sprintf("%d\n", zpid) || !resp.Zygote {
			t.Fatalf("after restart: %+v (zygote %d)", resp, zpid)
		}
	})
	t.Run("wedged-zygote-falls-back", func(t *testing.T) {
		// A stopped zygote forks no spare: its idle spare, if it had
		// forked one, takes one run; the next run finds none, falls back
		// to python3 after zygoteReplyTimeout, and the zygote is replaced.
		if err := syscall.Kill(zpid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		var resp Response
		for range 2 {
			if resp = ta.run(t, py("import os\nprint(os.getppid())")); !resp.Zygote {
				break
			}
		}
		if resp.Zygote || resp.ExitCode != 0 || string(resp.Stdout) != fmt.Sprintf("%d\n", os.Getpid()) {
			t.Fatalf("want a direct run (parent = agent %d), got %+v", os.Getpid(), resp)
		}
		newPID := ta.zygotePID(t)
		if newPID == zpid {
			t.Fatal("zygote pid did not change")
		}
		if resp = ta.run(t, py("print(1)")); !resp.Zygote {
			t.Fatalf("after replacement: %+v", resp)
		}
	})
}

// findSpare is Python that waits for the zygote's next idle spare (its
// child other than this run) and leaves its pid in pid.
const findSpare = `import os, resource, signal, time
me, zygote = os.getpid(), os.getppid()
def spare():
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me:
            continue
        try:
            st = open("/proc/%s/stat" % p).read()
        except OSError:
            continue
        f = st[st.rindex(")") + 2:].split()
        if int(f[1]) == zygote and f[0] not in "ZX" and int(f[3]) != int(p):
            return int(p)
deadline = time.time() + 10
pid = spare()
while pid is None and time.time() < deadline:
    time.sleep(0.005)
    pid = spare()
`

func TestSerialised(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	// Each run records its start and end; runs must not overlap.
	log := filepath.Join(ta.workDir, "log")
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			code := fmt.Sprintf("echo start%d >> %s; sleep 0.1; echo end%d >> %s", i, log, i, log)
			if resp := ta.run(t, Request{Code: code, TimeoutMS: 10_000}); resp.ExitCode != 0 {
				t.Errorf("run %d: %+v", i, resp)
			}
		}()
	}
	wg.Wait()
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Fields(string(b))
	if len(lines) != 6 {
		t.Fatalf("log %q", b)
	}
	for i := 0; i < 6; i += 2 {
		if strings.TrimPrefix(lines[i], "start") != strings.TrimPrefix(lines[i+1], "end") {
			t.Fatalf("runs overlapped: %q", lines)
		}
	}
}

// rawExchange writes raw bytes and returns the decoded response.
func rawExchange(t *testing.T, sock string, payload []byte) Response {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	go func() { _, _ = c.Write(payload) }() // may fail once the agent gives up
	b, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatal(err)
	}
	resp, err := decodeResponse(b)
	if err != nil {
		t.Fatalf("decode %q: %v", b, err)
	}
	return resp
}

func TestMalformedRequests(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	cases := []struct {
		name    string
		payload []byte
		want    string
	}{
		{"not-json", []byte("hello\n"), "bad request"},
		{"empty-line", []byte("\n"), "bad request"},
		{"trailing", []byte(`{"code":"echo"} {"code":"x"}` + "\n"), "trailing data"},
		{"unknown-field", []byte(`{"code":"echo","evil":1}` + "\n"), "unknown field"},
		{"wrong-type", []byte(`{"timeout_ms":"soon"}` + "\n"), "bad request"},
		{"negative-timeout", []byte(`{"code":"echo","timeout_ms":-1}` + "\n"), "negative"},
		{"huge-timeout", []byte(`{"code":"echo","timeout_ms":99999999999}` + "\n"), "exceeds"},
		{"negative-cap", []byte(`{"code":"echo","max_output_bytes":-5}` + "\n"), "negative"},
		{"oversized", append(bytes.Repeat([]byte("a"), MaxRequestBytes+10), '\n'), "longer than"},
		{"oversized-valid-json", []byte(`{"code":"` + strings.Repeat("#", MaxRequestBytes) + `"}` + "\n"), "longer than"},
		{"no-newline", []byte(`{"code":"echo hi"}`), ""}, // half-close below
	}
	for _, c := range cases {
		if c.name == "no-newline" {
			continue
		}
		resp := rawExchange(t, ta.sock, c.payload)
		if !strings.Contains(resp.Error, c.want) {
			t.Errorf("%s: Error %q, want it to contain %q", c.name, resp.Error, c.want)
		}
	}
	// A final line without newline, ended by a half-close, is accepted.
	c, err := net.Dial("unix", ta.sock)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = c.Write([]byte(`{"code":"echo hi"}`))
	_ = c.(*net.UnixConn).CloseWrite()
	b, _ := io.ReadAll(c)
	c.Close()
	if resp, err := decodeResponse(b); err != nil || string(resp.Stdout) != "hi\n" {
		t.Fatalf("no newline: %v %+v", err, resp)
	}
	// A client that connects and goes away does not hurt.
	c, err = net.Dial("unix", ta.sock)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	// Still serving.
	if resp := ta.run(t, Request{Code: "echo alive"}); string(resp.Stdout) != "alive\n" {
		t.Fatalf("after malformed requests: %+v", resp)
	}
	// The client refuses to send oversized requests.
	if _, err := Run(context.Background(), ta.sock, Request{Code: strings.Repeat("x", MaxRequestBytes)}); err == nil {
		t.Fatal("Run accepted an oversized request")
	}
}

// fakeAgent answers every connection with the given bytes.
func fakeAgent(t *testing.T, answer []byte) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fake.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = readRequest(c)
				_, _ = c.Write(answer)
			}()
		}
	}()
	return sock
}

func TestClientRejectsHostileAnswers(t *testing.T) {
	good, _ := json.Marshal(Response{ExitCode: 7, Stdout: []byte("x")})
	cases := []struct {
		name   string
		answer []byte
		ok     bool
	}{
		{"good", append(good, '\n'), true},
		{"good-no-newline", good, true},
		{"empty", nil, false},
		{"garbage", []byte("nope\n"), false},
		{"unknown-field", []byte(`{"exit_code":0,"pwned":true}` + "\n"), false},
		{"trailing", append(append(good, '\n'), good...), false},
		{"oversized", append([]byte(`{"stdout":"`), bytes.Repeat([]byte("A"), MaxResponseBytes+8)...), false},
	}
	for _, c := range cases {
		resp, err := Run(context.Background(), fakeAgent(t, c.answer), Request{Code: "x", TimeoutMS: 1000})
		if c.ok && (err != nil || resp.ExitCode != 7 || string(resp.Stdout) != "x") {
			t.Errorf("%s: %+v, %v", c.name, resp, err)
		}
		if !c.ok && err == nil {
			t.Errorf("%s: accepted %+v", c.name, resp)
		}
	}
}

func TestClientDeadline(t *testing.T) {
	// An agent that never answers: the client gives up at ctx's deadline.
	sock := filepath.Join(t.TempDir(), "mute.sock")
	ln, err := net.Listen("unix", sock)
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
			defer c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := Run(ctx, sock, Request{Code: "x"}); err == nil {
		t.Fatal("no error from a mute agent")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
}

func TestWaitReady(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "late.sock")
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := WaitReady(ctx, sock); err == nil {
		t.Fatal("WaitReady succeeded without an agent")
	}
	// Start the agent while WaitReady is already polling.
	ready := make(chan error, 1)
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	go func() { ready <- WaitReady(wctx, sock) }()
	sctx, scancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Serve(sctx, Options{Socket: sock, Language: LangBash, WorkDir: t.TempDir(), TmpDir: t.TempDir(), Sweep: SweepDescendants})
	}()
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, %v", fi.Mode(), err)
	}
	scancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket not removed: %v", err)
	}
}

func TestSweepModes(t *testing.T) {
	for _, s := range []string{"auto", "container", "descendants"} {
		m, err := ParseSweepMode(s)
		if err != nil || m.String() != s {
			t.Errorf("ParseSweepMode(%q) = %v, %v", s, m, err)
		}
	}
	if _, err := ParseSweepMode("everything"); err == nil {
		t.Error("ParseSweepMode accepted garbage")
	}
	if containerLike() {
		t.Skip("test process looks like a container's main process")
	}
	// On a normal host, container mode is refused and auto picks descendants.
	if _, err := resolveSweepMode(SweepContainer); err == nil {
		t.Fatal("container sweep mode accepted outside a container")
	}
	if m, err := resolveSweepMode(SweepAuto); err != nil || m != SweepDescendants {
		t.Fatalf("auto = %v, %v", m, err)
	}
	err := Serve(context.Background(), Options{Socket: filepath.Join(t.TempDir(), "s"), Language: LangBash, Sweep: SweepContainer})
	if err == nil || !strings.Contains(err.Error(), "container") {
		t.Fatalf("Serve in container mode on a host: %v", err)
	}
}

func TestSweepTargetsContainer(t *testing.T) {
	procs := []procInfo{{pid: 1}, {pid: 7, ppid: 1}, {pid: 8, ppid: 7}, {pid: 9, ppid: 1}}
	var got []int
	targets, _ := sweepTargets(SweepContainer, procs, 7)
	for _, p := range targets {
		got = append(got, p.pid)
	}
	if fmt.Sprint(got) != "[8 9]" {
		t.Fatalf("container targets %v", got)
	}
	got = nil
	targets, dangling := sweepTargets(SweepDescendants, procs, 7)
	if dangling {
		t.Error("dangling in a consistent snapshot")
	}
	for _, p := range targets {
		got = append(got, p.pid)
	}
	if fmt.Sprint(got) != "[8]" {
		t.Fatalf("descendant targets %v", got)
	}
	// 10's parent is missing from the snapshot: the round is not trusted.
	if _, dangling := sweepTargets(SweepDescendants, append(procs, procInfo{pid: 10, ppid: 99}), 7); !dangling {
		t.Fatal("dangling parent not reported")
	}
}

func TestParseStat(t *testing.T) {
	line := "4242 (we) ird (name) R 17 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 100 18446744073709551615\n"
	p, ok := parseStat([]byte(line))
	if !ok || p.ppid != 17 || p.state != 'R' || p.start != 987654 {
		t.Fatalf("parseStat = %+v, %v", p, ok)
	}
	for _, bad := range []string{"", "1 (x", "1 (x) R", "1 (x) RR 2 " + strings.Repeat("0 ", 20)} {
		if _, ok := parseStat([]byte(bad)); ok {
			t.Errorf("parseStat(%q) ok", bad)
		}
	}
	// Our own entry.
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Fatal(err)
	}
	if p, ok := parseStat(b); !ok || p.ppid != os.Getppid() {
		t.Fatalf("own stat: %+v %v", p, ok)
	}
}

func FuzzParseStat(f *testing.F) {
	f.Add([]byte("123 (bash) S 1 123 123 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 98765 1000 100 0"))
	f.Add([]byte("7 (a) b) c) Z 1 7 7 0 -1 4 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0"))
	f.Add([]byte("1 (x"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, ok := ParseProcStat(b)
		if !ok {
			return
		}
		// What parsed must be the fields after the last ')'.
		f := bytes.Fields(b[bytes.LastIndexByte(b, ')')+1:])
		if len(f) < 20 || len(f[0]) != 1 || f[0][0] != st.State {
			t.Fatalf("parsed %+v from %q", st, b)
		}
		if start, err := strconv.ParseUint(string(f[19]), 10, 64); err != nil || start != st.Start {
			t.Fatalf("start %d from %q", st.Start, b)
		}
	})
}

func TestInstall(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	if err := os.WriteFile(src, []byte("v1"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	old, _ := os.Stat(dst)
	if err := Install(src, dst); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(dst)
	fi, _ := os.Stat(dst)
	if string(b) != "v1" || fi.Mode().Perm() != 0o755 || os.SameFile(old, fi) {
		t.Fatalf("dst %q %v, new inode %v", b, fi.Mode(), !os.SameFile(old, fi))
	}
	if err := os.Chmod(dst, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Install(dst, dst); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(dst); fi.Mode().Perm() != 0o755 {
		t.Fatalf("mode %v", fi.Mode())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Fatalf("left behind: %v", ents)
	}
}

func TestBaseEnv(t *testing.T) {
	env := BaseEnv(func(k string) string {
		return map[string]string{"PATH": "/p", "SECRET": "x"}[k]
	})
	joined := strings.Join(env, " ")
	for _, want := range []string{"PATH=/p", "HOME=/tmp", "LANG=C.UTF-8", "MPLBACKEND=Agg", "MPLCONFIGDIR=/tmp/mpl", "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"} {
		if !strings.Contains(joined, want) {
			t.Errorf("env lacks %s: %v", want, env)
		}
	}
	if strings.Contains(joined, "SECRET") {
		t.Errorf("env leaks: %v", env)
	}
}

func benchmarkPrint1(b *testing.B, opts Options) {
	ta := startAgent(b, opts)
	if !opts.NoZygote {
		ta.zygotePID(b)
	}
	req := py("print(1)")
	b.ResetTimer()
	for b.Loop() {
		resp, err := Run(context.Background(), ta.sock, req)
		if err != nil || string(resp.Stdout) != "1\n" || resp.Zygote == opts.NoZygote {
			b.Fatalf("%+v %v", resp, err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "ms/run")
}

func BenchmarkRunPrint1(b *testing.B) {
	benchmarkPrint1(b, Options{Language: LangPython})
}

func BenchmarkRunPrint1Direct(b *testing.B) {
	benchmarkPrint1(b, Options{Language: LangPython, NoZygote: true})
}

func BenchmarkRunBashEcho(b *testing.B) {
	ta := startAgent(b, Options{Language: LangBash})
	for b.Loop() {
		if resp, err := Run(context.Background(), ta.sock, Request{Code: "echo 1"}); err != nil || string(resp.Stdout) != "1\n" {
			b.Fatalf("%+v %v", resp, err)
		}
	}
}

func TestPeerAllowed(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "p.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	errc := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			errc <- err
			return
		}
		defer c.Close()
		errc <- peerAllowed(c)
	}()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// This process is visible in its own PID namespace, like sandbox code.
	if err := <-errc; err == nil || !strings.Contains(err.Error(), "inside the sandbox") {
		t.Fatalf("peerAllowed = %v", err)
	}
}
