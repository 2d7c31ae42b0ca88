package tests

import (
	"context"
	"encoding/json"
	"net/http"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/mcp"
)

type readiness struct {
	Status     string            `json:"status"`
	Components map[string]string `json:"components"`
	Pool       map[string]int    `json:"pool"`
}

func readyz(t *testing.T, b *Broker) (int, readiness) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, b.URL+"/readyz", nil)
	resp := do(t, req)
	var r readiness
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatalf("/readyz: %v", err)
	}
	return resp.StatusCode, r
}

// eventually polls cond every 100 ms until it holds or limit passes.
func eventually(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, limit)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestDockerDaemonRestartMidRun restarts the Docker daemon under a live
// broker, once cleanly and once by crash, each while a run and a job are
// in flight. The calls in flight end with a structured, retryable error
// (the job as status error with its reason), calls during the outage are
// refused the same way, /readyz reports the outage and the recovery, and
// afterwards the same sessions run again in new containers with their
// files, the warm pool is refilled with live containers and the dead ones
// are removed, all without restarting the broker.
func TestDockerDaemonRestartMidRun(t *testing.T) {
	start := time.Now()
	d := startPrivateDockerd(t, "sandbox-broker/runner-bash:latest")
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{
		"DOCKER_HOST": d.Host, "SANDBOX_BACKEND": "docker", "SANDBOX_POOL_SIZE": "1"}})
	c := b.Client(t, testToken)
	bash := func(session, code string) *mcp.CallToolResult {
		return callTool(t, c, "run_code", map[string]any{"session_id": session, "language": "bash", "code": code, "timeout_s": 120})
	}
	if r, _ := run(t, c, map[string]any{"session_id": "kept", "language": "bash", "code": "echo still-here > kept.txt"}); !r.Success {
		t.Fatalf("first run: %+v", r)
	}
	poolOf := func() []string {
		return strings.Fields(d.Docker(t, "ps", "-q", "--no-trunc", "--filter", "label=sandbox.workspace=pool", "--filter", "status=running"))
	}
	eventually(t, 30*time.Second, "pool filled", func() bool { return len(poolOf()) == 1 })

	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			poolBefore := poolOf()
			job := startAsync(t, c, map[string]any{"session_id": "kept", "command": "echo job-started; sleep 300", "timeout_seconds": 600})
			readFor(t, c, job.ExecutionID, "job-started")
			inflight := make(chan *mcp.CallToolResult, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
				defer cancel()
				var req mcp.CallToolRequest
				req.Params.Name = "run_code"
				req.Params.Arguments = map[string]any{"session_id": "inflight-" + sig.String(), "language": "bash",
					"code": "touch started; sleep 300", "timeout_s": 600}
				res, _ := c.CallTool(ctx, req) // nil res: checkInflight fails
				inflight <- res
			}()
			eventually(t, 30*time.Second, "in-flight run started", func() bool {
				m, _ := filepath.Glob(filepath.Join(b.Root, "workspaces", "*", "started"))
				return len(m) > 0
			})

			d.Stop(t, sig)
			// Outage: /readyz says so, and a new call is refused, retryably.
			eventually(t, 10*time.Second, "/readyz reports the outage", func() bool {
				code, r := readyz(t, b)
				return code == http.StatusServiceUnavailable && r.Components["sandbox_backend"] == "error"
			})
			if sig == syscall.SIGTERM {
				// A clean stop killed the containers: the call in flight
				// has its answer already.
				checkInflight(t, <-inflight)
			}
			e := mustToolError(t, bash("outage", "echo never"), "UNAVAILABLE")
			if !e.Retryable {
				t.Fatalf("outage error not retryable: %+v", e)
			}

			d.Start(t)
			if sig == syscall.SIGKILL {
				// The crashed daemon's containers ran on without it; the
				// restarted one kills them.
				checkInflight(t, <-inflight)
			}
			// (Only the backend's component: the project provider needs
			// the Node runner, which this private daemon does not have.)
			eventually(t, 10*time.Second, "/readyz reports the recovery", func() bool {
				_, r := readyz(t, b)
				return r.Components["sandbox_backend"] == "ok"
			})
			// The job's container died with the daemon: the job ends as
			// an error that says why, its output kept.
			var st struct {
				Status string `json:"status"`
				Error  string `json:"error"`
			}
			eventually(t, 30*time.Second, "job ended", func() bool {
				resultJSON(t, callTool(t, c, "get_execution_status", map[string]any{"execution_id": job.ExecutionID}), &st)
				return st.Status != "running"
			})
			if st.Status != "error" || !strings.Contains(st.Error, "sandbox") {
				t.Fatalf("job after the daemon restart: %+v", st)
			}
			// The very next calls work: the session gets a new container
			// and keeps its files; so does the session whose run was cut.
			r, _ := run(t, c, map[string]any{"session_id": "kept", "language": "bash", "code": "cat kept.txt"})
			if strings.TrimSpace(r.Stdout) != "still-here" {
				t.Fatalf("session after the restart: %+v", r)
			}
			if r, _ := run(t, c, map[string]any{"session_id": "inflight-" + sig.String(), "language": "bash", "code": "ls"}); !strings.Contains(r.Stdout, "started") {
				t.Fatalf("cut session after the restart: %+v", r)
			}
			var done execResult
			resultJSON(t, callTool(t, c, "execute_code", map[string]any{"session_id": "kept", "command": "echo job-again"}), &done)
			if done.Status != "completed" || stdoutOf(done.Output) != "job-again\n" {
				t.Fatalf("job after the restart: %+v", done)
			}
			// The pool holds a live container again, not the dead one, and
			// /readyz counts it; the dead containers are removed.
			eventually(t, 30*time.Second, "pool refilled", func() bool {
				p := poolOf()
				_, r := readyz(t, b)
				return len(p) == 1 && (len(poolBefore) == 0 || p[0] != poolBefore[0]) && r.Pool["bash"] == 1
			})
			eventually(t, 30*time.Second, "dead containers removed", func() bool {
				return d.Docker(t, "ps", "-aq", "--filter", "status=exited") == ""
			})
		})
	}
	t.Logf("daemon restart test took %s", time.Since(start).Round(100*time.Millisecond))
}

func checkInflight(t *testing.T, res *mcp.CallToolResult) {
	t.Helper()
	if res == nil {
		t.Fatal("in-flight call got no result")
	}
	e := mustToolError(t, res, "UNAVAILABLE")
	if !e.Retryable || e.Message == "" {
		t.Fatalf("in-flight error: %+v", e)
	}
}
