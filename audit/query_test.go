package audit

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestQueryFiltersAndPages(t *testing.T) { eachStore(t, testQueryFiltersAndPages) }

func testQueryFiltersAndPages(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	recs := fill(t, l, 40) // seqs 1..40; principal user-(i%3); outcomes on odd i
	ctx := context.Background()

	// Every row of user-1, newest first, in pages of 5 with no gap or repeat.
	var want []int64
	for i, r := range recs {
		if r.Principal == "user-1" {
			want = append(want, int64(i+1))
		}
	}
	var got []int64
	before := int64(0)
	for pages := 0; ; pages++ {
		if pages > 10 {
			t.Fatal("paging does not end")
		}
		p, err := Query(ctx, f.opts.Path, Filter{Principal: "user-1"}, before, 5)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range p.Entries {
			if e.Principal != "user-1" {
				t.Fatalf("seq %d has principal %q", e.Seq, e.Principal)
			}
			got = append(got, e.Seq)
		}
		if p.Before == 0 {
			break
		}
		before = p.Before
	}
	if len(got) != len(want) {
		t.Fatalf("got %d rows of user-1, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[len(want)-1-i] {
			t.Fatalf("row %d: seq %d, want %d (newest first)", i, got[i], want[len(want)-1-i])
		}
	}

	p, err := Query(ctx, f.opts.Path, Filter{Outcome: "failure", ErrorCode: "E_EXIT"}, 0, 100)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range p.Entries {
		if e.Outcome != OutcomeFailure || e.ErrorCode != "E_EXIT" {
			t.Fatalf("seq %d: %s %s", e.Seq, e.Outcome, e.ErrorCode)
		}
	}
	if len(p.Entries) != 4 { // i = 5, 15, 25, 35
		t.Fatalf("%d failures, want 4", len(p.Entries))
	}

	// A filter value is data, never SQL.
	p, err = Query(ctx, f.opts.Path, Filter{Tool: "x' OR '1'='1"}, 0, 100)
	if err != nil || len(p.Entries) != 0 {
		t.Fatalf("injected filter matched %d rows (%v)", len(p.Entries), err)
	}
}

func TestQueryTimeRange(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	fill(t, l, 30)
	ctx := context.Background()
	all, err := Query(ctx, f.opts.Path, Filter{}, 0, 100)
	if err != nil {
		t.Fatal(err)
	}
	byseq := map[int64]time.Time{}
	for _, e := range all.Entries {
		byseq[e.Seq] = e.Time
	}
	// Rows 10 ≤ seq < 20 by time; the clock steps 1 ms per row.
	p, err := Query(ctx, f.opts.Path, Filter{Since: byseq[10], Until: byseq[20]}, 0, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Entries) != 10 || p.Entries[0].Seq != 19 || p.Entries[9].Seq != 10 {
		t.Fatalf("time range gave %d rows %v", len(p.Entries), seqs(p.Entries))
	}
	// A range past the end, or before the start, is empty or everything.
	if p, _ := Query(ctx, f.opts.Path, Filter{Since: byseq[30].Add(time.Hour)}, 0, 100); len(p.Entries) != 0 {
		t.Fatalf("future range gave %v", seqs(p.Entries))
	}
	if p, _ := Query(ctx, f.opts.Path, Filter{Since: byseq[1].Add(-time.Hour)}, 0, 100); len(p.Entries) != 30 {
		t.Fatalf("open range gave %d rows", len(p.Entries))
	}
	var exported []int64
	if err := Each(ctx, f.opts.Path, Filter{AfterSeq: 25}, func(e Entry) error { exported = append(exported, e.Seq); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(exported) != 5 || exported[0] != 26 || exported[4] != 30 {
		t.Fatalf("export after 25 gave %v", exported)
	}
}

func seqs(es []Entry) []int64 {
	var out []int64
	for _, e := range es {
		out = append(out, e.Seq)
	}
	return out
}

func TestReadRowAndHead(t *testing.T) { eachStore(t, testReadRowAndHead) }

func testReadRowAndHead(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	l := f.open(t)
	fill(t, l, 6)
	if err := l.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	fill(t, l, 2)
	ctx := context.Background()
	row, call, err := ReadRow(ctx, f.opts.Path, 3) // call-1's intent; its outcome is seq 4
	if err != nil {
		t.Fatal(err)
	}
	if row.Seq != 3 || row.CallID != "call-1" || len(row.Leaf) != 64 || len(row.PrevMAC) != 64 || len(row.MAC) != 64 {
		t.Fatalf("row %+v", row)
	}
	if len(call) != 1 || call[0].Seq != 4 || call[0].Phase != PhaseOutcome {
		t.Fatalf("rows of the call: %+v", call)
	}
	if _, _, err := ReadRow(ctx, f.opts.Path, 99); !errors.Is(err, ErrNoRow) {
		t.Fatalf("missing row: %v", err)
	}
	h, err := ReadHead(ctx, f.opts.Path, f.opts.CheckpointPath, f.keys.Verifier)
	if err != nil {
		t.Fatal(err)
	}
	if h.LastSeq != 8 || h.Checkpoints != 1 || h.Checkpoint == nil || h.Checkpoint.Size != 6 || h.LastTime.IsZero() {
		t.Fatalf("head %+v", h)
	}
	l.Close() // writes a final checkpoint at 8
	h, err = ReadHead(ctx, f.opts.Path, f.opts.CheckpointPath, f.keys.Verifier)
	if err != nil || h.Checkpoint.Size != 8 || h.Checkpoints != 2 {
		t.Fatalf("head after close %+v %v", h, err)
	}
}

// TestFollowStreamsCommittedRowsAndResumes appends while a follower reads:
// it sees every matching row once, in order, and a second follower started
// from the last seq the first saw continues without a gap or a repeat.
func TestFollowStreamsCommittedRowsAndResumes(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	fill(t, l, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var mu sync.Mutex
	var seen []int64
	got := make(chan struct{}, 100)
	done := make(chan error, 1)
	go func() {
		done <- Follow(ctx, f.opts.Path, Filter{AfterSeq: 4}, 5*time.Millisecond, func(e Entry) error {
			mu.Lock()
			seen = append(seen, e.Seq)
			mu.Unlock()
			got <- struct{}{}
			return nil
		})
	}()
	for range 6 { // seqs 5..10, already there
		<-got
	}
	fill(t, l, 1500) // more than one batch, committed while it follows
	for range 1500 {
		select {
		case <-got:
		case <-time.After(30 * time.Second):
			t.Fatal("follower stalled")
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, s := range seen {
		if s != int64(i+5) {
			t.Fatalf("follower saw seq %d at position %d", s, i)
		}
	}

	// Resume from the last seq seen, filtered to one principal.
	last := seen[len(seen)-1] - 100
	ctx2, cancel2 := context.WithCancel(context.Background())
	var resumed []Entry
	err := Follow(ctx2, f.opts.Path, Filter{AfterSeq: last, Principal: "user-2"}, time.Millisecond, func(e Entry) error {
		resumed = append(resumed, e)
		if e.Seq >= seen[len(seen)-1]-2 {
			cancel2()
		}
		return nil
	})
	cancel2()
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range resumed {
		if e.Seq <= last || e.Principal != "user-2" || (i > 0 && e.Seq != resumed[i-1].Seq+3) {
			t.Fatalf("resumed row %d: seq %d principal %s", i, e.Seq, e.Principal)
		}
	}
	if len(resumed) < 30 {
		t.Fatalf("resumed only %d rows", len(resumed))
	}
}
