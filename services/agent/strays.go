package agent

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
)

// Strays is the broker's host-side check, from /proc, that a run left no
// process behind; the agent's sweep is the first line, this the second.
// before and after map each session of the sandbox to its live threads
// (host thread IDs), read before and after the run. Every run starts in a
// session of its own, so a live thread in a session absent from before is
// a stray. The notebook kernel is the exception, and is held to more: it
// leads a session of its own (kernelSID, 0 if none), which must hold the
// kernel's own threads and nothing else (a cell's child that stayed in it
// is a stray too); and a run that started a kernel that still lives
// (started) may add exactly one session, holding nothing but the threads
// of its leader: the new kernel's. It returns the kernel session to
// remember for the next run.
func Strays(before, after map[int][]int, kernelSID int, started bool) (stray bool, kernel int) {
	kernel = kernelSID
	if _, ok := after[kernel]; !ok {
		kernel = 0 // the kernel is gone
	}
	var fresh []int
	for sid := range after {
		if _, ok := before[sid]; !ok {
			fresh = append(fresh, sid)
		}
	}
	if started && len(fresh) == 1 && leaderOnly(fresh[0], after[fresh[0]]) {
		kernel, fresh = fresh[0], nil
	}
	if len(fresh) > 0 {
		return true, kernel
	}
	return kernel != 0 && !leaderOnly(kernel, after[kernel]), kernel
}

// leaderOnly reports whether every thread in tids belongs to the process
// sid (the session's leader). A thread that has gone since runs nothing.
func leaderOnly(sid int, tids []int) bool {
	for _, tid := range tids {
		if tgid, ok := threadGroup(tid); ok && tgid != sid {
			return false
		}
	}
	return true
}

// threadGroup reads the thread group (process) ID of a thread.
func threadGroup(tid int) (int, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", tid))
	if err != nil {
		return 0, false
	}
	for line := range bytes.Lines(b) {
		if v, ok := bytes.CutPrefix(line, []byte("Tgid:")); ok {
			n, err := strconv.Atoi(string(bytes.TrimSpace(v)))
			return n, err == nil
		}
	}
	return 0, false
}
