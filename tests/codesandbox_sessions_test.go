package tests

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
)

// runnerTpl is the operator's runner template in the fake (CSB_RUNNER_TEMPLATE).
const runnerTpl = "runtpl"

// hostedBroker is a broker whose sessions run in the fake's VMs, which
// run commands for real (csbfake.WithRealShell).
func hostedBroker(t *testing.T, extra map[string]string) (*csbfake.Server, *Broker, *client.Client) {
	t.Helper()
	fake := csbfake.New(t, csbKey, csbfake.WithRealShell())
	fake.AddTemplate(runnerTpl, nil, 0)
	env := map[string]string{"SANDBOX_BACKEND": "codesandbox", "CSB_API_KEY": csbKey, "CSB_API_URL": fake.URL(), "CSB_RUNNER_TEMPLATE": runnerTpl}
	for k, v := range extra {
		env[k] = v
	}
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: env})
	return fake, b, b.Client(t, testToken)
}

type hostedRun struct {
	runResult
	Backend string `json:"backend"`
}

func hostedRunCode(t *testing.T, c *client.Client, args map[string]any) (hostedRun, *mcp.CallToolResult) {
	t.Helper()
	res := callTool(t, c, "run_code", args)
	if res.IsError {
		var e toolError
		resultJSON(t, res, &e)
		t.Fatalf("run_code failed: %+v", e)
	}
	var r hostedRun
	resultJSON(t, res, &r)
	return r, res
}

func TestCodeSandboxSessionsThroughMCP(t *testing.T) {
	fake, b, c := hostedBroker(t, nil)
	var runners struct {
		Backend string `json:"backend"`
	}
	resultJSON(t, callTool(t, c, "list_runners", map[string]any{}), &runners)
	if runners.Backend != "codesandbox" {
		t.Fatalf("list_runners backend %q", runners.Backend)
	}
	// A file uploaded to the session reaches the VM; what the run writes comes back as a resource.
	var up struct {
		SessionID string `json:"session_id"`
	}
	resultJSON(t, callTool(t, c, "upload_file", map[string]any{"path": "in.csv", "content": "a,b\n1,2\n"}), &up)
	r, res := hostedRunCode(t, c, map[string]any{"session_id": up.SessionID, "language": "python",
		"code": "rows = open('in.csv').read().splitlines()\nprint(len(rows))\nopen('/mnt/data/out.txt', 'w').write(rows[1])"})
	if !r.Success || r.Stdout != "2\n" || r.Backend != "codesandbox" || len(r.Files) != 1 || r.Files[0].Name != "out.txt" {
		t.Fatalf("run %+v", r)
	}
	var uri string
	for _, ct := range res.Content {
		if l, ok := ct.(mcp.ResourceLink); ok && strings.HasPrefix(l.URI, "sandbox://") {
			uri = l.URI
		}
	}
	var rr mcp.ReadResourceRequest
	rr.Params.URI = uri
	rc, err := c.ReadResource(context.Background(), rr)
	if err != nil || len(rc.Contents) != 1 || rc.Contents[0].(mcp.TextResourceContents).Text != "1,2" {
		t.Fatalf("resource %q: %+v %v", uri, rc, err)
	}
	// Jobs run there too, and say where.
	var ex struct {
		Status   string `json:"status"`
		ExitCode *int   `json:"exit_code"`
		Backend  string `json:"backend"`
		Output   []struct {
			Type, Data string
		} `json:"output"`
	}
	resultJSON(t, callTool(t, c, "execute_code", map[string]any{"session_id": up.SessionID, "command": "cat out.txt; exit 5"}), &ex)
	var out strings.Builder
	for _, ev := range ex.Output {
		if ev.Type == "stdout" {
			out.WriteString(ev.Data)
		}
	}
	if ex.Backend != "codesandbox" || ex.ExitCode == nil || *ex.ExitCode != 5 || out.String() != "1,2" {
		t.Fatalf("execute_code %+v", ex)
	}
	// Notebook mode is not available there: a clear error, nothing run.
	mustToolError(t, callTool(t, c, "run_code", map[string]any{"session_id": up.SessionID, "language": "python", "code": "1", "mode": "notebook"}), "INVALID_INPUT")
	// Closing the session deletes its VM; the key appears in no log line.
	calls := fake.PitcherCalls()
	vm := calls[len(calls)-1].SandboxID
	callTool(t, c, "close_session", map[string]any{"session_id": up.SessionID})
	if st, ok := fake.Sandbox(vm); !ok || !st.Deleted {
		t.Fatalf("VM %s after close_session: %+v", vm, st)
	}
	if strings.Contains(b.Logs(), csbKey) {
		t.Fatal("the API key is in the broker's log")
	}
}

func TestCodeSandboxUnreachableWithoutFallback(t *testing.T) {
	fake, _, c := hostedBroker(t, nil)
	fake.Inject(csbfake.Fault{Status: http.StatusServiceUnavailable, N: 100, Path: "/sandbox/" + runnerTpl + "/fork"})
	e := mustToolError(t, callTool(t, c, "run_code", map[string]any{"language": "bash", "code": "echo hi"}), "UNAVAILABLE")
	if !e.Retryable {
		t.Fatalf("a CodeSandbox outage is retryable: %+v", e)
	}
	fake.ClearFaults()
	fake.Inject(csbfake.Fault{Status: http.StatusTooManyRequests, N: 100, Path: "/sandbox/" + runnerTpl + "/fork", Budget: "sandboxes"})
	e = mustToolError(t, callTool(t, c, "run_code", map[string]any{"language": "bash", "code": "echo hi"}), "RATE_LIMIT_EXCEEDED")
	if !e.Retryable || e.RetryAfterS == nil || *e.RetryAfterS <= 0 {
		t.Fatalf("429: %+v", e)
	}
}

// TestCodeSandboxFallsBackToDocker: with SANDBOX_FALLBACK=docker a run
// CodeSandbox cannot take runs on the local engine, on the same
// workspace, and says so; the next one goes back to the VM.
func TestCodeSandboxFallsBackToDocker(t *testing.T) {
	requireDocker(t)
	fake, _, c := hostedBroker(t, map[string]string{"SANDBOX_FALLBACK": "docker", "SANDBOX_POOL_SIZE": "0"})
	fake.Inject(csbfake.Fault{Status: http.StatusBadGateway, N: 100, Path: "/sandbox/" + runnerTpl + "/fork"})
	r, _ := hostedRunCode(t, c, map[string]any{"language": "python", "code": "open('made-in-docker.txt','w').write('d')\nprint('local')"})
	if !r.Success || r.Stdout != "local\n" || r.Backend != "docker" {
		t.Fatalf("fallback run %+v", r)
	}
	fake.ClearFaults()
	r2, _ := hostedRunCode(t, c, map[string]any{"session_id": r.SessionID, "language": "bash", "code": "cat made-in-docker.txt; hostname"})
	if !r2.Success || r2.Backend != "codesandbox" || r2.Stdout != "dcsb-vm\n" {
		t.Fatalf("back on CodeSandbox %+v", r2)
	}
}
