package uids

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

func open(t *testing.T, path string, first, size int) *Allocator {
	t.Helper()
	a, err := Open(context.Background(), path, first, size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

func lease(t *testing.T, a *Allocator, owner string) int {
	t.Helper()
	uid, err := a.Lease(context.Background(), owner)
	if err != nil {
		t.Fatalf("Lease(%s): %v", owner, err)
	}
	return uid
}

// No two live owners ever hold the same uid, however many lease at once
// through two allocators (two brokers) on one file.
func TestConcurrentLeasesAreDistinct(t *testing.T) { eachStore(t, testConcurrentLeasesAreDistinct) }

func testConcurrentLeasesAreDistinct(t *testing.T, dbPath func(testing.TB) string) {
	path := dbPath(t)
	as := []*Allocator{open(t, path, 5000, 1000), open(t, path, 5000, 1000)}
	const n = 200
	got := make([]int, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			uid, err := as[i%2].Lease(context.Background(), fmt.Sprintf("ws%03d", i))
			if err != nil {
				errs <- err
				return
			}
			got[i] = uid
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	seen := map[int]int{}
	for i, uid := range got {
		if uid < 5000 || uid >= 6000 {
			t.Fatalf("uid %d outside the range", uid)
		}
		if j, dup := seen[uid]; dup {
			t.Fatalf("ws%03d and ws%03d share uid %d", j, i, uid)
		}
		seen[uid] = i
	}
	// An owner keeps its uid, also after a restart.
	b := open(t, path, 5000, 1000)
	for i := range n {
		if uid := lease(t, b, fmt.Sprintf("ws%03d", i)); uid != got[i] {
			t.Fatalf("ws%03d: %d, then %d", i, got[i], uid)
		}
	}
}

// A freed uid is the last to come back; a full range refuses clearly and
// recovers when a uid is freed.
func TestRotationAndExhaustion(t *testing.T) { eachStore(t, testRotationAndExhaustion) }

func testRotationAndExhaustion(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	a := open(t, dbPath(t), 100, 3)
	first := lease(t, a, "a")
	if first < 100 || first > 102 {
		t.Fatalf("first uid %d outside 100..102", first)
	}
	after := func(u, k int) int { return 100 + (u-100+k)%3 } // k places on, wrapping
	if u := lease(t, a, "b"); u != after(first, 1) {
		t.Fatalf("b got %d, want %d", u, after(first, 1))
	}
	if err := a.Free(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if u := lease(t, a, "c"); u != after(first, 2) {
		t.Fatalf("c got %d, want %d (%d was just freed)", u, after(first, 2), first)
	}
	if u := lease(t, a, "d"); u != first {
		t.Fatalf("d got %d, want %d after wrapping", u, first)
	}
	_, err := a.Lease(ctx, "e")
	if e := brokererr.As(err); e == nil || e.Code != brokererr.Unavailable {
		t.Fatalf("full range: %v", err)
	}
	if err := a.Free(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if u := lease(t, a, "e"); u != after(first, 1) {
		t.Fatalf("e got %d, want %d", u, after(first, 1))
	}
}

// New databases start their rotation at a random point, so brokers given
// overlapping ranges by mistake (or parallel test runs) rarely share a uid.
func TestNewDatabasesStartAtRandomPoints(t *testing.T) {
	firsts := map[int]bool{}
	for i := range 20 {
		a := open(t, filepath.Join(t.TempDir(), fmt.Sprintf("state%d.db", i)), 1_900_000_000, 65536)
		firsts[lease(t, a, "ws")] = true
	}
	if len(firsts) < 2 { // all 20 equal by chance: probability 65536^-19
		t.Fatalf("20 new databases all started at the same uid: %v", firsts)
	}
}

// A warm container's pool key hands its uid to the workspace that claims
// it, freeing the workspace's old one; pool keys are freed by prefix.
func TestMoveAndFreePrefix(t *testing.T) { eachStore(t, testMoveAndFreePrefix) }

func testMoveAndFreePrefix(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	a := open(t, dbPath(t), 100, 10)
	p1, p2 := lease(t, a, "pool:/r:1"), lease(t, a, "pool:/r:2")
	old := lease(t, a, "ws")
	other := lease(t, a, "pool:/other:1")
	uid, err := a.Move(ctx, "pool:/r:1", "ws")
	if err != nil || uid != p1 {
		t.Fatalf("Move: %d %v, want %d", uid, err, p1)
	}
	if u := lease(t, a, "ws"); u != p1 {
		t.Fatalf("ws holds %d after the move, want %d", u, p1)
	}
	if _, err := a.Move(ctx, "pool:/r:1", "ws2"); err == nil {
		t.Fatal("moved a key that holds nothing")
	}
	if err := a.FreePrefix(ctx, "pool:/r:"); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := a.db.QueryRowContext(ctx, `SELECT count(*) FROM sandbox_uids WHERE uid IN (?1, ?2)`, p2, old).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d of the freed uids still leased (%v)", n, err)
	}
	if u := lease(t, a, "pool:/other:1"); u != other {
		t.Fatalf("another root's pool key lost its uid: %d, want %d", u, other)
	}
}

// A uid leased under an older range is replaced by one in the current range.
func TestRangeChange(t *testing.T) { eachStore(t, testRangeChange) }

func testRangeChange(t *testing.T, dbPath func(testing.TB) string) {
	path := dbPath(t)
	if u := lease(t, open(t, path, 100, 10), "ws"); u < 100 || u >= 110 {
		t.Fatalf("got %d", u)
	}
	if u := lease(t, open(t, path, 500, 10), "ws"); u < 500 || u >= 510 {
		t.Fatalf("after the range moved: %d, want one in 500..509", u)
	}
	for _, r := range [][2]int{{0, 10}, {1, 0}, {MaxID, 2}} {
		if _, err := Open(context.Background(), path, r[0], r[1]); err == nil {
			t.Errorf("range %d+%d accepted", r[0], r[1])
		}
	}
}

// eachStore runs fn once per store (a state.db file, a PostgreSQL
// database), handing it that store's location maker.
func eachStore(t *testing.T, fn func(t *testing.T, loc func(testing.TB) string)) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) { fn(t, st.Loc) })
}
