package projects_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/projects"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

const key = "csb_v1_manager_test_0123456789"

// clock is a settable time source.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// newManager opens a Manager on a real SQLite file and the CodeSandbox
// provider against the fake.
func newManager(t *testing.T) (*projects.Manager, *csbfake.Server, *clock) {
	t.Helper()
	return newManagerOn(t, filepath.Join(t.TempDir(), "state.db"))
}

// newManagerOn is newManager on the store at loc.
func newManagerOn(t *testing.T, loc string) (*projects.Manager, *csbfake.Server, *clock) {
	t.Helper()
	fake := csbfake.New(t, key)
	p, err := codesandbox.NewProvider(codesandbox.ProviderOptions{API: codesandbox.Options{BaseURL: fake.URL(), APIKey: key}, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close(context.Background()) })
	clk := &clock{t: time.Now()}
	m, err := projects.Open(context.Background(), projects.Options{DBPath: loc, Provider: p, Now: clk.now, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return m, fake, clk
}

func TestOwnershipAndTTL(t *testing.T) { eachStore(t, testOwnershipAndTTL) }

func testOwnershipAndTTL(t *testing.T, loc func(testing.TB) string) {
	m, fake, clk := newManagerOn(t, loc(t))
	ctx := context.Background()
	rec, _, err := m.Create(ctx, "alice", projects.CreateRequest{ProjectName: "shop", Template: "react"})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Provider != "codesandbox" {
		t.Fatalf("record %+v", rec)
	}
	// Another principal: not found, and no request reaches the provider.
	fake.ResetRequests()
	if _, err := m.Get(ctx, "bob", rec.ID); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatalf("bob's Get: %v", err)
	}
	if list, _ := m.List(ctx, "bob"); len(list) != 0 {
		t.Fatalf("bob sees %+v", list)
	}
	if n := len(fake.Requests()); n != 0 {
		t.Fatalf("%d provider requests for a foreign sandbox", n)
	}
	if list, _ := m.List(ctx, "alice"); len(list) != 1 || list[0].ID != rec.ID {
		t.Fatalf("alice's list %+v", list)
	}

	// Before the TTL the reaper keeps it; after, it is shut down and deleted.
	clk.add(projects.TTL - time.Minute)
	m.Reap(ctx)
	if st, ok := fake.Sandbox(rec.ID); !ok || st.Deleted || !st.Running {
		t.Fatalf("reaped early: %+v", st)
	}
	clk.add(2 * time.Minute)
	if _, err := m.Get(ctx, "alice", rec.ID); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatalf("expired sandbox still usable: %v", err)
	}
	m.Reap(ctx)
	if st, ok := fake.Sandbox(rec.ID); ok && (!st.Deleted || st.Running) {
		t.Fatalf("after TTL: %+v", st)
	}
	if list, _ := m.List(ctx, "alice"); len(list) != 0 {
		t.Fatalf("list after TTL %+v", list)
	}
}

// TestClockSteppedBack: a sandbox created before the wall clock is
// stepped back (a day here) is not destroyed early, and still ends at most
// a TTL after the step rather than a TTL plus the step.
func TestClockSteppedBack(t *testing.T) { eachStore(t, testClockSteppedBack) }

func testClockSteppedBack(t *testing.T, loc func(testing.TB) string) {
	m, fake, clk := newManagerOn(t, loc(t))
	ctx := context.Background()
	rec, _, err := m.Create(ctx, "alice", projects.CreateRequest{ProjectName: "x", Template: "node"})
	if err != nil {
		t.Fatal(err)
	}
	clk.add(-24 * time.Hour)
	m.Reap(ctx)
	if _, err := m.Get(ctx, "alice", rec.ID); err != nil {
		t.Fatalf("the step ended a live sandbox: %v", err)
	}
	clk.add(projects.TTL + time.Second)
	m.Reap(ctx)
	if st, ok := fake.Sandbox(rec.ID); ok && !st.Deleted {
		t.Fatalf("a TTL after the step the sandbox lives on: %+v", st)
	}
}

func TestFailedDestroyIsRetried(t *testing.T) {
	m, fake, clk := newManager(t)
	ctx := context.Background()
	rec, _, err := m.Create(ctx, "alice", projects.CreateRequest{ProjectName: "x", Template: "node"})
	if err != nil {
		t.Fatal(err)
	}
	clk.add(projects.TTL + time.Second)
	fake.FailNext(500, 100) // every retry of this reap fails
	m.Reap(ctx)
	if st, ok := fake.Sandbox(rec.ID); !ok || st.Deleted {
		t.Fatalf("deleted despite failures: %+v", st)
	}
	fake.ClearFaults()
	m.Reap(ctx)
	if st, ok := fake.Sandbox(rec.ID); ok && !st.Deleted {
		t.Fatalf("not deleted on the second reap: %+v", st)
	}
}

func TestFilesValidation(t *testing.T) {
	lim := projects.FileLimits{MaxFiles: 2, MaxFileBytes: 4}
	for _, tc := range []struct {
		files map[string]string
		code  brokererr.Code
	}{
		{map[string]string{"a": "1", "b": "2", "c": "3"}, brokererr.InvalidInput},
		{map[string]string{"a": "12345"}, brokererr.FileSizeExceeded},
		{map[string]string{"../a": "1"}, brokererr.PathTraversal},
		{map[string]string{"x/node_modules/y": "1"}, brokererr.PathTraversal},
		{map[string]string{".CODESANDBOX/tasks.json": "1"}, brokererr.PathTraversal},
	} {
		if _, err := projects.Files(tc.files, lim); brokererr.CodeOf(err) != tc.code {
			t.Errorf("%v: %v, want %s", tc.files, err, tc.code)
		}
	}
	if out, err := projects.Files(map[string]string{"src/a.js": "1234"}, lim); err != nil || string(out["src/a.js"]) != "1234" {
		t.Fatalf("valid files: %v %v", out, err)
	}
}

func TestPerPrincipalCapHoldsUnderParallelCreates(t *testing.T) {
	eachStore(t, testPerPrincipalCapHoldsUnderParallelCreates)
}

func testPerPrincipalCapHoldsUnderParallelCreates(t *testing.T, loc func(testing.TB) string) {
	m, fake, _ := newManagerOn(t, loc(t))
	fake.SetLimits(csbfake.Limits{RequestsHourly: 10000, SandboxesHourly: 1000, ConcurrentVMs: 1000})
	const tries = projects.MaxPerPrincipal + 4
	var wg sync.WaitGroup
	errs := make(chan error, tries)
	for i := 0; i < tries; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _, err := m.Create(context.Background(), "alice", projects.CreateRequest{ProjectName: "p", Template: "node"})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	ok, refused := 0, 0
	for err := range errs {
		switch {
		case err == nil:
			ok++
		case brokererr.CodeOf(err) == brokererr.QuotaExceeded:
			refused++
		default:
			t.Errorf("unexpected: %v", err)
		}
	}
	if ok != projects.MaxPerPrincipal || refused != tries-projects.MaxPerPrincipal {
		t.Fatalf("%d created, %d refused", ok, refused)
	}
	// The refusal is retryable once the oldest sandbox expires.
	_, _, err := m.Create(context.Background(), "alice", projects.CreateRequest{ProjectName: "p", Template: "node"})
	if be := brokererr.As(err); be == nil || !be.Retryable || be.RetryAfter <= 0 || be.RetryAfter > projects.TTL {
		t.Fatalf("refusal %#v: want retryable after at most %s", be, projects.TTL)
	}
	// Another principal is not affected.
	if _, _, err := m.Create(context.Background(), "bob", projects.CreateRequest{ProjectName: "p", Template: "node"}); err != nil {
		t.Fatal(err)
	}
}

// Sweep deletes the provider's tagged sandboxes that have no row (here:
// forked behind the manager's back, as a crash before the insert leaves
// them) and spares those with a row, expired or not. The broker is
// restarted in between, so its provider holds nothing open.
func TestSweepDeletesSandboxesWithoutARow(t *testing.T) {
	eachStore(t, testSweepDeletesSandboxesWithoutARow)
}

func testSweepDeletesSandboxesWithoutARow(t *testing.T, loc func(testing.TB) string) {
	fake := csbfake.New(t, key)
	dbPath := loc(t)
	clk := &clock{t: time.Now()}
	open := func() (*projects.Manager, *codesandbox.Provider) {
		p, err := codesandbox.NewProvider(codesandbox.ProviderOptions{API: codesandbox.Options{BaseURL: fake.URL(), APIKey: key},
			SweepGrace: time.Nanosecond, Log: zerolog.Nop()})
		if err != nil {
			t.Fatal(err)
		}
		m, err := projects.Open(context.Background(), projects.Options{DBPath: dbPath, Provider: p, Now: clk.now, Log: zerolog.Nop()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close(context.Background()); _ = m.Close() })
		return m, p
	}
	ctx := context.Background()
	m, p := open()
	rec, _, err := m.Create(ctx, "alice", projects.CreateRequest{ProjectName: "shop", Template: "react"})
	if err != nil {
		t.Fatal(err)
	}
	orphan, err := p.Client().Fork(ctx, codesandbox.UniversalTemplate, codesandbox.ForkRequest{Tags: []string{"sandbox-broker"}})
	if err != nil {
		t.Fatal(err)
	}
	_ = p.Close(ctx)
	_ = m.Close()

	m, _ = open()
	clk.add(projects.TTL + time.Minute) // expired, not yet reaped: still Reap's
	m.Sweep(ctx)
	if st, _ := fake.Sandbox(orphan.ID); !st.Deleted {
		t.Fatalf("orphan kept: %+v", st)
	}
	if st, _ := fake.Sandbox(rec.ID); st.Deleted {
		t.Fatal("a sandbox with a row was swept")
	}
}

// eachStore runs fn once per store (a state.db file, a PostgreSQL
// database), handing it that store's location maker.
func eachStore(t *testing.T, fn func(t *testing.T, loc func(testing.TB) string)) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) { fn(t, st.Loc) })
}
