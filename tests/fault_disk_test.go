package tests

import (
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// smallFS mounts a tmpfs of the given size on a temp dir, traversable by
// the process backend's uids like brokerRoot. It needs root; CI must run
// it.
func smallFS(t *testing.T, size string) string {
	t.Helper()
	dir := brokerRoot(t)
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size+",mode=0711"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("mount a tmpfs (the disk-full tests need root in CI): %v", err)
		}
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// fillFS writes a ballast file until the filesystem is full.
func fillFS(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "ballast")
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 64<<10)
	for {
		if _, err := f.Write(chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			return p
		}
	}
}

// TestSandboxRootFull fills SANDBOX_ROOT (a small real filesystem) under a
// live broker. Calls are refused with a structured, retryable error that
// says why, and do not run (the commit never reaches GitHub); the broker
// stays up and /readyz says it cannot take calls. Once space returns the
// same broker serves again. A broker stopped while the disk is full (its
// final checkpoint fails) starts again once there is space, and the audit
// log verifies throughout.
func TestSandboxRootFull(t *testing.T) {
	root := smallFS(t, "24m")
	env, fake := githubEnv(t, fineGrainedPAT, nil)
	b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: env})
	c := b.Client(t, testToken)
	commit := func(branch string) map[string]any {
		return map[string]any{"repo_id": "site", "branch": branch, "commit_message": "m", "files": map[string]string{"a.txt": "a"}}
	}
	if res := callTool(t, c, "commit_and_push_to_github", commit("sandbox/before")); res.IsError {
		t.Fatalf("commit before: %+v", res.Content)
	}

	ballast := fillFS(t, root)
	requests := len(fake.Requests())
	for i := 0; i < 5; i++ {
		for _, call := range []struct {
			tool string
			args map[string]any
		}{{"commit_and_push_to_github", commit("sandbox/full")}, {"get_usage", nil}} {
			e := mustToolError(t, callTool(t, c, call.tool, call.args), "UNAVAILABLE")
			if !e.Retryable || !strings.Contains(e.Message, "storage is full") {
				t.Fatalf("%s on a full disk: %+v", call.tool, e)
			}
		}
	}
	if n := len(fake.Requests()); n != requests {
		t.Fatalf("a refused commit reached GitHub: %d requests, was %d", n, requests)
	}
	if fake.CommitCount("acme", "site", "sandbox/full") != 0 {
		t.Fatal("a refused commit landed")
	}
	eventually(t, 5*time.Second, "/readyz on a full disk", func() bool {
		code, r := readyz(t, b)
		return code == http.StatusServiceUnavailable && r.Components["storage"] == "error"
	})
	if body := getNoAuth(t, b, "/healthz"); !strings.Contains(body, "ok") {
		t.Fatalf("/healthz on a full disk: %s", body)
	}

	// Space returns: the same broker serves again.
	if err := os.Remove(ballast); err != nil {
		t.Fatal(err)
	}
	if res := callTool(t, c, "commit_and_push_to_github", commit("sandbox/after")); res.IsError {
		t.Fatalf("commit after space returned: %+v", res.Content)
	}
	eventually(t, 5*time.Second, "/readyz after space returned", func() bool {
		code, _ := readyz(t, b)
		return code == http.StatusOK
	})

	// Stopped while full: the final checkpoint cannot be written.
	ballast = fillFS(t, root)
	b.Stop(t)
	if err := os.Remove(ballast); err != nil {
		t.Fatal(err)
	}
	if code, out := verifyCLI(t, root); code != 0 || !strings.HasPrefix(out, "OK") {
		t.Fatalf("audit verify: exit %d: %s", code, out)
	}
	b2 := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: env})
	if res := callTool(t, b2.Client(t, testToken), "get_usage", nil); res.IsError {
		t.Fatalf("after restart: %+v", res.Content)
	}
	b2.Stop(t)
	if code, out := verifyCLI(t, root); code != 0 || !strings.HasPrefix(out, "OK") {
		t.Fatalf("audit verify after restart: exit %d: %s", code, out)
	}
}
