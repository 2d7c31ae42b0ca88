package hosted

import (
	"context"
	"testing"

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
		if err := s.put(ctx, "ws-1", "alice", "vm-1"); err != nil {
			t.Fatal(err)
		}
		if err := s.put(ctx, "ws-2", "bob", "vm-1"); err == nil {
			t.Fatal("a second workspace took vm-1")
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
