package jobs

import (
	"context"
	"testing"
)

// TestAllListsEveryPrincipalsJobs: the operator view's list has every
// principal's jobs with their owner, filtered by status.
func TestAllListsEveryPrincipalsJobs(t *testing.T) {
	m := openTest(t, t.TempDir(), nil)
	ctx := context.Background()
	live := start(t, m, "alice", "s1", "sleep 30", false)
	done := start(t, m, "bob", "s2", "echo hi", false)
	readAll(t, m, "bob", done)
	running, err := m.All(ctx, StatusRunning, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(running) != 1 || running[0].Principal != "alice" || running[0].ID != live || running[0].Command != "sleep 30" {
		t.Fatalf("running %+v", running)
	}
	all, err := m.All(ctx, "", 10)
	if err != nil || len(all) != 2 {
		t.Fatalf("all %+v %v", all, err)
	}
	owners := map[string]string{}
	for _, j := range all {
		owners[j.ID] = j.Principal
	}
	if owners[live] != "alice" || owners[done] != "bob" {
		t.Fatalf("owners %v", owners)
	}
	if _, err := m.Cancel(ctx, "alice", live, true); err != nil {
		t.Fatal(err)
	}
}
