package tests

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
)

// zygoteMarker is in the command line of the agent's Python zygote and of
// its idle spares (the zygote script starts with it).
const zygoteMarker = "sandbox-broker agent: Python zygote"

// sandboxZygotes counts the zygote processes (the zygote and its idle
// spares) in the broker's sandboxes, as the host sees them.
func sandboxZygotes(t *testing.T, backend string, b *Broker) int {
	t.Helper()
	n := 0
	if backend == "docker" {
		out, err := exec.Command("docker", "ps", "-q", "--filter", "label=sandbox.root="+b.Root).Output()
		if err != nil {
			t.Fatalf("docker ps: %v", err)
		}
		for _, id := range strings.Fields(string(out)) {
			top, err := exec.Command("docker", "top", id, "-eo", "pid,args").Output()
			if err != nil {
				continue // gone meanwhile
			}
			n += strings.Count(string(top), zygoteMarker)
		}
		return n
	}
	// The process backend's sandboxes descend from the broker.
	parent := map[int]int{}
	cmdline := map[int][]byte{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err1 := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		cl, err2 := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err1 != nil || err2 != nil {
			continue
		}
		f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:]))
		if len(f) < 2 || f[0] == "Z" {
			continue
		}
		parent[pid], _ = strconv.Atoi(f[1])
		cmdline[pid] = cl
	}
	for pid, cl := range cmdline {
		if !bytes.Contains(cl, []byte(zygoteMarker)) {
			continue
		}
		for p := parent[pid]; p > 1; p = parent[p] {
			if p == b.cmd.Process.Pid {
				n++
				break
			}
		}
	}
	return n
}

// waitZygotes polls (bounded) until cond holds for the sandboxes' zygote
// processes.
func waitZygotes(t *testing.T, backend string, b *Broker, what string, cond func(n int) bool) {
	t.Helper()
	deadline := time.Now().Add(120 * time.Second)
	for !cond(sandboxZygotes(t, backend, b)) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: still %d zygote processes after 120s", what, sandboxZygotes(t, backend, b))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// zygoteProbe is a run that tells whether the sandbox has a warm zygote
// (one with an idle spare, which it forks once its preload is done) and
// whether the run itself was forked from one.
const zygoteProbe = `import os
def procs():
    for p in os.listdir('/proc'):
        if p.isdigit():
            try:
                yield int(p), open('/proc/%s/cmdline' % p, 'rb').read(), open('/proc/%s/stat' % p).read()
            except OSError:
                pass
ps = list(procs())
zygotes = {pid for pid, cmd, _ in ps if b'` + zygoteMarker + `' in cmd}
parents = {int(st[st.rindex(')') + 2:].split()[1]) for pid, _, st in ps if pid != os.getpid()}
print('warm' if zygotes & parents else 'cold', 'forked' if os.getppid() in zygotes else 'direct')
`

func TestColdSessionFirstRunDoesNotWaitForThePreload(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		// With no warm pool the session's sandbox starts for this call;
		// the call is answered while no zygote is warm yet.
		r, _ := run(t, c, map[string]any{"language": "python", "code": zygoteProbe})
		if !r.Success || strings.TrimSpace(r.Stdout) != "cold direct" {
			t.Fatalf("first run: %+v", r)
		}
		// The preload goes on in the background, without anything else
		// asking for it (watched from outside, not by calls that would
		// count against the rate limit): then runs are forked from the
		// warm zygote (a spare forks only once the preload is done; whether
		// the next spare is up yet, "warm" or "cold", is timing). A few
		// tries cover the zygote telling the agent.
		waitZygotes(t, backend, b, "warm-up", func(n int) bool { return n >= 2 }) // zygote and spare
		for try := 1; ; try++ {
			r, _ = run(t, c, map[string]any{"session_id": r.SessionID, "language": "python", "code": zygoteProbe})
			if strings.HasSuffix(strings.TrimSpace(r.Stdout), " forked") {
				break
			}
			if try == 10 {
				t.Fatalf("no run was forked from the warm zygote: %+v", r)
			}
			time.Sleep(500 * time.Millisecond)
		}
	})
}

func TestIdleReleaseThenRewarm(t *testing.T) {
	backends(t, map[string]string{"SANDBOX_IDLE_RELEASE_MS": "1500"}, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		if backend == "process" {
			requireHostPlotting(t, backend) // the notebook kernel
		}
		nb, _ := cell(t, c, "", "x = 42", nil)
		session := nb.SessionID
		r, _ := run(t, c, map[string]any{"session_id": session, "language": "python", "code": "print(1)"})
		if strings.TrimSpace(r.Stdout) != "1" {
			t.Fatalf("fresh run: %+v", r)
		}
		waitZygotes(t, backend, b, "warm-up", func(n int) bool { return n >= 2 }) // zygote and spare
		waitZygotes(t, backend, b, "idle release", func(n int) bool { return n == 0 })
		// Released: runs still work (cold), the notebook kept its state.
		r, _ = run(t, c, map[string]any{"session_id": session, "language": "python", "code": zygoteProbe})
		if strings.TrimSpace(r.Stdout) != "cold direct" {
			t.Fatalf("run after the release: %+v", r)
		}
		nb, _ = cell(t, c, session, "print(x)", nil)
		if strings.TrimSpace(nb.Stdout) != "42" || nb.Kernel.New {
			t.Fatalf("notebook after the release: %+v %+v", nb, nb.Kernel)
		}
		// The cold run has the runtime warmed up again.
		waitZygotes(t, backend, b, "re-warm", func(n int) bool { return n >= 2 })
		r, _ = run(t, c, map[string]any{"session_id": session, "language": "python", "code": "import random\nprint(random.random() < 1)"})
		if strings.TrimSpace(r.Stdout) != "True" {
			t.Fatalf("run after the re-warm: %+v", r)
		}
	})
}

func TestTypeScriptTypeErrorsOnBothBackends(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		if !hasRunner(t, c, "typescript") {
			if backend == "process" {
				t.Skip("the process backend offers no typescript here (it runs on the host's /usr, which has no tsx)")
			}
			t.Fatal("no typescript runner")
		}
		r, _ := run(t, c, map[string]any{"language": "typescript", "code": "import { writeFileSync } from \"fs\";\nwriteFileSync(\"ran.txt\", \"x\");\nconst n: number = \"one\";\nconsole.log(n);\n"})
		if r.Success || r.ExitCode != 1 || r.Stdout != "" || !strings.Contains(r.Stderr, "main.ts(3,7): error TS2322: Type 'string' is not assignable to type 'number'.") || len(r.Files) != 0 {
			t.Fatalf("type error: %+v", r)
		}
		// A correct program runs; the checker and the spare it ran in are
		// not traceable by the run (non-dumpable: their /proc files are
		// not the run's uid's).
		r, _ = run(t, c, map[string]any{"session_id": r.SessionID, "language": "typescript", "code": `import { readdirSync, readFileSync, statSync } from "fs";
const infra = readdirSync("/proc").filter((p) => /^\d+$/.test(p)).filter((p) => {
  try { return /sandbox-broker agent: the (TypeScript resident|Node runner)/.test(readFileSync("/proc/" + p + "/cmdline", "utf8")); } catch { return false; }
}).filter((p) => Number(p) !== process.pid);
const mine = infra.filter((p) => statSync("/proc/" + p + "/mem").uid === process.getuid!());
const total: number = [1, 2, 3].reduce((a, b) => a + b, 0);
console.log(total, infra.length >= 1, mine.length);`})
		if !r.Success || strings.TrimSpace(r.Stdout) != "6 true 0" {
			t.Fatalf("typescript run: %+v", r)
		}
	})
}

// hasRunner reports whether list_runners offers lang.
func hasRunner(t *testing.T, c *client.Client, lang string) bool {
	t.Helper()
	res := callTool(t, c, "list_runners", nil)
	var out struct {
		Runners []struct {
			Language string `json:"language"`
		} `json:"runners"`
	}
	resultJSON(t, res, &out)
	for _, r := range out.Runners {
		if r.Language == lang {
			return true
		}
	}
	return false
}
