package docker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// pool keeps up to Options.PoolSize started, agent-ready containers of one
// language, each with an empty workspace dir <Root>/pool/<id>. A claim
// renames that dir onto the session's workspace path: the container's bind
// mount refers to the directory inode, so it follows the rename.
type pool struct {
	e    *Engine
	lang string
	size int

	mu    sync.Mutex
	ready []*ctr
	kick  chan struct{}
}

func (e *Engine) startPool(lang string) *pool {
	p := &pool{e: e, lang: lang, size: e.o.PoolSize, kick: make(chan struct{}, 1)}
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

// fill runs until the engine closes, topping the pool up whenever kicked.
func (p *pool) fill() {
	defer p.e.bg.Done()
	ctx := p.e.ctx
	backoff := time.Second
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.kick:
		}
		for p.count() < p.size && ctx.Err() == nil {
			c, err := p.e.newPoolContainer(ctx, p.lang)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				p.e.log.Warn().Err(err).Str("language", p.lang).Dur("retry_in", backoff).Msg("pool refill failed")
				select {
				case <-ctx.Done():
					return
				case <-time.After(backoff):
					backoff = min(backoff*2, 30*time.Second)
				case <-p.kick: // the daemon is back (see watch)
					backoff = time.Second
				}
				continue
			}
			backoff = time.Second
			if !p.put(c) || ctx.Err() != nil {
				p.discard(c)
			}
		}
	}
}

// put adds c unless the pool is full.
func (p *pool) put(c *ctr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.ready) >= p.size || p.e.ctx.Err() != nil {
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

// discard removes a pooled container and its pool dir.
func (p *pool) discard(c *ctr) {
	_ = p.e.removeContainer(context.Background(), c)
	if c.poolDir != "" {
		_ = os.RemoveAll(c.poolDir)
	}
}

func (e *Engine) newPoolContainer(ctx context.Context, lang string) (*ctr, error) {
	r, err := e.runner(ctx, lang)
	if err != nil {
		return nil, err
	}
	id := newID()
	dir := filepath.Join(e.o.Root, "pool", id)
	if err := prepareDir(dir); err != nil {
		return nil, err
	}
	c, err := e.startContainer(ctx, r, dir, "pool")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	c.poolDir = dir
	return c, nil
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
// may be replaced by a pool dir (when it does not exist or is empty).
func (e *Engine) acquire(ctx context.Context, r runnerImage, ref sandbox.SessionRef, mayClaim bool) (*ctr, error) {
	e.mu.Lock()
	p := e.pools[r.Language]
	e.mu.Unlock()
	if p != nil && mayClaim {
		start := time.Now()
		if c := p.take(); c != nil {
			p.refill()
			if c.img == r.ID {
				err := os.MkdirAll(filepath.Dir(ref.Dir), 0o711)
				if err == nil {
					// rename(2) replaces an empty directory and fails with
					// ENOTEMPTY/EEXIST on one with files: then cold start.
					err = os.Rename(c.poolDir, ref.Dir)
				}
				if err == nil {
					c.poolDir = ""
					d := time.Since(start)
					e.st.claims.Add(1)
					e.st.lastClaim.Store(int64(d))
					e.log.Debug().Str("language", r.Language).Str("container", shortID(c.dockerID)).Dur("claim", d).Msg("claimed pooled sandbox")
					return c, nil
				}
				if !errors.Is(err, os.ErrExist) {
					e.log.Debug().Err(err).Msg("pool claim not possible; cold start")
				}
				if p.put(c) {
					c = nil
				}
			}
			if c != nil {
				// Stale image or pool full again: drop it.
				e.bg.Add(1)
				go func() { defer e.bg.Done(); p.discard(c) }()
			}
		}
	}
	start := time.Now()
	if _, err := os.Lstat(ref.Dir); err != nil {
		if err := os.MkdirAll(filepath.Dir(ref.Dir), 0o711); err != nil {
			return nil, err
		}
		if err := prepareDir(ref.Dir); err != nil {
			return nil, err
		}
	}
	c, err := e.startContainer(ctx, r, ref.Dir, ref.WorkspaceID)
	if err != nil {
		return nil, err
	}
	d := time.Since(start)
	e.st.colds.Add(1)
	e.st.last.Store(int64(d))
	e.log.Debug().Str("language", r.Language).Str("container", shortID(c.dockerID)).Dur("cold_start", d).Msg("started sandbox")
	return c, nil
}
