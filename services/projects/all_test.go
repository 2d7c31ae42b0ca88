package projects_test

import (
	"context"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/projects"
)

// TestAllListsEveryPrincipalsSandboxes: the operator view sees every
// live sandbox with its owner, and not expired ones.
func TestAllListsEveryPrincipalsSandboxes(t *testing.T) {
	m, _, clk := newManager(t)
	ctx := context.Background()
	a, _, err := m.Create(ctx, "alice", projects.CreateRequest{ProjectName: "a", Template: "node"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Create(ctx, "bob", projects.CreateRequest{ProjectName: "b", Template: "node"}); err != nil {
		t.Fatal(err)
	}
	all, err := m.All(ctx, 10)
	if err != nil || len(all) != 2 {
		t.Fatalf("all %+v %v", all, err)
	}
	owners := map[string]string{}
	for _, o := range all {
		owners[o.ProjectName] = o.Principal
	}
	if owners["a"] != "alice" || owners["b"] != "bob" {
		t.Fatalf("owners %v", owners)
	}
	clk.add(2 * time.Hour)
	if all, _ := m.All(ctx, 10); len(all) != 0 {
		t.Fatalf("expired sandboxes listed: %+v (alice's was %s)", all, a.ID)
	}
}
