package sandbox

import "sync"

// Why the sandbox that held a session's kernel went (KernelLedger.Lost).
const (
	LostTimeout      = "a run timed out and the sandbox was replaced"
	LostOOM          = "a run ran out of memory and the sandbox was replaced"
	LostStrays       = "a run left processes behind and the sandbox was replaced"
	LostQuota        = "a run exceeded the workspace quota and the sandbox was replaced"
	LostUnresponsive = "the sandbox stopped responding and was replaced"
	LostStopped      = "the sandbox was stopped"
	LostIdle         = "the session's sandbox was released while idle"
)

// KernelLedger is a session's memory of its notebook kernel across
// sandbox restarts. The agent that ran a kernel may be gone with its
// container, so the session itself notes that a kernel ran and why it was
// lost, and the next notebook run that starts a new kernel says so.
type KernelLedger struct {
	mu   sync.Mutex
	ran  bool   // a kernel has run in this session
	live bool   // and may still be running
	lost string // why it went, if known
}

// Lost notes that the sandbox holding the kernel (if one runs) is going
// away, and why. The first reason sticks.
func (l *KernelLedger) Lost(reason string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.live {
		l.live = false
		l.lost = reason
	}
}

// Observe updates the ledger with a notebook run's result and completes
// its Kernel status: StateLost and Reason when the run had to start a new
// kernel after an earlier one, and an OOM kill named as such.
func (l *KernelLedger) Observe(r *ExecResult) {
	k := r.Kernel
	if k == nil {
		return
	}
	if r.OOMKilled && k.Ended != "" {
		k.Ended = "the sandbox ran out of memory and the kernel was killed"
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if k.Started && l.ran {
		k.StateLost = true
		switch {
		case l.lost != "":
			k.Reason = l.lost
		case k.Reason == "":
			k.Reason = "the sandbox was restarted"
		}
	}
	if k.Started {
		l.ran, l.live, l.lost = true, true, ""
	}
	if k.Ended != "" {
		l.live, l.lost = false, k.Ended
	}
}

// KernelLedgers keeps the ledgers of a backend's sessions by workspace
// ID: a session released while idle is opened again as a new Session,
// and its kernel's story must carry over. The zero value is ready.
type KernelLedgers struct {
	mu sync.Mutex
	m  map[string]*KernelLedger
}

// Get returns the workspace's ledger, creating it.
func (k *KernelLedgers) Get(workspaceID string) *KernelLedger {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = map[string]*KernelLedger{}
	}
	l := k.m[workspaceID]
	if l == nil {
		l = &KernelLedger{}
		k.m[workspaceID] = l
	}
	return l
}

// Forget drops the workspace's ledger (its session is destroyed).
func (k *KernelLedgers) Forget(workspaceID string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.m, workspaceID)
}
