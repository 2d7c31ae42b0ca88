package agent

import (
	"maps"
	"slices"
	"testing"
)

// TestSessionCacheReadsOnlyWhatItCannotVouchFor: the IDs it remembers keep
// their session without a read; new IDs, and IDs of a session whose leader
// has gone (a stray could now take that number), are read afresh; gone or
// dead IDs drop out.
func TestSessionCacheReadsOnlyWhatItCannotVouchFor(t *testing.T) {
	var c SessionCache
	if got := c.Before([]int{1, 2}, nil); got != nil {
		t.Fatalf("Before with nothing recorded = %v, want nil (read in full)", got)
	}
	// The agent's session 10 (leader 10), the zygote's 20 (leader 20, and
	// its spare 21), and 30 whose leader 30 exited, its thread 31 left.
	c.Record(map[int][]int{10: {10, 11}, 20: {20, 21}, 30: {31}})
	real := map[int]int{10: 10, 11: 10, 20: 20, 21: 20, 31: 77, 40: 40}
	var read []int
	got := c.Before([]int{10, 11, 20, 21, 31, 40, 50}, func(id int) (int, bool) {
		read = append(read, id)
		sid, ok := real[id] // 50 has gone, or runs no code
		return sid, ok
	})
	slices.Sort(read)
	if !slices.Equal(read, []int{31, 40, 50}) {
		t.Errorf("read %v, want only the new IDs and the one whose remembered leader has gone", read)
	}
	want := map[int][]int{10: {10, 11}, 20: {20, 21}, 77: {31}, 40: {40}}
	if !maps.EqualFunc(got, want, slices.Equal[[]int]) {
		t.Errorf("Before = %v, want %v", got, want)
	}
	if got := c.Before(nil, nil); got != nil {
		t.Errorf("Before of an unreadable cgroup = %v, want nil", got)
	}
	c.Record(nil)
	if got := c.Before([]int{10}, nil); got != nil {
		t.Errorf("Before after an unreadable full read = %v, want nil", got)
	}
}
