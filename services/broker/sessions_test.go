package broker

import (
	"context"
	"errors"
	"net/http/httptest"
	"path/filepath"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/mcpsessions"
)

// The transport's own check of a request's session is answered from
// bindSessions' check of that ID only: any other ID, and the transport's
// calls without a request, go to the store.
func TestSessionManagersAnswerOnlyTheCheckedID(t *testing.T) {
	ctx := context.Background()
	store, err := mcpsessions.Open(ctx, filepath.Join(t.TempDir(), "state.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	live := store.Generate()
	if err := store.Bind(ctx, live, "alice"); err != nil {
		t.Fatal(err)
	}
	m := sessionManagers{store}
	const checked = "mcp-session-checked-in-this-request" // not in the store
	r := httptest.NewRequest("POST", "/mcp", nil)
	r = r.WithContext(context.WithValue(r.Context(), checkedSessionKey{}, checked))
	for _, c := range []struct {
		name    string
		mgr     interface{ Validate(string) (bool, error) }
		id      string
		missing bool
	}{
		{"checked ID", m.ResolveSessionIdManager(r), checked, false},
		{"another ID on the checked request", m.ResolveSessionIdManager(r), "mcp-session-other", true},
		{"a live ID on the checked request", m.ResolveSessionIdManager(r), live, false},
		{"unchecked request", m.ResolveSessionIdManager(httptest.NewRequest("POST", "/mcp", nil)), checked, true},
		{"no request (the idle sweeper)", m.ResolveSessionIdManager(nil), checked, true},
		{"no request, live ID", m.ResolveSessionIdManager(nil), live, false},
	} {
		terminated, err := c.mgr.Validate(c.id)
		if terminated || errors.Is(err, mcpsessions.ErrNotFound) != c.missing || (!c.missing && err != nil) {
			t.Errorf("%s: Validate(%q) = %v, %v; want missing %v", c.name, c.id, terminated, err, c.missing)
		}
	}
	// Terminate still reaches the store through a checked request's manager.
	if _, err := m.ResolveSessionIdManager(r).Terminate(live); err != nil {
		t.Fatal(err)
	}
	if terminated, err := store.Validate(live); err != nil || !terminated {
		t.Fatalf("after Terminate: %v, %v", terminated, err)
	}
}
