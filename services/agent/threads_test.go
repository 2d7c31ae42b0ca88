package agent

import (
	"os"
	"testing"
)

func TestReserveThreadsLeavesIdleThreads(t *testing.T) {
	const n = 32
	reserveThreads(n)
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	// The n threads stay, idle: the main thread and sysmon come on top.
	if len(ents) < n+2 {
		t.Fatalf("%d threads after reserving %d", len(ents), n)
	}
}
