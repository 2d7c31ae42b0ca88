package docker

import (
	"golang.org/x/sys/unix"
	"os"
	"testing"
)

// A thread's process comes from the last read only for the same thread:
// same ID and same start time. A reused ID (another start time) is read
// afresh.
func TestHostThreadRemembersOnlyTheSameThread(t *testing.T) {
	pid := os.Getpid()
	sid, err := unix.Getsid(pid)
	if err != nil {
		t.Fatal(err)
	}
	seen := threadGroups{}
	gotSID, gotPID, ok := hostThread(pid, nil, seen)
	if !ok || gotSID != sid || gotPID != pid {
		t.Fatalf("hostThread = %d, %d, %v; want %d, %d, true", gotSID, gotPID, ok, sid, pid)
	}
	st, _ := readHostStat(pid)
	k := threadKey{pid, st.Start}
	if len(seen) != 1 || seen[k] != pid {
		t.Fatalf("seen = %v, want %v: %d", seen, k, pid)
	}

	// The same thread: its process is taken from the last read (a forged
	// one here, to show it is not read again); its session still is.
	next := threadGroups{}
	if gotSID, gotPID, ok = hostThread(pid, threadGroups{k: pid + 1}, next); !ok || gotSID != sid || gotPID != pid+1 {
		t.Fatalf("remembered thread: hostThread = %d, %d, %v; want %d, %d, true", gotSID, gotPID, ok, sid, pid+1)
	}
	if next[k] != pid+1 {
		t.Fatalf("next = %v", next)
	}

	// Another thread under the same ID (a later start time) is read.
	reused := threadGroups{{tid: k.tid, start: k.start + 1}: pid + 1}
	if _, gotPID, ok = hostThread(pid, reused, threadGroups{}); !ok || gotPID != pid {
		t.Fatalf("reused ID: hostThread pid = %d, %v; want %d", gotPID, ok, pid)
	}
}
