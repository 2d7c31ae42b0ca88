package agent

import (
	"runtime"
	"sync"
)

// spareThreads is how many idle OS threads the agent keeps in reserve.
const spareThreads = 8

// reserveThreads makes the Go runtime create n OS threads now and keep
// them idle. A sandbox can use up its pids limit (a fork bomb), and from
// then on the runtime cannot create a thread: it would abort the agent the
// next time a goroutine blocks in a syscall and needs one. Idle threads are
// reused before new ones are made, and the runtime never frees them.
func reserveThreads(n int) {
	var locked, release sync.WaitGroup
	locked.Add(n)
	release.Add(1)
	for range n {
		go func() {
			// Each locked, blocked goroutine holds a thread of its own, so
			// the runtime must start another for everything else.
			runtime.LockOSThread()
			locked.Done()
			release.Wait()
			runtime.UnlockOSThread() // the thread returns to the idle pool
		}()
	}
	locked.Wait()
	release.Done()
}
