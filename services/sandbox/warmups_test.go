package sandbox

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestWarmupsWaitForStartsAndQuiet(t *testing.T) {
	w := NewWarmups(1, 50*time.Millisecond)
	done := w.Starting()
	// While a sandbox starts, no warm-up runs.
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	ran := false
	if err := w.Run(ctx, func(context.Context) { ran = true }); !errors.Is(err, context.DeadlineExceeded) || ran {
		t.Fatalf("Run during a start: %v, ran %v", err, ran)
	}
	done()
	done() // idempotent
	start := time.Now()
	if err := w.Run(context.Background(), func(context.Context) { ran = true }); err != nil || !ran {
		t.Fatalf("Run after the start: %v, ran %v", err, ran)
	}
	if d := time.Since(start); d < 40*time.Millisecond {
		t.Fatalf("ran %v after the start ended, want the quiet period first", d)
	}
}

func TestWarmupsAtMostN(t *testing.T) {
	w := NewWarmups(2, 0)
	var mu sync.Mutex
	running, peak := 0, 0
	gate := make(chan struct{})
	var wg sync.WaitGroup
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = w.Run(context.Background(), func(context.Context) {
				mu.Lock()
				running++
				peak = max(peak, running)
				mu.Unlock()
				<-gate
				mu.Lock()
				running--
				mu.Unlock()
			})
		}()
	}
	// Let two in, then release them all.
	for {
		mu.Lock()
		r := running
		mu.Unlock()
		if r == 2 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	close(gate)
	wg.Wait()
	if peak != 2 {
		t.Fatalf("peak %d warm-ups at once, want 2", peak)
	}
}

func TestNilWarmupsRunAtOnce(t *testing.T) {
	var w *Warmups
	w.Starting()()
	ran := false
	if err := w.Run(context.Background(), func(context.Context) { ran = true }); err != nil || !ran {
		t.Fatalf("nil Warmups: %v, ran %v", err, ran)
	}
}
