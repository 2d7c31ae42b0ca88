package quota

import (
	"context"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// BenchmarkAllowCall measures the per-tool-call cost: one locked
// read-decide-upsert-commit, on a real WAL file (BEGIN IMMEDIATE) and on
// PostgreSQL over loopback (the advisory lock).
func BenchmarkAllowCall(b *testing.B) {
	statedbtest.Run(b, func(b *testing.B, st statedbtest.Store) { benchmarkAllowCall(b, st.Loc(b)) })
}

func benchmarkAllowCall(b *testing.B, loc string) {
	ctx := context.Background()
	c := newClock(t0)
	s := openStore(b, loc, c)
	l := Limits{CallsPerMinute: 1 << 30}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if i%1000 == 0 {
			c.Add(time.Second) // cross windows now and then, as real traffic does
		}
		if _, err := s.AllowCall(ctx, "bench", l); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAllowCallParallel(b *testing.B) {
	statedbtest.Run(b, func(b *testing.B, st statedbtest.Store) { benchmarkAllowCallParallel(b, st.Loc(b)) })
}

func benchmarkAllowCallParallel(b *testing.B, loc string) {
	ctx := context.Background()
	s := openStore(b, loc, newClock(t0))
	l := Limits{CallsPerMinute: 1 << 30}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := s.AllowCall(ctx, "bench", l); err != nil {
				b.Error(err)
				return
			}
		}
	})
	s.wmu.Lock()
	if s.writes > 0 {
		b.ReportMetric(float64(b.N)/float64(s.writes), "takes/tx")
	}
	s.wmu.Unlock()
}

// BenchmarkReserveSettleExecution is what a run adds to the budget's cost:
// a reservation before it and a settlement after it (two write
// transactions; before reservations, a read and one write).
func BenchmarkReserveSettleExecution(b *testing.B) {
	ctx := context.Background()
	s := openStore(b, dbPath(b), newClock(t0))
	l := Limits{ExecutionPerDay: 1 << 62}
	b.ReportAllocs()
	for b.Loop() {
		_, r, err := s.ReserveExecution(ctx, "bench", l, time.Minute)
		if err == nil {
			err = s.SettleExecution(ctx, r, 10*time.Millisecond)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkUsage is get_usage's read: from the view, no database.
func BenchmarkUsage(b *testing.B) {
	ctx := context.Background()
	s := openStore(b, dbPath(b), newClock(t0))
	l := LimitsFor(TierPro, 0)
	if _, err := s.AllowCall(ctx, "bench", l); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Usage(ctx, "bench", l); err != nil {
			b.Fatal(err)
		}
	}
}
