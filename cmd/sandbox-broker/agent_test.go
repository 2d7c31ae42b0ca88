package main

import (
	"bufio"
	"crypto/rand"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/podca"
)

// TestPodAgentCatchesTermAndInt: a pod's agent outlasts SIGTERM (see
// agentCmd) by catching it, never by ignoring it, since an ignored
// signal stays ignored in every run and job the agent starts (the job
// tools' INT and TERM would do nothing there). Read from the kernel's own
// account of the agent's dispositions (/proc/PID/status).
func TestPodAgentCatchesTermAndInt(t *testing.T) {
	if dir := os.Getenv("SANDBOX_BROKER_TEST_POD_AGENT"); dir != "" {
		os.Exit(run([]string{"agent", "--listen", "127.0.0.1:0", "--language", "bash", "--no-zygote",
			"--sweep", "descendants", "--workdir", dir, "--tmpdir", dir}, os.Stdin, os.Stdout, os.Stderr, os.Getenv))
	}
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	ca, err := podca.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPodAgentCatchesTermAndInt$")
	cmd.Env = append(os.Environ(), "SANDBOX_BROKER_TEST_POD_AGENT="+t.TempDir(), agent.CAEnv+"="+string(ca.CertPEM()))
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
