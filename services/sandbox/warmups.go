package sandbox

import (
	"context"
	"sync"
	"time"
)

// Warmups orders the sandboxes' warm-ups: the preload of an agent's
// language runtime (Python's data stack takes a CPU-second or more), which
// a new sandbox's first call does not wait for. They run in the
// background, at most max at once, and only once no sandbox has been
// starting for quiet: a burst of new sessions then gets the CPUs, and the
// warm-ups follow it. A nil *Warmups runs every warm-up at once.
type Warmups struct {
	max   int
	quiet time.Duration

	mu        sync.Mutex
	running   int
	starting  int
	lastStart time.Time
	changed   chan struct{} // closed and replaced on every change
}

// NewWarmups returns a Warmups running at most n (at least 1) at once.
func NewWarmups(n int, quiet time.Duration) *Warmups {
	return &Warmups{max: max(n, 1), quiet: quiet, changed: make(chan struct{})}
}

func (w *Warmups) notifyLocked() {
	close(w.changed)
	w.changed = make(chan struct{})
}

// Starting marks a sandbox start in progress until done is called.
func (w *Warmups) Starting() (done func()) {
	if w == nil {
		return func() {}
	}
	w.mu.Lock()
	w.starting++
	w.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			w.mu.Lock()
			w.starting--
			w.lastStart = time.Now()
			w.notifyLocked()
			w.mu.Unlock()
		})
	}
}

// Run waits for a turn and runs warm in it; it returns ctx's error if ctx
// ends first (warm then does not run).
func (w *Warmups) Run(ctx context.Context, warm func(context.Context)) error {
	if w == nil {
		warm(ctx)
		return nil
	}
	for {
		w.mu.Lock()
		wait := time.Duration(-1) // until something changes
		if w.starting == 0 && w.running < w.max {
			wait = w.quiet - time.Since(w.lastStart)
			if wait <= 0 {
				w.running++
				w.mu.Unlock()
				defer func() {
					w.mu.Lock()
					w.running--
					w.notifyLocked()
					w.mu.Unlock()
				}()
				warm(ctx)
				return nil
			}
		}
		changed := w.changed
		w.mu.Unlock()
		var timer *time.Timer
		var fired <-chan time.Time
		if wait > 0 {
			timer = time.NewTimer(wait)
			fired = timer.C
		}
		select {
		case <-changed:
		case <-fired:
		case <-ctx.Done():
		}
		if timer != nil {
			timer.Stop()
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}
