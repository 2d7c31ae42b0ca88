package agent

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// tsImage holds the toolchain these tests use: /opt/ts of the typescript
// runner (TypeScript, @types/node and the native helper).
const tsImage = "sandbox-broker/runner-typescript:latest"

// nodeToolchain copies the runner's /opt/ts into a temporary directory. It
// fails in CI and skips elsewhere when Docker or the image is missing.
func nodeToolchain(t testing.TB) string {
	t.Helper()
	miss := func(format string, a ...any) {
		msg := fmt.Sprintf(format, a...)
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s (required in CI: .ci/run builds the runners)", msg)
		}
		t.Skip(msg)
	}
	if _, err := exec.LookPath("node"); err != nil {
		miss("node is missing: %v", err)
	}
	out, err := exec.Command("docker", "create", tsImage, "true").CombinedOutput()
	if err != nil {
		miss("cannot create a container of %s: %v %s", tsImage, err, out)
	}
	id := strings.TrimSpace(string(out))
	defer exec.Command("docker", "rm", "-f", id).Run()
	dir := t.TempDir()
	if out, err := exec.Command("docker", "cp", id+":/opt/ts", dir).CombinedOutput(); err != nil {
		t.Fatalf("docker cp: %v %s", err, out)
	}
	dir = filepath.Join(dir, "ts")
	if _, err := os.Stat(filepath.Join(dir, nodeNative)); err != nil {
		miss("%s has no %s (rebuild it: runners/build.sh typescript)", tsImage, nodeNative)
	}
	return dir
}

type nodeAgent struct {
	*testAgent
	spares    chan int
	residents chan int
}

// startNodeAgent starts a typescript agent with the toolchain and waits
// until its resident and spare are ready.
func startNodeAgent(t testing.TB, opts Options) *nodeAgent {
	t.Helper()
	opts.Language = LangTypeScript
	opts.NodeToolchain = nodeToolchain(t)
	opts.WarmOnRequest = true
	na := &nodeAgent{spares: make(chan int, 64), residents: make(chan int, 64)}
	opts.spareReady = func(pid int) { na.spares <- pid }
	opts.residentReady = func(pid int) { na.residents <- pid }
	na.testAgent = startAgent(t, opts)
	na.warm(t)
	return na
}

func (na *nodeAgent) warm(t testing.TB) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := WaitWarm(ctx, na.sock); err != nil {
		t.Fatal(err)
	}
}

func next(t *testing.T, c chan int, what string) int {
	t.Helper()
	select {
	case pid := <-c:
		return pid
	case <-time.After(60 * time.Second):
		t.Fatalf("no %s became ready", what)
	}
	return 0
}

func ts(code string) Request { return Request{Language: LangTypeScript, Code: code, TimeoutMS: 30_000} }

func TestTypeScriptResident(t *testing.T) {
	na := startNodeAgent(t, Options{})
	spare := next(t, na.spares, "spare")
	resident := next(t, na.residents, "resident")

	t.Run("runs-in-the-spare-in-a-session-of-its-own", func(t *testing.T) {
		resp := na.run(t, ts(`import { readFileSync } from "fs";
const stat: string = readFileSync("/proc/self/stat", "utf8");
const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
console.log(process.pid, f[3] === String(process.pid), process.argv[1].endsWith("main.js"), require.main === module);`))
		want := fmt.Sprintf("%d true true true\n", spare)
		if resp.Error != "" || resp.ExitCode != 0 || string(resp.Stdout) != want {
			t.Fatalf("got %+v (stdout %q, stderr %q), want stdout %q", resp, resp.Stdout, resp.Stderr, want)
		}
		assertNoLeftovers(t)
		spare = next(t, na.spares, "next spare")
	})
	t.Run("type-error-reported-and-nothing-runs", func(t *testing.T) {
		resp := na.run(t, ts("import { writeFileSync } from \"fs\";\nwriteFileSync(\"ran.txt\", \"x\");\nconst n: number = \"one\";\nconsole.log(n);\n"))
		if resp.ExitCode != 1 || len(resp.Stdout) != 0 || !strings.Contains(string(resp.Stderr), "main.ts(3,7): error TS2322: Type 'string' is not assignable to type 'number'.") {
			t.Fatalf("got exit %d stdout %q stderr %q", resp.ExitCode, resp.Stdout, resp.Stderr)
		}
		if _, err := os.Stat(filepath.Join(na.workDir, "ran.txt")); !os.IsNotExist(err) {
			t.Fatalf("the code ran despite the type error: %v", err)
		}
	})
	t.Run("syntax-error-reported", func(t *testing.T) {
		resp := na.run(t, ts("const x = ;\n"))
		if resp.ExitCode != 1 || !strings.Contains(string(resp.Stderr), "main.ts(1,11): error TS1109") {
			t.Fatalf("got exit %d stderr %q", resp.ExitCode, resp.Stderr)
		}
	})
	t.Run("stack-traces-name-typescript-lines", func(t *testing.T) {
		resp := na.run(t, ts("interface P { x: number }\nconst p: P = { x: 1 };\nif (p.x) throw new Error(\"boom\");\n"))
		if resp.ExitCode != 1 || !strings.Contains(string(resp.Stderr), "Error: boom") || !strings.Contains(string(resp.Stderr), "main.ts:3") {
			t.Fatalf("got exit %d stderr %q", resp.ExitCode, resp.Stderr)
		}
	})
	t.Run("workspace-typescript-modules", func(t *testing.T) {
		if err := os.WriteFile(filepath.Join(na.workDir, "lib.ts"), []byte("export const twice = (n: number): number => 2 * n;\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		resp := na.run(t, ts(fmt.Sprintf("import { twice } from %q;\nconsole.log(twice(21));\n", filepath.Join(na.workDir, "lib"))))
		if resp.ExitCode != 0 || string(resp.Stdout) != "42\n" {
			t.Fatalf("got exit %d stdout %q stderr %q", resp.ExitCode, resp.Stdout, resp.Stderr)
		}
		// A type error in the imported module is reported too.
		if err := os.WriteFile(filepath.Join(na.workDir, "lib.ts"), []byte("export const twice = (n: number): string => 2 * n;\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		resp = na.run(t, ts(fmt.Sprintf("import { twice } from %q;\nconsole.log(twice(21));\n", filepath.Join(na.workDir, "lib"))))
		if resp.ExitCode != 1 || !strings.Contains(string(resp.Stderr), "lib.ts(1,45): error TS2322") {
			t.Fatalf("got exit %d stdout %q stderr %q", resp.ExitCode, resp.Stdout, resp.Stderr)
		}
	})
	t.Run("javascript", func(t *testing.T) {
		resp := na.run(t, Request{Language: LangJavaScript, Code: "console.log(typeof require, process.execArgv.length); process.exitCode = 3", TimeoutMS: 30_000})
		if resp.ExitCode != 3 || string(resp.Stdout) != "function 1\n" {
			t.Fatalf("got %+v stdout %q stderr %q", resp, resp.Stdout, resp.Stderr)
		}
	})
	t.Run("no-state-between-runs", func(t *testing.T) {
		resp := na.run(t, ts("(globalThis as any).leak = 1;\nconsole.log('set');"))
		if string(resp.Stdout) != "set\n" {
			t.Fatalf("run 1: %q %q", resp.Stdout, resp.Stderr)
		}
		resp = na.run(t, ts("console.log((globalThis as any).leak === undefined);"))
		if string(resp.Stdout) != "true\n" {
			t.Fatalf("state leaked: %q %q", resp.Stdout, resp.Stderr)
		}
	})
	t.Run("nothing-boots-during-a-run", func(t *testing.T) {
		// Infrastructure starts only while no run's code executes: the
		// next spare boots after this run, not beside it (nor holding it
		// back until sealed).
		na.warm(t) // a spare ready, none booting
		resp := na.run(t, ts(fmt.Sprintf(`import * as fs from "fs";
let n = 0;
for (const d of fs.readdirSync("/proc")) {
  if (!/^\d+$/.test(d) || Number(d) === process.pid) continue;
  try {
    const st = fs.readFileSync("/proc/" + d + "/stat", "utf8");
    const ppid = Number(st.slice(st.lastIndexOf(")") + 2).split(" ")[1]);
    if (ppid === %d && fs.readFileSync("/proc/" + d + "/cmdline", "utf8").includes("the Node runner")) n++;
  } catch {}
}
console.log(n);`, os.Getpid())))
		if resp.ExitCode != 0 || string(resp.Stdout) != "0\n" {
			t.Fatalf("got exit %d stdout %q stderr %q, want no other Node runner during the run", resp.ExitCode, resp.Stdout, resp.Stderr)
		}
	})
	t.Run("no-inspector", func(t *testing.T) {
		// SIGUSR1 would start Node's inspector on loopback (127.0.0.1:9229)
		// in the resident (once it runs JavaScript again: the next check)
		// and in the run's own Node.
		resp := na.run(t, ts(fmt.Sprintf("process.kill(%d, \"SIGUSR1\");\nprocess.kill(process.pid, \"SIGUSR1\");\nsetTimeout(() => {}, 300);", resident)))
		if resp.ExitCode != 0 {
			t.Fatalf("got exit %d stderr %q", resp.ExitCode, resp.Stderr)
		}
		resp = na.run(t, ts(`import * as net from "net";
let tries = 0;
const probe = (): void => {
  const s = net.connect(9229, "127.0.0.1");
  s.on("connect", () => { console.log("inspector listening"); process.exit(1); });
  s.on("error", () => { if (++tries < 20) setTimeout(probe, 50); else console.log("no inspector"); });
};
probe();`))
		if string(resp.Stdout) != "no inspector\n" || !alive(resident) {
			t.Fatalf("got %q %q (resident alive: %v)", resp.Stdout, resp.Stderr, alive(resident))
		}
	})
}

func pingWarm(t *testing.T, sock string) bool {
	t.Helper()
	warm, err := Ping(context.Background(), sock, false)
	if err != nil {
		t.Fatalf("ping: %v", err)
	}
	return warm
}

func TestNodeSpareTamperedFallsBackAndRunsOnce(t *testing.T) {
	na := startNodeAgent(t, Options{})
	spare := next(t, na.spares, "spare")
	// Another process of the uid changes the idle spare's limits: the spare
	// must refuse the run, which then starts directly, exactly once.
	lim := unix.Rlimit{Cur: 100, Max: 100}
	if err := unix.Prlimit(spare, unix.RLIMIT_NOFILE, &lim, nil); err != nil {
		t.Fatal(err)
	}
	code := "require('fs').appendFileSync('runs.txt', 'x');\nconsole.log(process.pid);"
	resp := na.run(t, Request{Language: LangJavaScript, TimeoutMS: 30_000, Code: code})
	pid, _ := strconv.Atoi(strings.TrimSpace(string(resp.Stdout)))
	if resp.ExitCode != 0 || pid == 0 || pid == spare {
		t.Fatalf("got %+v %q %q; want a direct start, not spare %d", resp, resp.Stdout, resp.Stderr, spare)
	}
	if alive(spare) {
		t.Fatal("the tampered spare is still alive")
	}
	next := next(t, na.spares, "next spare")
	resp = na.run(t, Request{Language: LangJavaScript, TimeoutMS: 30_000, Code: code})
	if strings.TrimSpace(string(resp.Stdout)) != strconv.Itoa(next) {
		t.Fatalf("got %q %q, want the run in spare %d", resp.Stdout, resp.Stderr, next)
	}
	if b, err := os.ReadFile(filepath.Join(na.workDir, "runs.txt")); err != nil || string(b) != "xx" {
		t.Fatalf("runs.txt = %q, %v; want each run exactly once", b, err)
	}
	assertNoLeftovers(t)
}

func TestNodeIdleReleaseAndRewarm(t *testing.T) {
	na := startNodeAgent(t, Options{IdleRelease: 300 * time.Millisecond})
	resident := next(t, na.residents, "resident")
	next(t, na.spares, "spare")
	if resp := na.run(t, ts("console.log(1)")); string(resp.Stdout) != "1\n" {
		t.Fatalf("got %q %q", resp.Stdout, resp.Stderr)
	}
	spare := next(t, na.spares, "the spare after the run")
	deadline := time.Now().Add(30 * time.Second)
	for alive(resident) || alive(spare) {
		if time.Now().After(deadline) {
			t.Fatal("the resident was not released when idle")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if pingWarm(t, na.sock) {
		t.Fatal("ping says warm after the idle release")
	}
	assertNoLeftovers(t)
	// A TypeScript run warms up again by itself: it needs the checker.
	resp := na.run(t, ts("const n: number = 2;\nconsole.log(n)"))
	if resp.ExitCode != 0 || string(resp.Stdout) != "2\n" {
		t.Fatalf("after release: got %+v %q %q", resp, resp.Stdout, resp.Stderr)
	}
	if r := next(t, na.residents, "new resident"); r == resident {
		t.Fatal("the same resident again")
	}
}

// BenchmarkTypeScriptRun is a warm TypeScript console.log(1) at the agent
// (type check in the resident, run in a spare), then the same with a
// pause after each run (a spare ready every time).
func BenchmarkTypeScriptRun(b *testing.B) {
	na := startNodeAgent(b, Options{})
	for _, pause := range []time.Duration{0, 300 * time.Millisecond} {
		b.Run(fmt.Sprintf("pause=%v", pause), func(b *testing.B) {
			lat := make([]time.Duration, 0, b.N)
			for i := 0; i < b.N; i++ {
				start := time.Now()
				if resp := na.run(b, ts("const n: number = 1;\nconsole.log(n);\n")); string(resp.Stdout) != "1\n" {
					b.Fatalf("got %q %q", resp.Stdout, resp.Stderr)
				}
				lat = append(lat, time.Since(start))
				b.StopTimer()
				time.Sleep(pause)
				b.StartTimer()
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2])/1e6, "p50-ms")
			b.ReportMetric(0, "ns/op")
		})
	}
}
