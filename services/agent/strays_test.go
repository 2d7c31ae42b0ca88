package agent

import (
	"os"
	"os/exec"
	"testing"
)

func TestStraysHoldsTheKernelSessionToTheKernel(t *testing.T) {
	sleep := exec.Command("sleep", "30")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sleep.Process.Kill(); _ = sleep.Wait() }()
	k, other := os.Getpid(), sleep.Process.Pid // two real thread groups
	infra := map[int][]int{1: {1}}
	with := func(extra map[int][]int) map[int][]int {
		m := map[int][]int{1: {1}}
		for sid, tids := range extra {
			m[sid] = tids
		}
		return m
	}
	for _, c := range []struct {
		name       string
		before     map[int][]int
		after      map[int][]int
		kernel     int
		started    bool
		stray      bool
		wantKernel int
	}{
		{"quiet run", infra, infra, 0, false, false, 0},
		{"new session", infra, with(map[int][]int{other: {other}}), 0, false, true, 0},
		{"kernel started", infra, with(map[int][]int{k: {k}}), 0, true, false, k},
		{"kernel started with a companion", infra, with(map[int][]int{k: {k, other}}), 0, true, true, 0},
		{"kernel started beside a stray session", infra, with(map[int][]int{k: {k}, other: {other}}), 0, true, true, 0},
		{"kernel session kept clean", with(map[int][]int{k: {k}}), with(map[int][]int{k: {k}}), k, false, false, k},
		{"cell child left in the kernel session", with(map[int][]int{k: {k}}), with(map[int][]int{k: {k, other}}), k, false, true, k},
		{"kernel gone", with(map[int][]int{k: {k}}), infra, k, false, false, 0},
	} {
		stray, kernel := Strays(c.before, c.after, c.kernel, c.started)
		if stray != c.stray || kernel != c.wantKernel {
			t.Errorf("%s: stray %v kernel %d, want %v %d", c.name, stray, kernel, c.stray, c.wantKernel)
		}
	}
}
