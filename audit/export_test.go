package audit

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"os"
	"strings"
	"testing"
)

func jsonLines(t *testing.T, out []byte) []Entry {
	t.Helper()
	var es []Entry
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var raw map[string]json.RawMessage
		if err := json.Unmarshal(sc.Bytes(), &raw); err != nil {
			t.Fatalf("invalid JSON line %q: %v", sc.Text(), err)
		}
		for _, k := range []string{"seq", "ts", "call_id", "phase", "principal", "tool", "params", "outcome", "error_code", "duration_ms", "kid", "mac"} {
			if _, ok := raw[k]; !ok {
				t.Fatalf("line %q lacks %q", sc.Text(), k)
			}
		}
		var e Entry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatal(err)
		}
		es = append(es, e)
	}
	return es
}

func TestTailAndExport(t *testing.T) { eachStore(t, testTailAndExport) }

func testTailAndExport(t *testing.T, newFixture func(testing.TB) *fixture) {
	f := newFixture(t)
	l := f.open(t)
	fill(t, l, 12)
	ctx := context.Background()

	// Readers work while the writer is open.
	var tail bytes.Buffer
	if err := Tail(ctx, f.opts.Path, 5, &tail); err != nil {
		t.Fatal(err)
	}
	l.Close()
	es := jsonLines(t, tail.Bytes())
	if len(es) != 5 {
		t.Fatalf("tail: %d entries", len(es))
	}
	for i, e := range es {
		if e.Seq != int64(8+i) {
			t.Errorf("tail %d: seq %d", i, e.Seq)
		}
	}

	var all bytes.Buffer
	if err := Export(ctx, f.opts.Path, "jsonl", &all); err != nil {
		t.Fatal(err)
	}
	es = jsonLines(t, all.Bytes())
	if len(es) != 12 {
		t.Fatalf("export: %d entries", len(es))
	}
	for i, e := range es {
		if e.Seq != int64(i+1) {
			t.Errorf("export %d: seq %d", i, e.Seq)
		}
		if i > 0 && e.Time.Before(es[i-1].Time) {
			t.Errorf("export %d: time went backwards", i)
		}
	}

	// Tail larger than the log prints everything.
	var big bytes.Buffer
	if err := Tail(ctx, f.opts.Path, 100, &big); err != nil {
		t.Fatal(err)
	}
	if big.String() != all.String() {
		t.Error("Tail(100) differs from Export")
	}

	// The HMAC key never appears, in any encoding.
	k := f.keys.HMACKey
	for _, enc := range []string{string(k), hex.EncodeToString(k), base64.StdEncoding.EncodeToString(k), base64.RawStdEncoding.EncodeToString(k)} {
		if strings.Contains(all.String(), enc) {
			t.Fatal("export contains the HMAC key")
		}
	}
}

func TestExportErrors(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	fill(t, l, 1)
	l.Close()
	ctx := context.Background()
	var buf bytes.Buffer
	if err := Export(ctx, f.opts.Path, "csv", &buf); err == nil {
		t.Error("unknown format accepted")
	}
	if err := Tail(ctx, f.opts.Path, 0, &buf); err == nil {
		t.Error("Tail(0) accepted")
	}
	missing := f.opts.Path + ".nope"
	if err := Export(ctx, missing, "jsonl", &buf); err == nil {
		t.Error("Export of a missing DB succeeded")
	}
	if _, err := os.Stat(missing); !os.IsNotExist(err) {
		t.Errorf("Export created %s", missing)
	}
	if buf.Len() != 0 {
		t.Errorf("output on error: %q", buf.String())
	}
}

// Readers never write: a read-only DB file is still readable, and the file
// is unchanged afterwards.
func TestReadersAreReadOnly(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	fill(t, l, 3)
	l.Close()
	before, err := os.ReadFile(f.opts.Path)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var buf bytes.Buffer
	if err := Export(ctx, f.opts.Path, "jsonl", &buf); err != nil {
		t.Fatal(err)
	}
	if rep := f.verify(t); !rep.OK {
		t.Fatalf("Verify: %+v", rep)
	}
	after, err := os.ReadFile(f.opts.Path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("readers modified the database file")
	}
	db, _, err := openReader(ctx, f.opts.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, "CREATE TABLE x(y)"); err == nil {
		t.Fatal("read-only connection accepted a write")
	}
}
