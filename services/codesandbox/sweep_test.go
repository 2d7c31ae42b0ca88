package codesandbox

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
)

func TestSweepDeletesOnlyUnknownTaggedSandboxes(t *testing.T) {
	f := newFake(t)
	var log logBuf
	p := newProvider(t, f, &log, func(o *ProviderOptions) { o.SweepGrace = time.Nanosecond })
	cx := ctx(t)
	c := p.Client()
	fork := func(tags ...string) string {
		t.Helper()
		fr, err := c.Fork(cx, UniversalTemplate, ForkRequest{Tags: tags})
		if err != nil {
			t.Fatal(err)
		}
		return fr.ID
	}
	// More orphans than one page holds, so the sweep pages through them.
	var orphans []string
	for range sweepPageSize + 5 {
		orphans = append(orphans, fork("sandbox-broker"))
	}
	if _, err := c.Start(cx, orphans[0], StartOptions{}); err != nil { // a running orphan is shut down too
		t.Fatal(err)
	}
	knownID := fork("sandbox-broker", "sandbox-broker-template-react")
	foreign := fork("someone-else")
	otherBroker := fork("sandbox-broker-2")
	held, err := p.Create(cx, projects.CreateRequest{ProjectName: "live", Template: "react"}) // open in this provider
	if err != nil {
		t.Fatal(err)
	}
	known := func(_ context.Context, id string) (bool, error) { return id == knownID, nil }

	// A failing lookup deletes nothing.
	if _, err := p.Sweep(cx, func(context.Context, string) (bool, error) { return false, errors.New("db down") }); err == nil {
		t.Fatal("sweep went on without knowing")
	}
	// Young sandboxes are spared.
	young := newProvider(t, f, nil, func(o *ProviderOptions) { o.SweepGrace = time.Hour })
	if n, err := young.Sweep(cx, known); err != nil || n != 0 {
		t.Fatalf("young: %d %v", n, err)
	}
	for _, id := range orphans {
		if st, _ := f.Sandbox(id); st.Deleted {
			t.Fatalf("%s deleted early", id)
		}
	}

	n, err := p.Sweep(cx, known)
	if err != nil || n != len(orphans) {
		t.Fatalf("swept %d, want %d: %v", n, len(orphans), err)
	}
	for _, id := range orphans {
		if st, _ := f.Sandbox(id); !st.Deleted || st.Running {
			t.Fatalf("orphan %s left: %+v", id, st)
		}
	}
	for what, id := range map[string]string{"known": knownID, "foreign": foreign, "other tag": otherBroker, "held": held.ID()} {
		if st, _ := f.Sandbox(id); st.Deleted {
			t.Fatalf("%s sandbox %s deleted", what, id)
		}
	}
	if n, err := p.Sweep(cx, known); err != nil || n != 0 {
		t.Fatalf("second sweep: %d %v", n, err)
	}
	if !strings.Contains(log.String(), "codesandbox_orphan_deleted") {
		t.Fatal("no codesandbox_orphan_deleted event")
	}
	f.FailNext(500, 10)
	_, err = p.Sweep(cx, known)
	wantCode(t, err, brokererr.Unavailable)
}
