package hosted

import (
	"context"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// csb_sessions migrates and round-trips on both stores; a reopen (another
// broker or replica) finds the same rows and a VM cannot serve two
// workspaces.
func TestStoreOnBothStores(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		ctx := context.Background()
		loc := st.Loc(t)
		s, err := openStore(ctx, loc)
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.UnixMilli(1_700_000_000_000)
		if err := s.put(ctx, "ws-1", "alice", "vm-1", t0); err != nil {
			t.Fatal(err)
		}
		if err := s.put(ctx, "ws-2", "bob", "vm-1", t0); err == nil {
			t.Fatal("a second workspace took vm-1")
		}
		if err := s.put(ctx, "ws-1", "alice", "vm-2", t0); err == nil {
			t.Fatal("a second VM took ws-1")
		}
		// Uses move last_used forward only, and only for the VM the row names.
		for _, u := range []struct {
			vm string
			at time.Time
		}{{"vm-1", t0.Add(time.Minute)}, {"vm-1", t0.Add(time.Second)}, {"vm-2", t0.Add(time.Hour)}} {
			if err := s.touch(ctx, "ws-1", u.vm, u.at); err != nil {
				t.Fatal(err)
			}
		}
		if last, ok, err := s.lastUsed(ctx, "ws-1", "vm-1"); err != nil || !ok || !last.Equal(t0.Add(time.Minute)) {
			t.Fatalf("lastUsed = %v, %v, %v; want %v", last, ok, err, t0.Add(time.Minute))
		}
		if _, ok, err := s.lastUsed(ctx, "ws-1", "vm-2"); err != nil || ok {
			t.Fatalf("lastUsed of a VM the row does not name: %v, %v", ok, err)
		}
		if err := s.removeVM(ctx, "ws-1", "vm-2"); err != nil {
			t.Fatal(err)
		}
		s.close()

		s, err = openStore(ctx, loc)
		if err != nil {
			t.Fatal(err)
		}
		defer s.close()
		p, vm, err := s.get(ctx, "ws-1")
		if err != nil || p != "alice" || vm != "vm-1" {
			t.Fatalf("get = %q, %q, %v", p, vm, err)
		}
		if ok, err := s.known(ctx, "vm-1"); err != nil || !ok {
			t.Fatalf("known(vm-1) = %v, %v", ok, err)
		}
		if err := s.remove(ctx, "ws-1"); err != nil {
			t.Fatal(err)
		}
		if p, vm, err := s.get(ctx, "ws-1"); err != nil || p != "" || vm != "" {
			t.Fatalf("after remove: %q, %q, %v", p, vm, err)
		}
		if ok, err := s.known(ctx, "vm-1"); err != nil || ok {
			t.Fatalf("known(vm-1) after remove = %v, %v", ok, err)
		}
	})
}

// The last_used step upgrades a table made before it: its rows read as
// long idle.
func TestStoreUpgrade(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		ctx := context.Background()
		loc := st.Loc(t)
		old, err := statedb.Open(ctx, loc, statedb.Schema{Component: schema.Component, Steps: schema.Steps[:1]})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := old.ExecContext(ctx, `INSERT INTO csb_sessions(workspace_id, principal, sandbox_id, created_at) VALUES('ws-1', 'alice', 'vm-1', 1)`); err != nil {
			t.Fatal(err)
		}
		old.Close()
		s, err := openStore(ctx, loc)
		if err != nil {
			t.Fatal(err)
		}
		defer s.close()
		if last, ok, err := s.lastUsed(ctx, "ws-1", "vm-1"); err != nil || !ok || last.UnixMilli() != 0 {
			t.Fatalf("lastUsed after the upgrade = %v, %v, %v", last, ok, err)
		}
	})
}
