package main

import (
	"bufio"
	"crypto/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/podca"
)

// TestPodAgentCatchesTermAndInt: a pod's agent outlasts SIGTERM (see
// agent.Main) by catching it, never by ignoring it, since an ignored
// signal stays ignored in every run and job the agent starts (the job
// tools' INT and TERM would do nothing there). Read from the kernel's own
// account of the agent's dispositions (/proc/PID/status).
func TestPodAgentCatchesTermAndInt(t *testing.T) {
	podArgs := func(dir string) []string {
		return []string{"agent", "--listen", "127.0.0.1:0", "--language", "bash", "--no-zygote",
			"--sweep", "descendants", "--workdir", dir, "--tmpdir", dir}
	}
	if dir := os.Getenv("SANDBOX_BROKER_TEST_POD_AGENT"); dir != "" {
		os.Exit(run(podArgs(dir), os.Stdin, os.Stdout, os.Stderr, os.Getenv))
	}
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	ca, err := podca.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	caEnv := agent.CAEnv + "=" + string(ca.CertPEM())
	// The agent built alone (cmd/sandbox-agent) sets up its signals in its
	// own main.
	alone := filepath.Join(t.TempDir(), agent.BinaryName)
	if out, err := exec.Command("go", "build", "-o", alone, "../sandbox-agent").CombinedOutput(); err != nil {
		t.Fatalf("build sandbox-agent: %v\n%s", err, out)
	}
	t.Run("sandbox-broker agent", func(t *testing.T) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestPodAgentCatchesTermAndInt$")
		cmd.Env = append(os.Environ(), "SANDBOX_BROKER_TEST_POD_AGENT="+t.TempDir(), caEnv)
		checkCatchesTermAndInt(t, cmd)
	})
	t.Run("sandbox-agent agent", func(t *testing.T) {
		cmd := exec.Command(alone, podArgs(t.TempDir())...)
		cmd.Env = append(os.Environ(), caEnv)
		checkCatchesTermAndInt(t, cmd)
	})
}

// checkCatchesTermAndInt starts cmd, a pod agent, and checks its
// dispositions once it is set up.
func checkCatchesTermAndInt(t *testing.T, cmd *exec.Cmd) {
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	// The first line (its certificate request) comes once the agent is
	// set up, its signal handling included.
	line, err := bufio.NewReader(out).ReadString('\n')
	if _, perr := podca.ParseCSRLine(line); err != nil || perr != nil {
		t.Fatalf("first line %q: %v %v", line, err, perr)
	}
	status, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	mask := func(name string) uint64 {
		for l := range strings.Lines(string(status)) {
			if v, ok := strings.CutPrefix(l, name+":"); ok {
				m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
				if err != nil {
					t.Fatal(err)
				}
				return m
			}
		}
		t.Fatalf("no %s in status", name)
		return 0
	}
	ign, cgt := mask("SigIgn"), mask("SigCgt")
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		bit := uint64(1) << (sig - 1)
		if ign&bit != 0 || cgt&bit == 0 {
			t.Errorf("%v: ignored %v, caught %v; want caught and not ignored", sig, ign&bit != 0, cgt&bit != 0)
		}
	}
}
