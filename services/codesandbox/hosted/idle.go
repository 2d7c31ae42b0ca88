package hosted

import (
	"context"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Replicas share a session's VM, but each releases its sessions by its own
// idle clock. So every call that uses the VM (a run; an execution, up to
// its copy-back) records its use in the shared csb_sessions.last_used: at
// its start, once it holds a connection, every IdleTimeout/4 while it
// lasts, and at its end. Release hibernates only a VM last used at least
// IdleTimeout ago. This guarantees that the idle release of any replica
// leaves alone a VM that a call on a live replica is using (its last use
// is then at most IdleTimeout/2 old, plus a store write's latency), or
// that a call used less than IdleTimeout (less markEvery) ago.
//
// The check and the hibernation are two steps: a call that starts on
// another replica in between finds its VM going to sleep, and handles it
// as it handles CodeSandbox hibernating a VM itself (prepare connects
// again; a run that had started is looked for, never run twice).

// markTimeout bounds one write of a use.
const markTimeout = 5 * time.Second

// markEvery is the most often one replica records uses of one session's
// VM (the last of a burst of uses may be left out).
func (b *Backend) markEvery() time.Duration { return min(time.Second, b.o.IdleTimeout/4) }

// use records that a call uses the session's VM, until done is called.
func (s *Session) use() (done func()) {
	s.markUse()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(s.b.o.IdleTimeout / 4)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				s.markUse()
			case <-stop:
				return
			}
		}
	})
	var once sync.Once
	return func() {
		once.Do(func() {
			close(stop)
			wg.Wait()
			s.markUse()
		})
	}
}

// markUse records a use of the session's VM now, unless this replica
// recorded one less than markEvery ago. A VM not forked yet has no row:
// the fork's records its first use.
func (s *Session) markUse() {
	id, now := s.v.id(), s.b.now()
	if id == "" || !s.v.markDue(id, now, s.b.markEvery()) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
	defer cancel()
	if err := s.b.db.touch(ctx, s.ref.WorkspaceID, id, now); err != nil {
		s.b.log.Warn().Str("workspace_id", s.ref.WorkspaceID).Str("sandbox_id", id).Msg("codesandbox_session_use_not_recorded")
	}
}

// markDue reports whether a use of VM id at now is to be recorded, and if
// so takes it as recorded.
func (v *vm) markDue(id string, now time.Time, every time.Duration) bool {
	v.markMu.Lock()
	defer v.markMu.Unlock()
	if id == v.markedID && now.Sub(v.markedAt) < every && !now.Before(v.markedAt) {
		return false
	}
	v.markedID, v.markedAt = id, now
	return true
}

// Release implements sandbox.Session: the idle session's VM hibernates
// (memory and disk kept; the next run resumes it), unless a replica used
// it less than IdleTimeout ago; that replica releases it in its turn.
func (s *Session) Release(ctx context.Context) error {
	s.v.disconnect()
	id := s.v.id()
	if id == "" {
		return nil
	}
	last, ok, err := s.b.db.lastUsed(ctx, s.ref.WorkspaceID, id)
	if err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "session store unavailable")
	}
	if ok && s.b.now().Sub(last) < s.b.o.IdleTimeout {
		s.b.log.Debug().Str("sandbox_id", id).Msg("codesandbox_session_vm_in_use")
		return nil
	}
	if err := s.b.c.Hibernate(ctx, id); err != nil && brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		return err
	}
	s.b.log.Info().Str("sandbox_id", id).Msg("codesandbox_session_vm_hibernated")
	return nil
}
