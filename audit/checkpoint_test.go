package audit

import (
	"context"
	"crypto/sha256"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

// parseFile reads back the checkpoint file with only the public key.
func parseFile(t *testing.T, f *fixture) []checkpoint {
	t.Helper()
	cps, problem, err := readCheckpoints(f.opts.CheckpointPath, f.keys.Verifier)
	if err != nil || problem != "" {
		t.Fatalf("readCheckpoints: %v %q", err, problem)
	}
	return cps
}

func sizes(cps []checkpoint) []int64 {
	var s []int64
	for _, c := range cps {
		s = append(s, c.Size)
	}
	return s
}

func TestCheckpointEveryNAndOnClose(t *testing.T) { eachStore(t, testCheckpointEveryNAndOnClose) }

func testCheckpointEveryNAndOnClose(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	f.opts.CheckpointEvery = 10
	l := f.open(t)
	fill(t, l, 25)
	if got := sizes(parseFile(t, f)); !equalInts(got, []int64{10, 20}) {
		t.Fatalf("before Close: sizes %v", got)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	cps := parseFile(t, f)
	if got := sizes(cps); !equalInts(got, []int64{10, 20, 25}) {
		t.Fatalf("after Close: sizes %v", got)
	}
	// Each root equals an independent tlog computation over the leaves.
	leaves := exportLeaves(t, f)
	for _, cp := range cps {
		if want := tlogRoot(t, leaves[:cp.Size]); cp.Root != want {
			t.Errorf("size %d: root mismatch", cp.Size)
		}
		text := string(cp.Msg)
		if !strings.HasPrefix(text, Origin+"\n") || !strings.Contains(text, "\n\n— "+KeyName+" ") {
			t.Errorf("unexpected note format:\n%s", text)
		}
		// The note verifies with the public key alone and fails with another.
		if _, err := note.Open(cp.Msg, note.VerifierList(f.keys.Verifier)); err != nil {
			t.Errorf("note.Open: %v", err)
		}
		other, _ := testKeys(t)
		if _, err := note.Open(cp.Msg, note.VerifierList(other.Verifier)); err == nil {
			t.Error("note verified with an unrelated key")
		}
	}
}

func TestCheckpointExplicitAndNoop(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	ctx := context.Background()
	if err := l.Checkpoint(ctx); err != nil { // empty log: nothing to sign
		t.Fatal(err)
	}
	if _, err := os.Stat(f.opts.CheckpointPath); !os.IsNotExist(err) {
		t.Fatalf("checkpoint file for an empty log: %v", err)
	}
	fill(t, l, 3)
	for range 2 {
		if err := l.Checkpoint(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := sizes(parseFile(t, f)); !equalInts(got, []int64{3}) {
		t.Fatalf("sizes %v", got)
	}
	l.Close()
	if got := sizes(parseFile(t, f)); !equalInts(got, []int64{3}) {
		t.Fatalf("Close re-signed an unchanged tree: %v", got)
	}
}

func TestCheckpointTimer(t *testing.T) {
	f := newFixture(t)
	tick := make(chan time.Time)
	done := make(chan error)
	f.opts.tick, f.opts.tickDone = tick, done
	l := f.open(t)
	fill(t, l, 4)
	tick <- time.Now()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := sizes(parseFile(t, f)); !equalInts(got, []int64{4}) {
		t.Fatalf("sizes %v", got)
	}
	fill(t, l, 1)
	tick <- time.Now()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := sizes(parseFile(t, f)); !equalInts(got, []int64{4, 5}) {
		t.Fatalf("sizes %v", got)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
}

// A checkpoint failure after a durable row is returned (fail closed) and
// surfaced by Ping until a checkpoint succeeds.
func TestCheckpointFailureSurfaces(t *testing.T) {
	f := newFixture(t)
	f.opts.CheckpointEvery = 2
	f.opts.CheckpointPath = t.TempDir() + "/missing-dir/cp"
	l := f.open(t)
	defer l.Close()
	ctx := context.Background()
	if _, err := l.Append(ctx, testRecord(0)); err != nil {
		t.Fatal(err)
	}
	seq, err := l.Append(ctx, testRecord(1))
	if err == nil || seq != 2 {
		t.Fatalf("Append: seq %d err %v", seq, err)
	}
	if err := l.Ping(ctx); err == nil {
		t.Fatal("Ping hid the checkpoint failure")
	}
	if err := os.MkdirAll(filepath.Dir(f.opts.CheckpointPath), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Ping(ctx); err != nil {
		t.Fatalf("Ping after recovery: %v", err)
	}
	if got := sizes(parseFile(t, f)); !equalInts(got, []int64{2}) {
		t.Fatalf("sizes %v", got)
	}
}

func TestOpenRefusesBadCheckpointFile(t *testing.T) {
	f := newFixture(t)
	if err := os.WriteFile(f.opts.CheckpointPath, []byte("garbage\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(context.Background(), f.opts); !errors.Is(err, ErrIntegrity) {
		t.Fatalf("Open: %v", err)
	}
}

func TestSplitNotes(t *testing.T) {
	f := newFixture(t)
	var msgs [][]byte
	for _, n := range []int64{1, 2, 3} {
		m, err := signCheckpoint(f.keys.Signer, n, tlog.Hash{byte(n)})
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
	}
	var file []byte
	for _, m := range msgs {
		file = append(append(file, m...), '\n')
	}
	got := splitNotes(file)
	if len(got) != 3 {
		t.Fatalf("got %d notes", len(got))
	}
	for i := range got {
		if string(got[i]) != string(msgs[i]) {
			t.Errorf("note %d:\n%q\nwant\n%q", i, got[i], msgs[i])
		}
	}
	// A torn final note parses as a separate, malformed note.
	torn := append(file, msgs[0][:len(msgs[0])/2]...)
	if n := len(splitNotes(torn)); n != 4 {
		t.Fatalf("torn file: %d notes", n)
	}
}

// compactRange (used by Verify) must agree with tlog.TreeHash (used when
// signing) at every size.
func TestCompactRangeMatchesTlog(t *testing.T) {
	var leaves []tlog.Hash
	var cr compactRange
	for i := range 300 {
		h := leafHash([]byte{byte(i), byte(i >> 8)})
		leaves = append(leaves, h)
		cr.append(h)
		if cr.root() != tlogRoot(t, leaves) {
			t.Fatalf("size %d: roots differ", i+1)
		}
	}
}

// tlogRoot computes an RFC 6962 root from leaf hashes with tlog alone.
func tlogRoot(t *testing.T, leaves []tlog.Hash) tlog.Hash {
	t.Helper()
	var stored []tlog.Hash
	r := tlog.HashReaderFunc(func(idx []int64) ([]tlog.Hash, error) {
		out := make([]tlog.Hash, len(idx))
		for i, x := range idx {
			out[i] = stored[x]
		}
		return out, nil
	})
	for i, l := range leaves {
		hs, err := tlog.StoredHashesForRecordHash(int64(i), l, r)
		if err != nil {
			t.Fatal(err)
		}
		stored = append(stored, hs...)
	}
	root, err := tlog.TreeHash(int64(len(leaves)), r)
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// exportLeaves recomputes leaves from what Export prints, independently of
// the leaf column.
func exportLeaves(t *testing.T, f *fixture) []tlog.Hash {
	t.Helper()
	db := rawDB(t, f.opts.Path)
	rows, err := db.Query(selectRow + " ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []tlog.Hash
	for rows.Next() {
		r, err := scanRow(rows)
		if err != nil {
			t.Fatal(err)
		}
		body, err := bodyFor(r.V, r.Seq, r.TS, r.KeyID, r.Rec)
		if err != nil {
			t.Fatal(err)
		}
		b, err := marshalBody(body)
		if err != nil {
			t.Fatal(err)
		}
		// RFC 6962 leaf, spelled out.
		out = append(out, sha256.Sum256(append([]byte{0}, b...)))
	}
	return out
}

func equalInts(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
