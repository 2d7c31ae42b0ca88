package sandbox

import "sync"

// RunLock is a session's run lock whose holder can leave the run's stray
// check (the broker's own look, from the host, for processes the run left)
// to run once it unlocks: in the background, still under the lock. The
// run's answer then goes back without waiting for the check, and whatever
// takes the lock next (the next run; on Docker, where it is the session's
// only lock, file calls and the session's end too) waits for it, so
// nothing a run left behind meets the next one.
type RunLock struct {
	mu     sync.Mutex
	check  func() bool
	retire func(panicked any)
}

// Lock locks l.
func (l *RunLock) Lock() { l.mu.Lock() }

// AfterUnlock hands check to the next Unlock; the caller holds l. When
// check reports strays, or panics (it reads what the sandbox controls),
// retire is called, still under l, with the panic value if any.
func (l *RunLock) AfterUnlock(check func() bool, retire func(panicked any)) {
	l.check, l.retire = check, retire
}

// Unlock unlocks l at once, or after the check handed to AfterUnlock.
func (l *RunLock) Unlock() {
	check, retire := l.check, l.retire
	if check == nil {
		l.mu.Unlock()
		return
	}
	l.check, l.retire = nil, nil
	go func() {
		defer l.mu.Unlock()
		defer func() {
			if p := recover(); p != nil {
				retire(p)
			}
		}()
		if check() {
			retire(nil)
		}
	}()
}
