package docker

import (
	"context"
	"io"
	"maps"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

func TestRunscArgsChecked(t *testing.T) {
	for _, ok := range [][]string{
		{"--platform=systrap", "--network=none", "--host-uds=all", "--oci-seccomp"},
		{"-oci-seccomp=true", "--network", "none", "-host-uds", "all"},
	} {
		if err := checkRunscArgs(ok); err != nil {
			t.Errorf("%q refused: %v", ok, err)
		}
	}
	for missing, args := range map[string][]string{
		"oci-seccomp": {"--network=none", "--host-uds=all"},
		"network":     {"--oci-seccomp", "--host-uds=all"},
		"host-uds":    {"--oci-seccomp", "--network=none", "--host-uds=open"},
	} {
		if err := checkRunscArgs(args); err == nil || !strings.Contains(err.Error(), "--"+missing+"=") {
			t.Errorf("%q: err = %v, want one naming --%s", args, err, missing)
		}
	}
	if err := checkRunscArgs([]string{"--oci-seccomp=false", "--network=none", "--host-uds=all"}); err == nil {
		t.Error("--oci-seccomp=false accepted")
	}
}

// TestUnregisteredRuntimeRefused: a runtime the daemon does not have stops
// the engine at start, not at the first sandbox.
func TestUnregisteredRuntimeRefused(t *testing.T) {
	needDocker(t)
	root := t.TempDir()
	_, err := New(context.Background(), Options{Root: root, AgentBinary: agentBinary, Runtime: "no-such-runtime", UIDs: newUIDs(t, root)})
	if err == nil || !strings.Contains(err.Error(), "no runtime of that name") {
		t.Fatalf("New: %v", err)
	}
}

// TestStraysRetireTheContainer: the host-side stray check keeps a container
// after clean runs and replaces it after a run leaves a live thread behind
// (in a process whose leader exited, which the agent's sweep skips as a
// zombie). Under gVisor the check reads the Sentry's /proc through a
// process started in the sandbox, since the host's /proc does not show
// sandbox processes.
func TestStraysRetireTheContainer(t *testing.T) { forRuntimes(t, testStraysRetireTheContainer) }

func testStraysRetireTheContainer(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "python")
	s := openSession(t, e)
	exec1(t, s, "python", "print(1)", 20*time.Second)
	first := sessionContainer(t, s).dockerID
	for i := range 3 {
		// Clean runs, a subprocess and a thread among them, keep it.
		exec1(t, s, "python", "import subprocess, threading\nsubprocess.run(['true'])\nthreading.Thread(target=print).start()", 20*time.Second)
		if id := sessionContainer(t, s).dockerID; id != first {
			t.Fatalf("clean run %d replaced the container", i)
		}
	}
	res := exec1(t, s, "python", `
import ctypes, os, threading, time
libc = ctypes.CDLL(None)
if os.fork() == 0:
    os.setsid()
    threading.Thread(target=lambda: time.sleep(1000)).start()
    libc.pthread_exit(None)
time.sleep(0.3)
print("spawned")
`, 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "spawned" {
		t.Fatalf("spawn: %+v %s", res, res.Stderr)
	}
	ss := s.(*Session)
	ss.mu.Lock()
	kept := ss.ctrs["python"] != nil
	ss.mu.Unlock()
	if kept {
		t.Fatal("the container that holds a stray thread was kept")
	}
	res = exec1(t, s, "python", "print('next')", 20*time.Second)
	if id := sessionContainer(t, s).dockerID; id == first || strings.TrimSpace(string(res.Stdout)) != "next" {
		t.Fatalf("after the stray: %+v %s in %s", res, res.Stderr, shortID(id))
	}
}

// TestSessionMonitorAnswersAreUntrusted: the monitor runs in the sandbox.
// An answer over the limit or off the format is refused, and so is every
// answer after it, even a good one: the stream is out of step.
func TestSessionMonitorAnswersAreUntrusted(t *testing.T) {
	for name, bad := range map[string]string{
		"too long":       strings.Repeat(" ", agent.MaxSessionsAnswer) + "[[1,1]]\n",
		"listed twice":   "[[1,1],[2,1]]\n",
		"not the format": "[1]\n",
	} {
		t.Run(name, func(t *testing.T) {
			host, sb := net.Pipe()
			m := newSessionMonitor(host, host)
			defer m.close()
			go func() { // a monitor that answers each question with the next line
				defer sb.Close()
				q := make([]byte, 1)
				for _, a := range []string{"[[1,1],[5,5],[5,6]]\n", bad, "[[1,1]]\n"} {
					if _, err := io.ReadFull(sb, q); err != nil {
						return
					}
					if _, err := io.WriteString(sb, a); err != nil {
						return
					}
				}
			}()
			s, err := m.sessions()
			if want := (agent.Sessions{1: {1}, 5: {5, 6}}); err != nil || !maps.EqualFunc(s, want, slices.Equal) {
				t.Fatalf("good answer: %v, %v", s, err)
			}
			if s, err := m.sessions(); err == nil {
				t.Fatalf("bad answer accepted: %v", s)
			}
			if s, err := m.sessions(); err == nil {
				t.Fatalf("an answer after a bad one accepted: %v", s)
			}
		})
	}
}
