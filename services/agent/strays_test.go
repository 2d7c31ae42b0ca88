package agent

import "testing"

// TestStraysHoldsTheKernelSessionToTheKernel: the IDs are a sandbox's own
// (gVisor numbers its processes from 1); none of them is looked up on the
// host, where they name other processes or none.
func TestStraysHoldsTheKernelSessionToTheKernel(t *testing.T) {
	const k, other, gone = 7, 9, 4_000_000
	infra := Sessions{1: {1, 3}}
	with := func(extra Sessions) Sessions {
		m := Sessions{1: {1, 3}}
		for sid, procs := range extra {
			m[sid] = procs
		}
		return m
	}
	for _, c := range []struct {
		name       string
		before     Sessions
		after      Sessions
		kernel     int
		started    bool
		stray      bool
		wantKernel int
	}{
		{"quiet run", infra, infra, 0, false, false, 0},
		{"new session", infra, with(Sessions{other: {other}}), 0, false, true, 0},
		{"kernel started", infra, with(Sessions{k: {k}}), 0, true, false, k},
		{"kernel started with a companion", infra, with(Sessions{k: {k, other}}), 0, true, true, 0},
		{"kernel started beside a stray session", infra, with(Sessions{k: {k}, other: {other}}), 0, true, true, 0},
		{"a session whose leader is gone is no kernel", infra, with(Sessions{k: {other}}), 0, true, true, 0},
		{"kernel session kept clean", with(Sessions{k: {k}}), with(Sessions{k: {k}}), k, false, false, k},
		{"cell child left in the kernel session", with(Sessions{k: {k}}), with(Sessions{k: {k, other}}), k, false, true, k},
		{"cell child with an ID the host does not have", with(Sessions{k: {k}}), with(Sessions{k: {k, gone}}), k, false, true, k},
		{"kernel exited, its child lives on in its session", with(Sessions{k: {k}}), with(Sessions{k: {other}}), k, false, true, k},
		{"kernel gone", with(Sessions{k: {k}}), infra, k, false, false, 0},
	} {
		stray, kernel := Strays(c.before, c.after, c.kernel, c.started)
		if stray != c.stray || kernel != c.wantKernel {
			t.Errorf("%s: stray %v kernel %d, want %v %d", c.name, stray, kernel, c.stray, c.wantKernel)
		}
	}
}
