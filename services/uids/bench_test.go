package uids

import (
	"context"
	"path/filepath"
	"strconv"
	"testing"
)

// BenchmarkPoolClaimMove is the uid cost a warm-pool claim adds: one Move
// (the pool key's uid becomes the workspace's), with the table holding
// a few thousand leases; the pool's next container leases a fresh uid.
func BenchmarkPoolClaimMove(b *testing.B) {
	ctx := context.Background()
	a, err := Open(ctx, filepath.Join(b.TempDir(), "state.db"), 1_900_000_000, 65536)
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	for i := range 4000 {
		if _, err := a.Lease(ctx, "ws"+strconv.Itoa(i)); err != nil {
			b.Fatal(err)
		}
	}
	i := 0
	for b.Loop() {
		i++
		key := "pool:" + strconv.Itoa(i)
		b.StopTimer()
		if _, err := a.Lease(ctx, key); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if _, err := a.Move(ctx, key, "claimed"+strconv.Itoa(i)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLease is a new uid for a new owner (a cold-start session).
func BenchmarkLease(b *testing.B) {
	ctx := context.Background()
	a, err := Open(ctx, filepath.Join(b.TempDir(), "state.db"), 1_900_000_000, 65536)
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	i := 0
	for b.Loop() {
		i++
		if _, err := a.Lease(ctx, "ws"+strconv.Itoa(i)); err != nil {
			b.Fatal(err)
		}
	}
}
