package tests

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestSessionSurvivesBackendSwitch is issue 10 item 18: a session made on
// one backend and used after a restart on the other (Docker → process →
// Docker, and the reverse) keeps its files and runs, including what the
// sandbox itself wrote (private directories and files, which only the
// session's uid can enter).
func TestSessionSurvivesBackendSwitch(t *testing.T) {
	requireDocker(t)
	requireBwrap(t)
	for _, order := range [][]string{{"docker", "process", "docker"}, {"process", "docker", "process"}} {
		t.Run(strings.Join(order, "-"), func(t *testing.T) {
			root := brokerRoot(t)
			sessionID := ""
			for i, backend := range order {
				b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken,
					Env: map[string]string{"SANDBOX_BACKEND": backend, "SANDBOX_POOL_SIZE": "0"}})
				c := b.Client(t, testToken)
				// Each step reads what the steps before wrote, then adds
				// its own file in a private directory.
				code := "set -e; umask 077; mkdir -p d; echo " + backend + " > d/step" + string(rune('0'+i)) + "; cat d/step*; ls -ld . d"
				args := map[string]any{"language": "bash", "code": code}
				if sessionID != "" {
					args["session_id"] = sessionID
				}
				r, _ := run(t, c, args)
				if !r.Success {
					t.Fatalf("step %d on %s: %+v", i, backend, r)
				}
				sessionID = r.SessionID
				for j := 0; j <= i; j++ {
					if !strings.Contains(r.Stdout, order[j]+"\n") {
						t.Fatalf("step %d on %s does not see step %d's file: %q", i, backend, j, r.Stdout)
					}
				}
				c.Close()
				b.Stop(t)
			}
		})
	}
}

// exitsWith runs `serve` with env and returns its exit code and stderr; it
// fails the test if the broker is still running after 60 s.
func exitsWith(t *testing.T, root string, env map[string]string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, brokerBin, "serve", "--transport", "http", "--addr", "127.0.0.1:0")
	cmd.Env = brokerEnv(root, testToken, env)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("the broker kept running:\n%s", stderr.String())
	}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), stderr.String()
}

// TestNamedBackendMustStart is issue 10 item 19: an operator who names a
// backend gets it or no broker, with the reason; auto still starts.
func TestNamedBackendMustStart(t *testing.T) {
	requireBwrap(t)
	// Its parent is 0700: no sandbox uid can reach the workspaces.
	root := filepath.Join(t.TempDir(), "root")
	code, stderr := exitsWith(t, root, map[string]string{"SANDBOX_BACKEND": "process"})
	if code == 0 || !strings.Contains(stderr, "SANDBOX_BACKEND=process cannot be used") || !strings.Contains(stderr, "cannot traverse") {
		t.Fatalf("process on an untraversable root: exit %d\n%s", code, stderr)
	}
	code, stderr = exitsWith(t, brokerRoot(t), map[string]string{"SANDBOX_BACKEND": "docker", "DOCKER_HOST": "unix:///nonexistent/docker.sock"})
	if code == 0 || !strings.Contains(stderr, "SANDBOX_BACKEND=docker cannot be used") {
		t.Fatalf("docker without a daemon: exit %d\n%s", code, stderr)
	}
	// auto falls back as before: no Docker, no usable process backend,
	// and the broker still serves its other tools.
	b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "auto", "DOCKER_HOST": "unix:///nonexistent/docker.sock"}})
	callTool(t, b.Client(t, testToken), "get_usage", nil)
}

// nobody is the uid of a broker that is not root.
const nobody = 65534

// TestForeignWorkspaceOnUnprivilegedProcessBackend: a broker that is not
// root cannot take over a workspace another uid owns (the state a root
// broker leaves after using the session on Docker, made here with chown);
// the call says so, names the backend, and is not retryable. Other
// sessions keep working.
func TestForeignWorkspaceOnUnprivilegedProcessBackend(t *testing.T) {
	requireBwrap(t)
	root := brokerRoot(t)
	if err := os.Chown(root, nobody, nobody); err != nil {
		t.Fatal(err)
	}
	start := func() *Broker {
		return StartHTTP(t, BrokerOpts{Root: root, Token: testToken, UID: nobody,
			Env: map[string]string{"SANDBOX_BACKEND": "process", "SANDBOX_ROOT_OVERLAY": "off"}})
	}
	b := start()
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "bash", "code": "mkdir d && echo kept > d/f && cat d/f"})
	if !r.Success || r.Stdout != "kept\n" {
		t.Fatalf("as uid %d: %+v", nobody, r)
	}
	c.Close()
	b.Stop(t)
	dirs, err := filepath.Glob(filepath.Join(root, "workspaces", "*"))
	if err != nil || len(dirs) != 1 {
		t.Fatalf("workspaces: %v %v", dirs, err)
	}
	if out, err := exec.Command("chown", "-R", "1900000000:1900000000", dirs[0]).CombinedOutput(); err != nil {
		t.Fatalf("chown: %v %s", err, out)
	}
	if err := os.Chmod(dirs[0], 0o700); err != nil {
		t.Fatal(err)
	}

	b = start()
	c = b.Client(t, testToken)
	e := mustToolError(t, callTool(t, c, "run_code", map[string]any{"session_id": r.SessionID, "language": "bash", "code": "cat d/f"}), "UNAVAILABLE")
	if e.Retryable || !strings.Contains(e.Message, "process backend") || !strings.Contains(e.Message, "uid 1900000000") {
		t.Fatalf("foreign workspace: %+v", e)
	}
	if r2, _ := run(t, c, map[string]any{"language": "bash", "code": "echo fresh"}); !r2.Success || r2.Stdout != "fresh\n" {
		t.Fatalf("a new session: %+v", r2)
	}
}
