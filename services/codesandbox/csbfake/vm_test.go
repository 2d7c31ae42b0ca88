package csbfake

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestRealShell: commands run for real in the VM, see the agent's files,
// read input from shell/in, and outlive a dropped connection.
func TestRealShell(t *testing.T) {
	s := New(t, key, WithRealShell())
	a, id := joined(t, s, nil, 0)
	if r, _ := a.call("fs/writeFile", map[string]any{"path": "in.txt", "content": []byte("from the agent")}); toInt(r["status"]) != 0 {
		t.Fatalf("write: %v", r)
	}
	out, code, _ := shellRun(t, a, "cat in.txt; echo; python3 -c 'import sys; sys.exit(7)'")
	if code != 7 || !strings.Contains(out, "from the agent") {
		t.Fatalf("exit %d, output %q", code, out)
	}
	// Input typed into the terminal reaches the command.
	r, _ := a.call("shell/create", map[string]any{"command": "read x; echo \"[$x]\" > got.txt", "size": map[string]any{"cols": 128, "rows": 24}})
	sh := r["result"].(map[string]any)["shellId"]
	if r, _ := a.call("shell/in", map[string]any{"shellId": sh, "input": "typed\n", "size": map[string]any{"cols": 128, "rows": 24}}); toInt(r["status"]) != 0 || r["result"] != nil {
		t.Fatalf("shell/in: %v", r)
	}
	a.until("shell/exit")
	if st, _ := s.Sandbox(id); string(st.Files["/project/workspace/got.txt"]) != "[typed]\n" {
		t.Fatalf("got.txt %q", st.Files["/project/workspace/got.txt"])
	}
	if r, _ := a.call("shell/in", map[string]any{"shellId": "sh_99", "input": "x", "size": map[string]any{"cols": 1, "rows": 1}}); toInt(r["status"]) != 1 {
		t.Fatalf("shell/in to no shell: %v", r)
	}
	// A VM's shells do not depend on their connection.
	a.call("shell/create", map[string]any{"command": "sleep 0.5; echo later > later.txt", "size": map[string]any{"cols": 128, "rows": 24}})
	if s.DropConnections(id) != 1 {
		t.Fatal("no connection dropped")
	}
	cx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := s.Await(cx, func() bool { st, _ := s.Sandbox(id); return st.Files["/project/workspace/later.txt"] != nil }); err != nil {
		t.Fatal("the shell died with its connection")
	}
	if st, _ := s.Sandbox(id); st.Connections != 0 || !st.Running {
		t.Fatalf("after the drop: %+v", st)
	}
}

// TestVMFileSystemStaysInItsDirectory: a symlink a command makes in the VM
// never leads the fake's agent to a host file.
func TestVMFileSystemStaysInItsDirectory(t *testing.T) {
	s := New(t, key, WithRealShell())
	a, _ := joined(t, s, nil, 0)
	secret := filepath.Join(t.TempDir(), "host-secret")
	if err := os.WriteFile(secret, []byte("host only"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, code, _ := shellRun(t, a, "ln -s "+secret+" link; ln -s /etc/hostname etc"); code != 0 {
		t.Fatal("ln failed")
	}
	for _, p := range []string{"link", "etc"} {
		r, _ := a.call("fs/readFile", map[string]any{"path": p})
		if toInt(r["status"]) != 1 {
			t.Fatalf("%s read through a symlink: %v", p, r)
		}
	}
	r, _ := a.call("fs/stat", map[string]any{"path": "link"})
	if res := r["result"].(map[string]any); res["isSymlink"] != true {
		t.Fatalf("stat of a symlink: %v", r)
	}
	if r, _ := a.call("fs/remove", map[string]any{"path": "link"}); toInt(r["status"]) != 0 {
		t.Fatalf("remove: %v", r)
	}
	if _, err := os.Stat(secret); err != nil {
		t.Fatalf("removing the link touched its target: %v", err)
	}
}

// TestLatencyInjected: every REST answer and agent message is held back
// by the configured latency (a lower bound; no upper one is asserted).
func TestLatencyInjected(t *testing.T) {
	s := New(t, key, WithLatency(80*time.Millisecond, 60*time.Millisecond))
	t0 := time.Now()
	if code, _, _, _ := do(t, s, "GET", "/meta/info", bearer(), ""); code != 200 {
		t.Fatal(code)
	}
	if d := time.Since(t0); d < 80*time.Millisecond {
		t.Fatalf("REST answered in %v", d)
	}
	a, _ := joined(t, s, nil, 0)
	t0 = time.Now()
	a.call("fs/stat", map[string]any{"path": "/project/workspace"})
	if d := time.Since(t0); d < 60*time.Millisecond {
		t.Fatalf("agent answered in %v", d)
	}
	s.SetLatency(0, 150*time.Millisecond)
	t0 = time.Now()
	a.call("fs/stat", map[string]any{"path": "/project/workspace"})
	if d := time.Since(t0); d < 150*time.Millisecond {
		t.Fatalf("SetLatency not applied: the agent answered in %v", d)
	}
}
