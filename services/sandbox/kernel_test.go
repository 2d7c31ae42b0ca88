package sandbox

import (
	"strings"
	"testing"
)

func TestKernelLedgerTellsWhyStateWasLost(t *testing.T) {
	l := &KernelLedger{}
	run := func(k KernelStatus) KernelStatus {
		r := ExecResult{Kernel: &k}
		l.Observe(&r)
		return *r.Kernel
	}
	if k := run(KernelStatus{Started: true}); k.StateLost {
		t.Fatalf("the first kernel lost nothing: %+v", k)
	}
	if k := run(KernelStatus{}); k.StateLost {
		t.Fatalf("a reused kernel lost nothing: %+v", k)
	}
	// The sandbox goes (idle release): the next start says so, once.
	l.Lost("released while idle")
	l.Lost("a later reason does not replace the first")
	if k := run(KernelStatus{Started: true}); !k.StateLost || k.Reason != "released while idle" {
		t.Fatalf("after the release: %+v", k)
	}
	// The kernel ends in a run; the sandbox then goes too.
	run(KernelStatus{Ended: "the cell timed out"})
	l.Lost("a run timed out and the sandbox was replaced")
	if k := run(KernelStatus{Started: true}); !k.StateLost || k.Reason != "the cell timed out" {
		t.Fatalf("after the timeout: %+v", k)
	}
	// The agent saw its kernel die between runs; the broker knew nothing.
	if k := run(KernelStatus{Started: true, Reason: "the kernel was killed by SIGKILL"}); !k.StateLost || k.Reason != "the kernel was killed by SIGKILL" {
		t.Fatalf("after a kill between runs: %+v", k)
	}
	// A kernel killed by the OOM killer is named as such.
	r := ExecResult{OOMKilled: true, Kernel: &KernelStatus{Ended: "the kernel was killed by SIGKILL"}}
	l.Observe(&r)
	if k := run(KernelStatus{Started: true}); !strings.Contains(k.Reason, "out of memory") || !strings.Contains(r.Kernel.Ended, "out of memory") {
		t.Fatalf("after an OOM kill: %+v, then %+v", r.Kernel, k)
	}
	// Fresh runs leave the ledger alone.
	l.Observe(&ExecResult{})
}

func TestKernelLedgersOutliveSessions(t *testing.T) {
	var ls KernelLedgers
	a := ls.Get("w1")
	a.Observe(&ExecResult{Kernel: &KernelStatus{Started: true}})
	a.Lost("released while idle")
	if ls.Get("w1") != a || ls.Get("w2") == a {
		t.Fatal("ledgers are per workspace and kept")
	}
	ls.Forget("w1")
	r := ExecResult{Kernel: &KernelStatus{Started: true}}
	ls.Get("w1").Observe(&r)
	if r.Kernel.StateLost {
		t.Fatal("a forgotten workspace starts anew")
	}
}
