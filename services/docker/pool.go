package docker

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// pool keeps started, agent-ready containers of one language, each with
// an empty workspace dir <Root>/pool/<id> and a uid leased under a pool
// key. A claim renames that dir onto the session's workspace path (the
// container's bind mount refers to the directory inode, so it follows the
// rename) and moves the uid's lease to the session: the container already
// runs as the uid the session keeps.
//
// Its size follows demand: as many containers as sessions took one of
// this language in the last poolDemandWindow, at least Options.PoolSize
// and at most poolMaxScale times it, started up to poolParallel at once.
// Warm containers count toward the live-container cap (Options.Slots), and
// a session at the cap takes a warm container's place.
type pool struct {
	e     *Engine
	lang  string
	floor int

	mu     sync.Mutex
	ready  []*ctr
	demand []time.Time // when sessions took a container, within the window
	kick   chan struct{}
}

const (
	poolDemandWindow = 10 * time.Second
	poolMaxScale     = 4
	poolParallel     = 4
)

func (e *Engine) startPool(lang string) *pool {
	p := &pool{e: e, lang: lang, floor: e.o.PoolSize, kick: make(chan struct{}, 1)}
	e.bg.Add(1)
	go p.fill()
	p.refill()
	return p
}

// refill wakes the filler.
func (p *pool) refill() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *pool) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ready)
}

// noteDemand records that a session took a container of the pool's
// language (from the pool or not).
func (p *pool) noteDemand() {
	p.mu.Lock()
	p.demand = append(p.demand, time.Now())
	p.mu.Unlock()
	p.refill()
}

// targetLocked is the size the pool aims for now, and when that may next
// change by itself (the oldest demand leaving the window; zero if never).
func (p *pool) targetLocked() (int, time.Time) {
	cutoff := time.Now().Add(-poolDemandWindow)
	i := 0
	for i < len(p.demand) && p.demand[i].Before(cutoff) {
		i++
	}
	p.demand = p.demand[i:]
	var next time.Time
	if len(p.demand) > 0 {
		next = p.demand[0].Add(poolDemandWindow)
	}
	return min(max(len(p.demand), p.floor), p.floor*poolMaxScale), next
}

// fill runs until the engine closes, keeping the pool at its target:
// starting containers (in parallel, backing off while starts fail) and
// removing the ones demand no longer calls for.
func (p *pool) fill() {
	defer p.e.bg.Done()
	ctx := p.e.ctx
	backoff := time.Second
	var retryAt time.Time
	filling := 0 // starts in progress
	done := make(chan error, poolParallel)
	for {
		p.mu.Lock()
		target, next := p.targetLocked()
		var extra []*ctr
		if len(p.ready) > target {
			extra = append(extra, p.ready[target:]...)
			p.ready = p.ready[:target:target]
		}
		for time.Now().After(retryAt) && len(p.ready)+filling < target && filling < poolParallel && ctx.Err() == nil {
			filling++
			go func() { done <- p.startOne(ctx) }()
		}
		p.mu.Unlock()
		for _, c := range extra {
			p.e.discardAsync(p, c)
		}
		if next.IsZero() || (!retryAt.IsZero() && retryAt.Before(next)) {
			next = retryAt
		}
		var wake <-chan time.Time
		if !next.IsZero() {
			wake = time.After(time.Until(next))
		}
		select {
		case <-ctx.Done():
			for ; filling > 0; filling-- { // the starts end with ctx
				<-done
			}
			return
		case err := <-done:
			filling--
			switch {
			case err == nil:
				backoff, retryAt = time.Second, time.Time{}
			case ctx.Err() == nil:
				ev := p.e.log.Warn()
				if brokererr.CodeOf(err) == brokererr.QuotaExceeded {
					ev = p.e.log.Debug() // at the container cap: sessions come first
				}
				ev.Err(err).Str("language", p.lang).Dur("retry_in", backoff).Msg("pool refill failed")
				retryAt = time.Now().Add(backoff)
				backoff = min(backoff*2, 30*time.Second)
			}
		case <-p.kick: // a claim, or the daemon is back (see watch)
			backoff, retryAt = time.Second, time.Time{}
		case <-wake:
		}
	}
}

// startOne starts a container and adds it to the pool (or removes it when
// the pool no longer wants it).
func (p *pool) startOne(ctx context.Context) error {
	c, err := p.e.newPoolContainer(ctx, p.lang)
	if err != nil {
		return err
	}
	if !p.put(c) || ctx.Err() != nil {
		_ = p.discard(ctx, c)
	}
	return nil
}

// put adds c unless the pool is full.
func (p *pool) put(c *ctr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	target, _ := p.targetLocked()
	if len(p.ready) >= target || p.e.ctx.Err() != nil {
		return false
	}
	p.ready = append(p.ready, c)
	return true
}

// take pops the oldest ready container, or nil.
func (p *pool) take() *ctr {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.ready) == 0 {
		return nil
	}
	c := p.ready[0]
	p.ready = p.ready[1:]
	return c
}

// remove takes c out of the pool and reports whether it was there.
func (p *pool) remove(c *ctr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, r := range p.ready {
		if r == c {
			p.ready = append(p.ready[:i:i], p.ready[i+1:]...)
			return true
		}
	}
	return false
}

// drain empties the pool and returns what it held.
func (p *pool) drain() []*ctr {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.ready
	p.ready = nil
	return out
}

// discard removes a pooled container, its pool dir and its uid lease (a
// container that may still run keeps its uid until the next start's sweep).
func (p *pool) discard(ctx context.Context, c *ctr) error {
	err := p.e.removeContainer(ctx, c)
	_ = os.RemoveAll(c.poolDir)
	if err != nil {
		return err
	}
	if err := p.e.o.UIDs.Free(context.WithoutCancel(ctx), p.e.poolKey(filepath.Base(c.poolDir))); err != nil {
		p.e.log.Warn().Err(err).Msg("pool_uid_not_freed")
	}
	return nil
}

// poolKey is the uid lease owner of the warm container whose pool dir is
// <Root>/pool/<id> ("" gives the prefix of every such key of this root).
func (e *Engine) poolKey(id string) string { return "pool:" + e.o.Root + ":" + id }

func (e *Engine) newPoolContainer(ctx context.Context, lang string) (*ctr, error) {
	r, err := e.runner(ctx, lang)
	if err != nil {
		return nil, err
	}
	slot, err := e.takeSlot(ctx, false)
	if err != nil {
		return nil, err
	}
	id := sandbox.NewID()
	uid, err := e.o.UIDs.Lease(ctx, e.poolKey(id))
	if err != nil {
		slot.Release()
		return nil, err
	}
	dir := filepath.Join(e.o.Root, "pool", id)
	var c *ctr
	if err = prepareDir(dir, uid); err != nil {
		slot.Release()
	} else {
		c, err = e.startContainer(ctx, r, dir, "pool", uid, slot)
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		_ = e.o.UIDs.Free(context.WithoutCancel(ctx), e.poolKey(id))
		return nil, err
	}
	c.poolDir = dir
	return c, nil
}

// takeSlot takes a place under the live-container cap. A session's
// container may take a warm container's place (it is removed first): a
// session waiting is worse than a cold start later.
func (e *Engine) takeSlot(ctx context.Context, forSession bool) (*sandbox.Slot, error) {
	if sl, ok := e.o.Slots.Acquire(); ok {
		return sl, nil
	}
	if forSession {
		e.mu.Lock()
		pools := slices.Collect(maps.Values(e.pools))
		e.mu.Unlock()
		for _, p := range pools {
			if c := p.take(); c != nil {
				p.refill() // it retries until the cap leaves room
				sl := c.slot
				c.slot = nil
				if err := p.discard(ctx, c); err != nil {
					sl.Release() // as removeContainer does when removal fails
					return nil, brokererr.Wrap(err, brokererr.Unavailable, "cannot make room for a sandbox")
				}
				e.log.Info().Str("language", p.lang).Msg("warm_container_evicted_at_cap")
				return sl, nil
			}
		}
	}
	err := brokererr.New(brokererr.QuotaExceeded,
		"the broker already runs its maximum of %d sandbox containers; try again when other sessions have gone idle", e.o.Slots.Max())
	// Retryable even when no session's idle time is known (jobs pin them):
	// containers go when sessions close or jobs end.
	err = err.WithRetryAfter(max(e.o.Slots.RetryAfter(time.Now()), 0))
	return nil, err
}

func (e *Engine) acquired(lang, source string, d time.Duration) {
	if e.o.OnAcquire != nil {
		e.o.OnAcquire(lang, source, d)
	}
}

// Stats counts how session containers were obtained.
type Stats struct {
	Claims        int64         // taken from the warm pool
	ColdStarts    int64         // created on demand
	LastClaim     time.Duration // latency of the last pool claim (take + rename)
	LastColdStart time.Duration // latency of the last cold start (create + start + agent ready)
	PoolReady     map[string]int
}

type stats struct {
	claims, colds   atomic.Int64
	lastClaim, last atomic.Int64
}

// Stats returns the engine's pool counters.
func (e *Engine) Stats() Stats {
	s := Stats{
		Claims:        e.st.claims.Load(),
		ColdStarts:    e.st.colds.Load(),
		LastClaim:     time.Duration(e.st.lastClaim.Load()),
		LastColdStart: time.Duration(e.st.last.Load()),
		PoolReady:     map[string]int{},
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for l, p := range e.pools {
		s.PoolReady[l] = p.count()
	}
	return s
}

// acquire gives a session a container for r.Language with ref.Dir mounted.
// mayClaim says the session has no other container, so its workspace path
// may be replaced by a pool dir (when it does not exist or is empty); the
// claimed container's uid becomes the session's. Otherwise a container
// starts as the session's uid (leased by uid), after its workspace is
// given to that uid.
func (e *Engine) acquire(ctx context.Context, r runnerImage, ref sandbox.SessionRef, mayClaim bool, uid func() (int, error)) (*ctr, error) {
	e.mu.Lock()
	p := e.pools[r.Language]
	e.mu.Unlock()
	if p != nil && mayClaim {
		if c := e.claim(ctx, p, r, ref); c != nil {
			p.noteDemand()
			return c, nil
		}
	}
	start := time.Now()
	id, err := uid()
	if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(ref.Dir); err != nil {
		if err := os.MkdirAll(filepath.Dir(ref.Dir), 0o711); err != nil {
			return nil, err
		}
		if err := prepareDir(ref.Dir, id); err != nil {
			return nil, err
		}
	} else {
		w, err := workspace.OpenOwned(ref.Dir, e.o.WorkspaceLimits, workspace.WithOwner(id, id))
		if err != nil {
			return nil, err
		}
		_ = w.Close()
	}
	slot, err := e.takeSlot(ctx, true)
	if err != nil {
		return nil, err
	}
	defer e.o.Warmups.Starting()()
	c, err := e.startContainer(ctx, r, ref.Dir, ref.WorkspaceID, id, slot)
	if err != nil {
		return nil, err
	}
	if p != nil {
		p.noteDemand() // after the session took its slot: the pool comes second
	}
	d := time.Since(start)
	e.st.colds.Add(1)
	e.st.last.Store(int64(d))
	e.acquired(r.Language, "cold", d)
	e.log.Debug().Str("language", r.Language).Str("container", shortID(c.dockerID)).Dur("cold_start", d).Msg("started sandbox")
	return c, nil
}

// claim takes a warm container for ref, or returns nil.
func (e *Engine) claim(ctx context.Context, p *pool, r runnerImage, ref sandbox.SessionRef) *ctr {
	start := time.Now()
	c := p.take()
	if c == nil {
		return nil
	}
	p.refill()
	if c.img == r.ID {
		key := e.poolKey(filepath.Base(c.poolDir))
		err := os.MkdirAll(filepath.Dir(ref.Dir), 0o711)
		if err == nil {
			// rename(2) replaces an empty directory and fails with
			// ENOTEMPTY/EEXIST on one with files: then cold start.
			err = os.Rename(c.poolDir, ref.Dir)
		}
		if err == nil {
			// The workspace is now the container's: so is its uid (the
			// workspace's old one, if any, owned nothing left in it).
			if _, err = e.o.UIDs.Move(context.WithoutCancel(ctx), key, ref.WorkspaceID); err != nil {
				e.log.Warn().Err(err).Msg("pool claim uid move failed; cold start")
				e.discardAsync(p, c)
				return nil
			}
			c.poolDir = ""
			d := time.Since(start)
			e.st.claims.Add(1)
			e.st.lastClaim.Store(int64(d))
			e.acquired(r.Language, "pool", d)
			e.log.Debug().Str("language", r.Language).Str("container", shortID(c.dockerID)).Dur("claim", d).Msg("claimed pooled sandbox")
			return c
		}
		if !errors.Is(err, os.ErrExist) {
			e.log.Debug().Err(err).Msg("pool claim not possible; cold start")
		}
		if p.put(c) {
			return nil
		}
	}
	// Stale image or pool full again: drop it.
	e.discardAsync(p, c)
	return nil
}

// discardAsync discards a warm container in the background (Close waits).
func (e *Engine) discardAsync(p *pool, c *ctr) {
	e.bg.Add(1)
	go func() { defer e.bg.Done(); _ = p.discard(context.Background(), c) }()
}
