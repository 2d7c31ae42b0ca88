package docker

import (
	"context"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/events"
	"github.com/docker/docker/api/types/filters"
)

// The watcher's wait between attempts to follow the daemon's events
// again: a restarted daemon is noticed within a few seconds.
const (
	minWatchBackoff = 100 * time.Millisecond
	maxWatchBackoff = 5 * time.Second
)

// track registers a started container so the watcher can tell when it
// dies; removeContainer forgets it.
func (e *Engine) track(c *ctr) {
	e.mu.Lock()
	e.live[c.dockerID] = c
	e.mu.Unlock()
}

func (e *Engine) untrack(c *ctr) {
	e.mu.Lock()
	if e.live[c.dockerID] == c {
		delete(e.live, c.dockerID)
	}
	e.mu.Unlock()
}

// watch follows the daemon's events for this engine's containers until
// Close. A container that dies behind the broker's back (a restarted
// daemon kills them all; an operator may kill one) is marked gone, so its
// session starts a new one on its next call, and removed; a pooled one is
// replaced. When the event stream breaks (the daemon went away), the
// watcher subscribes again with a backoff and then compares every tracked
// container with what the daemon has, which catches the deaths it could
// not hear about.
func (e *Engine) watch() {
	defer e.bg.Done()
	backoff, lost := minWatchBackoff, false
	for e.ctx.Err() == nil {
		err := e.follow(e.ctx, func() {
			backoff = minWatchBackoff
			if lost {
				lost = false
				e.log.Info().Msg("docker_events_resumed")
			}
		})
		if e.ctx.Err() != nil {
			return
		}
		if !lost {
			lost = true
			e.log.Warn().Err(err).Msg("docker_events_lost")
		}
		select {
		case <-e.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, maxWatchBackoff)
	}
}

// follow subscribes to the daemon's events, reconciles (then calls
// onSync), and handles events until the stream or the reconcile fails.
func (e *Engine) follow(ctx context.Context, onSync func()) error {
	ctx, cancel := context.WithCancel(ctx) // ends the subscription
	defer cancel()
	msgs, errs := e.cli.Events(ctx, events.ListOptions{Filters: filters.NewArgs(
		filters.Arg("type", string(events.ContainerEventType)),
		filters.Arg("label", LabelInstance+"="+e.o.InstanceID),
		filters.Arg("event", string(events.ActionDie)),
		filters.Arg("event", string(events.ActionDestroy)),
	)})
	if err := e.reconcile(ctx); err != nil {
		return err
	}
	onSync()
	for {
		select {
		case m := <-msgs:
			e.markDead(m.Actor.ID)
		case err := <-errs:
			return err
		}
	}
}

// reconcile marks every tracked container that the daemon no longer has,
// or has stopped, as dead, then wakes the pool fillers. Tracked containers
// are read before the list, so one created meanwhile is not mistaken for
// dead.
func (e *Engine) reconcile(ctx context.Context) error {
	e.mu.Lock()
	tracked := make([]string, 0, len(e.live))
	for id := range e.live {
		tracked = append(tracked, id)
	}
	e.mu.Unlock()
	lctx, cancel := context.WithTimeout(ctx, connectTimeout)
	list, err := e.cli.ContainerList(lctx, container.ListOptions{
		All:     true,
		Filters: filters.NewArgs(filters.Arg("label", LabelInstance+"="+e.o.InstanceID)),
	})
	cancel()
	if err != nil {
		return err
	}
	alive := make(map[string]bool, len(list))
	for _, c := range list {
		switch c.State {
		case container.StateCreated, container.StateRunning, container.StatePaused, container.StateRestarting:
			alive[c.ID] = true
		}
	}
	for _, id := range tracked {
		if !alive[id] {
			e.markDead(id)
		}
	}
	e.mu.Lock()
	for _, p := range e.pools {
		p.refill()
	}
	e.mu.Unlock()
	return nil
}

// markDead handles the death of a tracked container: its session drops it
// at its next use (a run in flight has already failed), a pooled one leaves
// the pool, and the container and its run dir are removed.
func (e *Engine) markDead(dockerID string) {
	e.mu.Lock()
	c, ok := e.live[dockerID]
	var p *pool
	if ok {
		p = e.pools[c.lang]
	}
	e.mu.Unlock()
	if !ok {
		return
	}
	c.markDied()
	pooled := p != nil && p.remove(c)
	e.log.Info().Str("container", shortID(dockerID)).Bool("pooled", pooled).Msg("sandbox_container_died")
	if pooled {
		e.bg.Add(1)
		go func() { defer e.bg.Done(); _ = p.discard(e.ctx, c) }()
		p.refill()
		return
	}
	e.removeAsync(c)
}
