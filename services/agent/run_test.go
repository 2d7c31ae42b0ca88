package agent

import (
	"os/exec"
	"strconv"
	"syscall"
	"testing"
)

// TestAwaitExitLeavesTheKillToTheSweep: awaitExit only waits. A process
// still live after exitGrace (a run that reported its end and went on) is
// left as it was, for the sweep to kill.
func TestAwaitExitLeavesTheKillToTheSweep(t *testing.T) {
	live := exec.Command("sleep", "1000")
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = live.Process.Kill(); _ = live.Wait() }()
	awaitExit("/proc", live.Process.Pid)
	b, err := ReadProcFile("/proc/" + strconv.Itoa(live.Process.Pid) + "/stat")
	if err != nil {
		t.Fatal(err)
	}
	if st, ok := ParseProcStat(b); !ok || !st.Live() || st.State == 'T' {
		t.Fatalf("awaitExit disturbed a live process: %+v", st)
	}
	if err := syscall.Kill(live.Process.Pid, 0); err != nil {
		t.Fatal(err)
	}
}
