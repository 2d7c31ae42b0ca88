package audit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func TestAppendRoundTrip(t *testing.T) { eachStore(t, testAppendRoundTrip) }

func testAppendRoundTrip(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	l := f.open(t)
	want := fill(t, l, 7)
	if err := l.Ping(context.Background()); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	var buf bytes.Buffer
	if err := Export(context.Background(), f.opts.Path, "jsonl", &buf); err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(&buf)
	for i, w := range want {
		var e Entry
		if err := dec.Decode(&e); err != nil {
			t.Fatalf("entry %d: %v", i, err)
		}
		if e.Seq != int64(i+1) {
			t.Errorf("entry %d: seq %d", i, e.Seq)
		}
		if e.KeyID != f.keys.KeyID || len(e.MAC) != 64 {
			t.Errorf("entry %d: kid %q mac %q", i, e.KeyID, e.MAC)
		}
		e.Params = compactJSON(t, e.Params)
		if !recordsEqual(e.Record, w) {
			t.Errorf("entry %d: got %+v want %+v", i, e.Record, w)
		}
		if e.Time.IsZero() || e.Time.Location() != time.UTC {
			t.Errorf("entry %d: time %v", i, e.Time)
		}
	}
	if dec.More() {
		t.Error("extra entries")
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != 7 || rep.Checkpoints != 1 {
		t.Fatalf("Verify: %+v", rep)
	}
}

func compactJSON(t testing.TB, b []byte) json.RawMessage {
	t.Helper()
	var c bytes.Buffer
	if err := json.Compact(&c, b); err != nil {
		t.Fatal(err)
	}
	return c.Bytes()
}

func recordsEqual(a, b Record) bool {
	return a.CallID == b.CallID && a.Phase == b.Phase && a.Principal == b.Principal &&
		a.Tool == b.Tool && bytes.Equal(a.Params, b.Params) && a.Outcome == b.Outcome &&
		a.ErrorCode == b.ErrorCode && a.DurationMS == b.DurationMS && a.Source == b.Source
}

func TestAppendConcurrent(t *testing.T) { eachStore(t, testAppendConcurrent) }

func testAppendConcurrent(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	f.opts.CheckpointEvery = 128
	l := f.open(t)
	const workers, each = 8, 200
	var wg sync.WaitGroup
	seqs := make(chan int64, workers*each)
	errs := make(chan error, workers*each)
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				seq, err := l.Append(context.Background(), testRecord(w*each+i))
				if err != nil {
					errs <- err
					return
				}
				seqs <- seq
			}
		})
	}
	wg.Wait()
	close(seqs)
	close(errs)
	for err := range errs {
		t.Fatalf("Append: %v", err)
	}
	seen := make(map[int64]bool)
	for s := range seqs {
		if seen[s] || s < 1 || s > workers*each {
			t.Fatalf("bad or duplicate seq %d", s)
		}
		seen[s] = true
	}
	if len(seen) != workers*each {
		t.Fatalf("got %d seqs", len(seen))
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	rep := f.verify(t)
	// 1600 rows: checkpoints at every 128 (12 of them) plus Close at 1600.
	if !rep.OK || rep.Rows != workers*each || rep.Checkpoints != 13 {
		t.Fatalf("Verify: %+v", rep)
	}
}

func TestAppendRejectsInvalid(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	bad := []Record{
		{Phase: "bogus"},
		{Phase: PhaseIntent, Outcome: OutcomeSuccess},
		{Phase: PhaseOutcome},
		{Phase: PhaseOutcome, Outcome: "maybe"},
		{Phase: PhaseIntent, Params: json.RawMessage(`{"a":`)},
		{Phase: PhaseIntent, Params: json.RawMessage("\"\xff\"")},
		{Phase: PhaseIntent, DurationMS: -1},
	}
	for i, r := range bad {
		if _, err := l.Append(context.Background(), r); !errors.Is(err, errInvalidRecord) {
			t.Errorf("record %d: err %v, want errInvalidRecord", i, err)
		}
	}
	// A rejected call may be logged as a single outcome row.
	seq, err := l.Append(context.Background(), Record{CallID: "c", Phase: PhaseOutcome, Outcome: OutcomeDenied, ErrorCode: "E_POLICY"})
	if err != nil || seq != 1 {
		t.Fatalf("denied row: seq %d err %v", seq, err)
	}
}

func TestTimestampsNeverGoBackwards(t *testing.T) { eachStore(t, testTimestampsNeverGoBackwards) }

func testTimestampsNeverGoBackwards(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	times := []time.Time{base.Add(time.Hour), base, base.Add(2 * time.Hour)}
	i := 0
	f.opts.Now = func() time.Time { i++; return times[i-1] }
	l := f.open(t)
	fill(t, l, 3)
	l.Close()
	var buf bytes.Buffer
	if err := Export(context.Background(), f.opts.Path, "jsonl", &buf); err != nil {
		t.Fatal(err)
	}
	var got []time.Time
	for dec := json.NewDecoder(&buf); dec.More(); {
		var e Entry
		if err := dec.Decode(&e); err != nil {
			t.Fatal(err)
		}
		got = append(got, e.Time)
	}
	want := []time.Time{times[0], times[0], times[2]}
	for j := range want {
		if !got[j].Equal(want[j]) {
			t.Errorf("row %d: ts %v want %v", j+1, got[j], want[j])
		}
	}
}

// TestTimestampsHoldAcrossReopenWithClockBehind: a log reopened by a
// broker whose clock was stepped back a day writes rows stamped no earlier
// than the last one, and verifies.
func TestTimestampsHoldAcrossReopenWithClockBehind(t *testing.T) {
	f := newFixture(t)
	base := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	f.opts.Now = func() time.Time { return base }
	l := f.open(t)
	fill(t, l, 2)
	l.Close()
	f.opts.Now = func() time.Time { return base.Add(-24 * time.Hour) }
	l = f.open(t)
	fill(t, l, 2)
	l.Close()
	var buf bytes.Buffer
	if err := Export(context.Background(), f.opts.Path, "jsonl", &buf); err != nil {
		t.Fatal(err)
	}
	for dec := json.NewDecoder(&buf); dec.More(); {
		var e Entry
		if err := dec.Decode(&e); err != nil {
			t.Fatal(err)
		}
		if !e.Time.Equal(base) {
			t.Errorf("row %d: ts %v, want %v", e.Seq, e.Time, base)
		}
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != 4 {
		t.Fatalf("Verify: %+v", rep)
	}
}

func TestClosedLog(t *testing.T) { eachStore(t, testClosedLog) }

func testClosedLog(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	l := f.open(t)
	fill(t, l, 1)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := l.Append(context.Background(), testRecord(0)); !errors.Is(err, ErrClosed) {
		t.Errorf("Append after Close: %v", err)
	}
	if err := l.Ping(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Ping after Close: %v", err)
	}
	if err := l.Checkpoint(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Checkpoint after Close: %v", err)
	}
}

func TestReopenContinuesChain(t *testing.T) { eachStore(t, testReopenContinuesChain) }

func testReopenContinuesChain(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	l := f.open(t)
	fill(t, l, 5)
	l.Close()
	l = f.open(t)
	seq, err := l.Append(context.Background(), testRecord(5))
	if err != nil || seq != 6 {
		t.Fatalf("Append after reopen: seq %d err %v", seq, err)
	}
	l.Close()
	if rep := f.verify(t); !rep.OK || rep.Rows != 6 || rep.Checkpoints != 2 {
		t.Fatalf("Verify: %+v", rep)
	}
}

func TestFileModes(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	fill(t, l, 1)
	if err := l.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{f.opts.Path, f.opts.Path + "-wal", f.opts.Path + "-shm", f.opts.CheckpointPath} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %o", p, st.Mode().Perm())
		}
	}
	l.Close()
}

func TestAppendHonoursContext(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	l.sem <- struct{}{} // hold the writer lock
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := l.Append(ctx, testRecord(0))
	l.unlock()
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Append with cancelled ctx: %v", err)
	}
}

// Characters that mean something in a URI must not change which file is
// opened or add parameters.
func TestAwkwardPath(t *testing.T) {
	f := newFixture(t)
	dir := filepath.Join(t.TempDir(), "we?ird #dir%20&mode=memory")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	f.opts.Path = filepath.Join(dir, "a?b.db")
	f.opts.CheckpointPath = filepath.Join(dir, "cp")
	l := f.open(t)
	fill(t, l, 2)
	l.Close()
	if _, err := os.Stat(f.opts.Path); err != nil {
		t.Fatalf("database not at the given path: %v", err)
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != 2 {
		t.Fatalf("Verify: %+v", rep)
	}
}
