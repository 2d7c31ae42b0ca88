package docker

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// cell runs code as a notebook cell of s.
func cell(t *testing.T, s sandbox.Session, code string, timeout time.Duration) sandbox.ExecResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout+time.Minute)
	defer cancel()
	res, err := s.Exec(ctx, sandbox.ExecRequest{Language: "python", Mode: sandbox.ModeNotebook, Code: code, Timeout: timeout, MaxOutputBytes: 1 << 20})
	if err != nil {
		t.Fatalf("cell %q: %v", code, err)
	}
	if res.Kernel == nil {
		t.Fatalf("cell %q: no kernel status: %+v", code, res)
	}
	return res
}

// pythonContainer returns the session's python container, nil if it has
// none (it was retired).
func pythonContainer(s sandbox.Session) *ctr {
	ss := s.(*Session)
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.ctrs["python"]
}

// TestNotebookKernelHeldToItsSession: the stray check finds the kernel's
// session where the sandbox's kernel numbers it (the host's /proc under
// runc, the Sentry's under gVisor, whose IDs the host's /proc does not
// know), keeps the container across cells that leave nothing behind,
// finds the kernel stopped between calls, and retires the container when
// a cell leaves a process in the kernel's session that the agent's sweep
// cannot see (the live thread of a zombie leader).
func TestNotebookKernelHeldToItsSession(t *testing.T) {
	forRuntimes(t, testNotebookKernelHeldToItsSession)
}

func testNotebookKernelHeldToItsSession(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "python")
	s := openSession(t, e)
	res := cell(t, s, "import os\nprint(os.getpid(), os.getsid(0))", 60*time.Second)
	var pid, sid int
	if _, err := fmt.Sscan(string(res.Stdout), &pid, &sid); err != nil || pid != sid || !res.Kernel.Started {
		t.Fatalf("first cell: %+v %q %v", res.Kernel, res.Stdout, err)
	}
	c := pythonContainer(s)
	if c == nil {
		t.Fatal("the first cell retired its container")
	}
	ss := s.(*Session)
	ss.mu.Lock()
	kernelSID := c.kernelSID
	ss.mu.Unlock()
	if rt == RuntimeRunsc {
		if kernelSID != sid {
			t.Fatalf("kernel session %d, the sandbox says %d", kernelSID, sid)
		}
	} else if ns := hostNSpid(t, kernelSID); ns != sid {
		t.Fatalf("host kernel session %d is pid %d in the container, the kernel says %d", kernelSID, ns, sid)
	}

	// Cells that leave nothing behind keep the container and the kernel.
	res = cell(t, s, "import subprocess, threading\nsubprocess.run(['true'])\nthreading.Thread(target=print).start()\nx = 1", 20*time.Second)
	if pythonContainer(s) != c || res.Kernel.Started || res.ExitCode != 0 {
		t.Fatalf("a clean cell replaced the container or kernel: %+v %+v", res, res.Kernel)
	}
	// Between calls every thread of the kernel is stopped.
	res = exec1(t, s, "python", fmt.Sprintf(`import os
d = "/proc/%d/task"
print(sorted({open(f"{d}/{t}/stat").read().rsplit(")", 1)[1].split()[0] for t in os.listdir(d)}))`, pid), 20*time.Second)
	if got := strings.TrimSpace(string(res.Stdout)); got != "['T']" || pythonContainer(s) != c {
		t.Fatalf("kernel thread states between calls: %q %s", got, res.Stderr)
	}

	res = cell(t, s, `
import ctypes, os, threading, time
libc = ctypes.CDLL(None)
if os.fork() == 0:
    threading.Thread(target=lambda: time.sleep(1000)).start()
    libc.pthread_exit(None)
time.sleep(0.3)
print("spawned", x)`, 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "spawned 1" {
		t.Fatalf("spawn: %+v %s", res, res.Stderr)
	}
	if pythonContainer(s) != nil {
		t.Fatal("the container whose kernel session holds a stray thread was kept")
	}
	res = cell(t, s, "'x' in globals()", 60*time.Second)
	if !res.Kernel.Started || !res.Kernel.StateLost || res.Kernel.Reason != sandbox.LostStrays {
		t.Fatalf("after the stray: %+v", res.Kernel)
	}
}

// hostNSpid returns the innermost pid namespace's ID of host process pid.
func hostNSpid(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			n, err := strconv.Atoi(f[len(f)-1])
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no NSpid in /proc/%d/status", pid)
	return 0
}

// TestNotebookOOMKillEndsTheKernel: under gVisor the OOM killer ends the
// whole sandbox, the agent with it; the cell still reports the kernel's
// end as an OOM kill, and the next cell says why its state was lost.
func TestNotebookOOMKillEndsTheKernel(t *testing.T) { forRuntimes(t, testNotebookOOMKillEndsTheKernel) }

func testNotebookOOMKillEndsTheKernel(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime, o.Memory = rt, 384<<20 })
	needRunner(t, e, "python")
	s := openSession(t, e)
	cell(t, s, "y = 2", 60*time.Second)
	res := cell(t, s, "x = []\nwhile True: x.append(bytearray(16 << 20))", 60*time.Second)
	if !res.OOMKilled || !strings.Contains(res.Kernel.Ended, "out of memory") {
		t.Fatalf("memory bomb: %+v %+v", res, res.Kernel)
	}
	res = cell(t, s, "'y' in globals()", 60*time.Second)
	if !res.Kernel.Started || !res.Kernel.StateLost || !strings.Contains(res.Kernel.Reason, "out of memory") || res.OOMKilled {
		t.Fatalf("after the OOM kill: %+v %+v", res, res.Kernel)
	}
}
