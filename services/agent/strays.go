package agent

// Strays is the broker's check that a run left no process behind; the
// agent's sweep is the first line, this the second. before and after are
// the sandbox's Sessions read before and after the run, by the broker
// (from the host's /proc under runc, through the session monitor under
// gVisor) rather than from the agent. Every run starts in a session of its
// own, so a live process in a session absent from before is a stray. The
// notebook kernel is the exception, and is held to more: it leads a
// session of its own (kernelSID, 0 if none), which must hold the kernel
// and nothing else (a cell's child that stayed in it is a stray too); and
// a run that started a kernel that still lives (started) may add exactly
// one session, holding nothing but its leader: the new kernel. It returns
// the kernel session to remember for the next run.
//
// It reads nothing itself: the IDs are in the namespace of the /proc they
// came from, which under gVisor is not the host's.
func Strays(before, after Sessions, kernelSID int, started bool) (stray bool, kernel int) {
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

// leaderOnly reports whether the session sid holds its leader's process
// and no other.
func leaderOnly(sid int, procs []int) bool {
	return len(procs) == 1 && procs[0] == sid
}
