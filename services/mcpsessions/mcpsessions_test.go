package mcpsessions

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

func open(t *testing.T, loc string, c *clock) *Store {
	t.Helper()
	s, err := Open(context.Background(), loc, c.now)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// A session made on one replica is served by another, only to its owner,
// until it is terminated or idles past the TTL.
func TestSessionsSharedAcrossReplicas(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		ctx := context.Background()
		loc := st.Loc(t)
		c := &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
		a, b := open(t, loc, c), open(t, loc, c)
		id := a.Generate()
		if err := a.Bind(ctx, id, "alice"); err != nil {
			t.Fatal(err)
		}
		if err := b.Bind(ctx, id, "mallory"); err != nil { // a second bind changes nothing
			t.Fatal(err)
		}
		if err := b.Touch(ctx, id, "alice"); err != nil {
			t.Fatalf("owner on the other replica: %v", err)
		}
		if err := b.Touch(ctx, id, "mallory"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("someone else's session: %v", err)
		}
		if term, err := b.Validate(id); err != nil || term {
			t.Fatalf("Validate on the other replica: %v %v", term, err)
		}
		if _, err := b.Validate("mcp-session-unknown"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("unknown id: %v", err)
		}
		c.add(IdleTTL - time.Second)
		if err := a.Touch(ctx, id, "alice"); err != nil { // refreshes it
			t.Fatal(err)
		}
		c.add(IdleTTL - time.Second)
		if term, err := b.Validate(id); err != nil || term {
			t.Fatalf("refreshed session expired: %v %v", term, err)
		}
		if _, err := a.Terminate(id); err != nil {
			t.Fatal(err)
		}
		if term, err := b.Validate(id); err != nil || !term {
			t.Fatalf("terminated on a, on b: %v %v", term, err)
		}
		if err := b.Touch(ctx, id, "alice"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("terminated session touched: %v", err)
		}
		idle := a.Generate()
		c.add(IdleTTL + time.Second)
		if _, err := b.Validate(idle); !errors.Is(err, ErrNotFound) {
			t.Fatalf("idle past the TTL: %v", err)
		}
		b.Prune(ctx)
		var n int
		if err := a.db.QueryRow(`SELECT count(*) FROM mcp_sessions`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("after Prune %d rows: %v", n, err)
		}
	})
}

// A principal's sessions are capped; its least recently used go first and
// nobody else's do.
func TestPerPrincipalCap(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		ctx := context.Background()
		c := &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
		s := open(t, st.Loc(t), c)
		other := s.Generate()
		if err := s.Bind(ctx, other, "bob"); err != nil {
			t.Fatal(err)
		}
		var ids []string
		for range PerPrincipal + 5 {
			c.add(time.Second)
			id := s.Generate()
			if err := s.Bind(ctx, id, "flooder"); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		for i, id := range ids {
			err := s.Touch(ctx, id, "flooder")
			if i < 5 && !errors.Is(err, ErrNotFound) || i >= 5 && err != nil {
				t.Fatalf("session %d: %v", i, err)
			}
		}
		if err := s.Touch(ctx, other, "bob"); err != nil {
			t.Fatalf("bob's session evicted by the flooder: %v", err)
		}
	})
}

// checkedSession makes a session of principal's on s and checks it there.
func checkedSession(t *testing.T, s *Store, principal string) string {
	t.Helper()
	id := s.Generate()
	if err := s.Bind(context.Background(), id, principal); err != nil {
		t.Fatal(err)
	}
	if err := s.Touch(context.Background(), id, principal); err != nil {
		t.Fatal(err)
	}
	return id
}

// A replica answers a session's checks from its own successful check for
// checkFresh: a session ended through another replica can be used by its
// owner on this one until then, and never by anyone else. What this
// replica ends, or may have ended, it stops answering for at once.
func TestTouchAnswersFromARecentCheck(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		ctx := context.Background()
		loc := st.Loc(t)
		c := &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
		a, b := open(t, loc, c), open(t, loc, c)
		id := a.Generate()
		if err := a.Bind(ctx, id, "alice"); err != nil {
			t.Fatal(err)
		}
		if err := b.Touch(ctx, id, "alice"); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Terminate(id); err != nil {
			t.Fatal(err)
		}
		if err := a.Touch(ctx, id, "alice"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("ended on this replica, touched here: %v", err)
		}
		c.add(checkFresh - time.Millisecond)
		if err := b.Touch(ctx, id, "alice"); err != nil {
			t.Fatalf("within checkFresh of the other replica's check: %v", err)
		}
		if err := b.Touch(ctx, id, "mallory"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("someone else, within checkFresh of the owner's check: %v", err)
		}
		c.add(time.Millisecond)
		if err := b.Touch(ctx, id, "alice"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("checkFresh after the other replica's check: %v", err)
		}

		// A clock stepped back does not extend a check.
		live := checkedSession(t, b, "alice")
		if _, err := a.Terminate(live); err != nil {
			t.Fatal(err)
		}
		c.add(-time.Millisecond)
		if err := b.Touch(ctx, live, "alice"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("after the clock stepped back: %v", err)
		}

		// Binding may drop the principal's other sessions: checks made
		// before it are not used after it.
		kept := checkedSession(t, b, "bob")
		if _, err := a.db.Exec(`DELETE FROM mcp_sessions WHERE id = ?`, kept); err != nil {
			t.Fatal(err)
		}
		if err := b.Bind(ctx, b.Generate(), "bob"); err != nil {
			t.Fatal(err)
		}
		if err := b.Touch(ctx, kept, "bob"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("a check made before a Bind, used after it: %v", err)
		}
	})
}

// A check that read the row before this replica ended the session is not
// remembered after it.
func TestCheckBeforeAnEndIsNotRemembered(t *testing.T) {
	c := &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	s := open(t, t.TempDir()+"/state.db", c)
	id := s.Generate()
	if err := s.Bind(context.Background(), id, "alice"); err != nil {
		t.Fatal(err)
	}
	epoch, fresh := s.recall(id, "alice", c.now())
	if fresh {
		t.Fatal("answered from a check never made")
	}
	// The check read the row here, then the session ended.
	if _, err := s.Terminate(id); err != nil {
		t.Fatal(err)
	}
	s.remember(id, "alice", c.now(), epoch)
	if _, fresh := s.recall(id, "alice", c.now()); fresh {
		t.Fatal("a check that began before Terminate answers after it")
	}
}
