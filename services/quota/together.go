package quota

import (
	"context"
	"errors"
	"runtime"
)

// taker is one call waiting to run its part of a shared write transaction.
type taker struct {
	ctx  context.Context
	fn   func(w *write) error
	err  error
	lead bool          // handed the lead instead of being served
	done chan struct{} // closed once served or handed the lead
}

// writeTogether runs fn in a write transaction shared with the concurrent
// callers (group commit): every tool call takes from the rate limit, and a
// transaction's fixed cost (the write lock, the generation, the commit)
// is most of a take's. The first caller leads: it yields the processor
// once so that callers already runnable can queue, then runs everyone
// queued, in order, in one transaction (each sees the view changes of
// those before it), and hands the lead to the first caller that queued
// meanwhile. A failed transaction fails every caller in it.
func (s *Store) writeTogether(ctx context.Context, fn func(w *write) error) error {
	t := &taker{ctx: ctx, fn: fn, done: make(chan struct{})}
	s.tmu.Lock()
	s.takers = append(s.takers, t)
	if s.leading {
		s.tmu.Unlock()
		<-t.done
		if !t.lead {
			return t.err
		}
	} else {
		s.leading = true
		s.tmu.Unlock()
	}
	runtime.Gosched()
	s.tmu.Lock()
	batch := s.takers
	s.takers = nil
	s.tmu.Unlock()
	defer s.handOff()
	s.serve(batch)
	return t.err
}

// serve runs batch's takes in one write transaction and tells each its
// result (the leader, which is in it, reads its own).
func (s *Store) serve(batch []*taker) {
	defer func() { // even if a take panics: the others must not wait forever
		for _, t := range batch {
			if !t.lead {
				close(t.done)
			}
		}
	}()
	var live []*taker
	for _, t := range batch {
		if t.err = t.ctx.Err(); t.err == nil { // else it gave up while queued
			t.err = errNotServed
			live = append(live, t)
		}
	}
	if len(live) > 0 {
		err := s.writeTx(context.Background(), func(w *write) error {
			for _, t := range live {
				if err := t.fn(w); err != nil {
					return err
				}
				s.applyNow(w)
			}
			return nil
		})
		for _, t := range live {
			t.err = err
		}
	}
}

// errNotServed is the result of a take whose transaction never finished
// (another take in it panicked).
var errNotServed = errors.New("quota: the shared write transaction was abandoned")

// handOff gives the lead to the first caller that queued while the leader
// served, or ends leading.
func (s *Store) handOff() {
	s.tmu.Lock()
	defer s.tmu.Unlock()
	if len(s.takers) == 0 {
		s.leading = false
		return
	}
	next := s.takers[0]
	next.lead = true
	close(next.done)
}
