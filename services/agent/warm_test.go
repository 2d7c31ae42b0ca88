package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// slowPreload returns an environment whose numpy import, the zygote's
// first preload, blocks until release is called: the preload is then
// still running for as long as the test wants.
func slowPreload(t *testing.T) (env []string, release func()) {
	t.Helper()
	dir := t.TempDir()
	fifo := filepath.Join(dir, "go")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "numpy.py"), []byte(fmt.Sprintf("open(%q).read()\n", fifo)), 0o600); err != nil {
		t.Fatal(err)
	}
	released := false
	release = func() {
		if released {
			return
		}
		released = true
		f, err := os.OpenFile(fifo, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	t.Cleanup(release)
	return append(BaseEnv(os.Getenv), "PYTHONPATH="+dir), release
}

func TestColdRunDoesNotWaitForThePreload(t *testing.T) {
	env, release := slowPreload(t)
	ta := startAgent(t, Options{Language: LangPython, Env: env})
	// The zygote is importing (blocked in numpy) while the run is answered.
	resp := ta.run(t, py("print(1)"))
	if resp.Error != "" || string(resp.Stdout) != "1\n" || resp.Zygote || !resp.Cold {
		t.Fatalf("got %+v (stdout %q stderr %q), want a direct, cold run", resp, resp.Stdout, resp.Stderr)
	}
	if warm, err := Ping(context.Background(), ta.sock, false); err != nil || warm {
		t.Fatalf("ping: warm %v, %v; want the preload still running", warm, err)
	}
	release()
	zpid := ta.zygotePID(t)
	resp = ta.run(t, py("import os\nprint(os.getppid())"))
	if string(resp.Stdout) != fmt.Sprintf("%d\n", zpid) || !resp.Zygote || resp.Cold {
		t.Fatalf("after the preload: %+v (stdout %q)", resp, resp.Stdout)
	}
}

// procStatOf reads a live process's stat.
func procStatOf(t *testing.T, pid int) procInfo {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	p, ok := parseStat(b)
	if !ok {
		t.Fatalf("bad stat %q", b)
	}
	return p
}

// pgid reads a process's group.
func pgid(t *testing.T, pid int) int {
	t.Helper()
	g, err := syscall.Getpgid(pid)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func TestZygoteLivesInTheAgentSession(t *testing.T) {
	ta := startAgent(t, Options{Language: LangPython})
	zpid := ta.zygotePID(t)
	if z := procStatOf(t, zpid); z.sid != infraSID || pgid(t, zpid) != zpid {
		t.Fatalf("zygote %d: session %d group %d; want the agent's session %d and a group of its own", zpid, z.sid, pgid(t, zpid), infraSID)
	}
	// Its idle spare is in the agent's session too, and spared by the
	// sweep; a run leaves it for a session of its own.
	resp := ta.run(t, py(`import os
sid = os.getsid(0)
print(sid == os.getpid(), os.getppid())`))
	if want := fmt.Sprintf("True %d\n", zpid); string(resp.Stdout) != want {
		t.Fatalf("got %q %q, want %q", resp.Stdout, resp.Stderr, want)
	}
	// The next spare is forked once the answer is written.
	deadline := time.Now().Add(10 * time.Second)
	for spares := 0; spares == 0; {
		procs, _, err := listProcs("/proc")
		if err != nil {
			t.Fatal(err)
		}
		spawnMu.Lock()
		for _, p := range procs {
			// The run's own process may still be on its way out.
			if p.ppid != zpid || p.state == 'Z' || p.flags&pfExiting != 0 {
				continue
			}
			if !spareOfZygote(p) {
				t.Errorf("zygote child %d (session %d) is not an idle spare", p.pid, p.sid)
			}
			spares++
		}
		spawnMu.Unlock()
		if spares == 0 && time.Now().After(deadline) {
			t.Fatal("no idle spare")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestWarmOnRequestAndIdleRelease(t *testing.T) {
	ta := startAgent(t, Options{Language: LangPython, WarmOnRequest: true, IdleRelease: 300 * time.Millisecond})
	resp := ta.run(t, py("print(1)"))
	if string(resp.Stdout) != "1\n" || !resp.Cold {
		t.Fatalf("first run: %+v", resp)
	}
	spawnMu.Lock()
	n := len(protected)
	spawnMu.Unlock()
	if n != 0 {
		t.Fatalf("%d infrastructure processes started before a warm request", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := WaitWarm(ctx, ta.sock); err != nil {
		t.Fatal(err)
	}
	zpid := ta.zygotePID(t)
	resp = ta.run(t, py("import random\nprint(random.random())"))
	if !resp.Zygote || resp.Cold {
		t.Fatalf("warm run: %+v", resp)
	}
	// No run for IdleRelease: the zygote and its spare go, the agent stays.
	deadline := time.Now().Add(30 * time.Second)
	for alive(zpid) {
		if time.Now().After(deadline) {
			t.Fatal("the zygote was not released when idle")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if warm, err := Ping(context.Background(), ta.sock, false); err != nil || warm {
		t.Fatalf("ping after the release: warm %v, %v", warm, err)
	}
	assertNoLeftovers(t)
	spawnMu.Lock()
	n = len(protected)
	spawnMu.Unlock()
	if n != 0 {
		t.Fatalf("%d infrastructure processes left after the release", n)
	}
	// Runs work as before, cold, and a warm request brings a new zygote.
	resp = ta.run(t, py("import sys\nprint('x' in globals(), len(sys.argv))"))
	if string(resp.Stdout) != "False 1\n" || !resp.Cold || resp.Zygote {
		t.Fatalf("run after the release: %+v (stdout %q stderr %q)", resp, resp.Stdout, resp.Stderr)
	}
	if err := WaitWarm(ctx, ta.sock); err != nil {
		t.Fatal(err)
	}
	if z := ta.zygotePID(t); z == zpid {
		t.Fatal("the same zygote after the release")
	}
	if resp = ta.run(t, py("print(2)")); !resp.Zygote || strings.TrimSpace(string(resp.Stdout)) != "2" {
		t.Fatalf("re-warmed run: %+v", resp)
	}
}

func TestWarmIsForPingsOnly(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	resp := ta.run(t, Request{Code: "echo hi", Warm: true})
	if !strings.Contains(resp.Error, "warm is for pings only") {
		t.Fatalf("got %+v", resp)
	}
	// A language without a runtime is always warm.
	if warm, err := Ping(context.Background(), ta.sock, true); err != nil || !warm {
		t.Fatalf("bash ping: warm %v, %v", warm, err)
	}
}
