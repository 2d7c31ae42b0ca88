package audit

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
)

// FuzzAppendVerify appends records built from fuzzed strings and checks the
// log still verifies and the canonical body round-trips exactly.
func FuzzAppendVerify(f *testing.F) {
	f.Add("alice", "run_command", "echo hi", "E_X")
	f.Add("", "", "", "")
	f.Add("bob\x00", "tool\xff\xfe", "<script>&amp;\u2028", "\"quoted\\\"")
	f.Add("😀 émoji", "a\nb\tc", `{"nested":"json"}`, "\u0000\u001f")
	f.Fuzz(func(t *testing.T, principal, tool, param, code string) {
		fx := newFixture(t)
		fx.opts.CheckpointEvery = 2
		l := fx.open(t)
		ctx := context.Background()
		pj, err := json.Marshal(map[string]string{"v": param, param: tool})
		if err != nil {
			t.Fatal(err)
		}
		src := Source{Transport: "http", ClientAddr: code, UserAgent: param + principal, MCPSession: tool, Toolset: principal}
		recs := []Record{
			{CallID: param, Phase: PhaseIntent, Principal: principal, Tool: tool, Params: pj, Source: src},
			{CallID: param, Phase: PhaseOutcome, Principal: principal, Tool: tool, Params: pj, Outcome: OutcomeFailure, ErrorCode: code, DurationMS: int64(len(param))},
			{CallID: code, Phase: PhaseOutcome, Principal: tool, Tool: principal, Outcome: OutcomeDenied},
		}
		for _, r := range recs {
			if _, err := l.Append(ctx, r); err != nil {
				t.Fatalf("Append: %v", err)
			}
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		if rep := fx.verify(t); !rep.OK || rep.Rows != 3 {
			t.Fatalf("Verify: %+v", rep)
		}

		// Stored columns equal the normalised input, and the body built from
		// them decodes to the same fields and re-encodes to the same bytes.
		rows, err := rawDB(t, fx.opts.Path).Query(selectRow + " ORDER BY seq")
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		i := 0
		for rows.Next() {
			r, err := scanRow(rows)
			if err != nil {
				t.Fatal(err)
			}
			want, _ := normalise(recs[i])
			if !recordsEqual(r.Rec, want) {
				t.Fatalf("row %d stored %+v, want %+v", i+1, r.Rec, want)
			}
			if r.V != bodyVersion {
				t.Fatalf("row %d: body version %d", i+1, r.V)
			}
			body, err := bodyFor(r.V, r.Seq, r.TS, r.KeyID, r.Rec)
			if err != nil {
				t.Fatal(err)
			}
			b := body.(bodyV2)
			enc, err := marshalBody(b)
			if err != nil {
				t.Fatal(err)
			}
			if got := leafHash(enc); !bytes.Equal(got[:], r.Leaf) {
				t.Fatalf("row %d: leaf differs from body", i+1)
			}
			var back bodyV2
			if err := json.Unmarshal(enc, &back); err != nil {
				t.Fatal(err)
			}
			if back.Principal != b.Principal || back.Tool != b.Tool || back.CallID != b.CallID ||
				back.ErrorCode != b.ErrorCode || !bytes.Equal(back.Params, b.Params) || back.Seq != b.Seq || back.TS != b.TS ||
				back.UserAgent != b.UserAgent || back.ClientAddr != b.ClientAddr || back.MCPSession != b.MCPSession || back.Toolset != b.Toolset {
				t.Fatalf("row %d: body does not round-trip: %s", i+1, enc)
			}
			again, err := marshalBody(back)
			if err != nil || !bytes.Equal(again, enc) {
				t.Fatalf("row %d: re-encoding differs: %s vs %s", i+1, again, enc)
			}
			i++
		}
		if err := rows.Err(); err != nil || i != 3 {
			t.Fatalf("rows: %d %v", i, err)
		}
	})
}

// BenchmarkAppend is one audit row on each store (SQLite with
// synchronous=FULL; PostgreSQL on loopback, under the advisory lock).
func BenchmarkAppend(b *testing.B) {
	b.Run("sqlite", func(b *testing.B) { benchmarkAppend(b, newFixture(b)) })
	b.Run("postgres", func(b *testing.B) { benchmarkAppend(b, newPostgresFixture(b)) })
}

func benchmarkAppend(b *testing.B, f *fixture) {
	f.opts.CheckpointEvery = 256
	l := f.open(b)
	defer l.Close()
	ctx := context.Background()
	r := testRecord(1)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := l.Append(ctx, r); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAppendParallel is 8 callers appending intent rows at once:
// group commit gives each batch one fsync (rows/tx: rows per transaction).
func BenchmarkAppendParallel(b *testing.B) {
	f := newFixture(b)
	f.opts.CheckpointEvery = 256
	l := f.open(b)
	defer l.Close()
	ctx := context.Background()
	r := testRecord(0)
	b.ReportAllocs()
	b.SetParallelism(4) // 8 callers on 2 cores
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := l.Append(ctx, r); err != nil {
				b.Error(err)
				return
			}
		}
	})
	l.sem <- struct{}{}
	if l.batches > 0 {
		b.ReportMetric(float64(b.N)/float64(l.batches), "rows/tx")
	}
	l.unlock()
}
