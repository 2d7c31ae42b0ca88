package agent

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
)

// TestLiveSessionsSeesANewSession reads the host's real /proc: a child in
// a session of its own is listed while it runs and not once it is reaped.
func TestLiveSessionsSeesANewSession(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sid := cmd.Process.Pid
	got, err := LiveSessions("/proc")
	if err != nil || !slices.Contains(got, sid) {
		t.Fatalf("LiveSessions = %v, %v; want it to hold %d", got, err, sid)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	got, err = LiveSessions("/proc")
	if err != nil || slices.Contains(got, sid) {
		t.Fatalf("after the child ended: LiveSessions = %v, %v", got, err)
	}
}

// TestLiveSessionsGVisorZombieLeader: gVisor's /proc has no thread listing
// for a zombie thread-group leader, whether its other threads run on
// (num_threads 2 below, as gVisor reports it) or the whole process has
// exited and waits to be reaped (num_threads 1). Only the first is live.
func TestLiveSessionsGVisorZombieLeader(t *testing.T) {
	root := t.TempDir()
	stat := func(pid, state string, sid, threads int) {
		dir := filepath.Join(root, pid)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		line := pid + " (x) " + state + " 1 " + strconv.Itoa(sid) + " " + strconv.Itoa(sid) + " 0 0 0 0 0 0 0 2 0 0 0 20 0 " + strconv.Itoa(threads) + " 0 201 0 0\n"
		if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(line), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	stat("27", "Z", 27, 2) // zombie leader, one thread still running
	stat("28", "Z", 28, 1) // exited, not reaped
	stat("29", "S", 29, 1) // threads unlisted, but not a zombie
	got, err := LiveSessions(root)
	if err != nil || !slices.Equal(got, []int{27, 29}) {
		t.Fatalf("LiveSessions = %v, %v; want [27 29]", got, err)
	}
}
