package sandbox

import (
	"testing"
)

// TestRunLockHoldsTheCheckUnderTheLock: Unlock returns while the check
// handed to it runs, and the lock stays held until the check (and a
// retire it calls for) is done; the next holder then finds nothing left
// to run.
func TestRunLockHoldsTheCheckUnderTheLock(t *testing.T) {
	for _, strays := range []bool{false, true} {
		var l RunLock
		release, checking := make(chan struct{}), make(chan struct{})
		retired := make(chan any, 1)
		l.Lock()
		l.AfterUnlock(func() bool {
			close(checking)
			<-release
			return strays
		}, func(p any) { retired <- p })
		l.Unlock() // returns with the check still blocked
		<-checking
		if l.mu.TryLock() {
			t.Fatalf("strays=%v: the lock was free while the check ran", strays)
		}
		close(release)
		l.Lock() // after the check
		select {
		case p := <-retired:
			if !strays || p != nil {
				t.Fatalf("strays=%v: retired with %v", strays, p)
			}
		default:
			if strays {
				t.Fatal("strays found, not retired")
			}
		}
		l.Unlock()
		if !l.mu.TryLock() {
			t.Fatalf("strays=%v: a plain Unlock kept the lock", strays)
		}
	}
}

// TestRunLockRetiresOnAPanickingCheck: a check that panics (it reads what
// the sandbox controls) counts as strays, and the lock is released.
func TestRunLockRetiresOnAPanickingCheck(t *testing.T) {
	var l RunLock
	retired := make(chan any, 1)
	l.Lock()
	l.AfterUnlock(func() bool { panic("bad answer") }, func(p any) { retired <- p })
	l.Unlock()
	l.Lock()
	defer l.Unlock()
	if p := <-retired; p != "bad answer" {
		t.Fatalf("retired with %v", p)
	}
}
