package tests

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// buildResult is get_sandbox_output build_output's answer.
type buildResult struct {
	Status      string `json:"status"`
	ExecutionID string `json:"execution_id"`
	ExitCode    *int   `json:"exit_code"`
	Success     bool   `json:"success"`
	Output      string `json:"output"`
	NextSince   int64  `json:"next_since"`
	Hint        string `json:"hint"`
}

// buildProject runs a project's build through get_sandbox_output and, if
// it goes on as an execution, polls that to its end; it returns the final
// status and what the build printed.
func buildProject(t *testing.T, c *client.Client, id string) (status, output string) {
	t.Helper()
	var r buildResult
	res := callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": id, "output_type": "build_output"})
	if res.IsError {
		t.Fatalf("build_output: %+v", res.Content)
	}
	resultJSON(t, res, &r)
	if r.Status != "running" {
		return r.Status, r.Output
	}
	st, events := readUntilDone(t, c, r.ExecutionID, nil)
	return st, stdoutOf(events)
}

var execIDPattern = regexp.MustCompile(`^exec_[0-9a-f]{32}$`)

// TestLocalBuildContinuesAsExecution: a build slower than the wait
// (PROJECT_BUILD_WAIT_S) sends progress notifications to a client that
// sent a progress token, then comes back as a running execution instead
// of running into the client's time-out; while it runs, files are not
// written under it and asking again follows the same build; it is polled
// to its end like any execution, and the audit outcome says what each
// call did (issue 10, item 2: a first next build outlasted the TypeScript
// SDK's 60 s with no progress at all).
func TestLocalBuildContinuesAsExecution(t *testing.T) {
	requireNodeRunner(t)
	root := brokerRoot(t)
	b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0", "PROJECT_BUILD_WAIT_S": "2"}})
	c := b.Client(t, testToken)
	var mu sync.Mutex
	var progress []float64
	c.OnNotification(func(n mcp.JSONRPCNotification) {
		if n.Method != "notifications/progress" || n.Params.AdditionalFields["progressToken"] != "slow-build" {
			return
		}
		p, _ := n.Params.AdditionalFields["progress"].(float64)
		mu.Lock()
		progress = append(progress, p)
		mu.Unlock()
	})
	// The build takes at least 12 s: far past the 2 s wait, whatever the load.
	pkg := `{"name":"slow","scripts":{"build":"echo build started && sleep 12 && echo build finished","start":"node server.js"}}`
	var created projectCreated
	resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "slow", "template": "node",
		"initial_files": map[string]string{"package.json": pkg}}), &created)

	var req mcp.CallToolRequest
	req.Params.Name = "get_sandbox_output"
	req.Params.Arguments = map[string]any{"sandbox_id": created.SandboxID, "output_type": "build_output"}
	req.Params.Meta = &mcp.Meta{ProgressToken: "slow-build"}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := c.CallTool(ctx, req)
	if err != nil || res.IsError {
		t.Fatalf("build_output: %v %+v", err, res)
	}
	var first buildResult
	resultJSON(t, res, &first)
	if first.Status != "running" || !execIDPattern.MatchString(first.ExecutionID) || first.ExitCode != nil ||
		!strings.Contains(first.Hint, "get_execution_output") {
		t.Fatalf("first build_output: %+v", first)
	}
	mu.Lock()
	got := append([]float64(nil), progress...)
	mu.Unlock()
	if len(got) == 0 {
		t.Fatal("no progress notification during the build, though the call carried a progress token")
	}
	for i := 1; i < len(got); i++ {
		if got[i] <= got[i-1] {
			t.Fatalf("progress does not increase: %v", got)
		}
	}

	// While it runs, files stay as the build reads them, and a second
	// build_output follows the same execution.
	e := mustToolError(t, callTool(t, c, "write_files_to_sandbox", map[string]any{"sandbox_id": created.SandboxID,
		"files": map[string]string{"late.txt": "x"}}), "CONFLICT")
	if !strings.Contains(e.Message, "build") {
		t.Fatalf("write during the build: %+v", e)
	}
	var again buildResult
	resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "build_output"}), &again)
	if again.Status != "running" || again.ExecutionID != first.ExecutionID {
		t.Fatalf("second build_output while the first runs: %+v (first %s)", again, first.ExecutionID)
	}

	// It is an execution like any: polled to its end by cursor, listed.
	status, events := readUntilDone(t, c, first.ExecutionID, nil)
	out := stdoutOf(events)
	if status != "completed" || !strings.Contains(out, "build started") || !strings.Contains(out, "build finished") {
		t.Fatalf("execution %s: %s %q", first.ExecutionID, status, out)
	}
	if !strings.HasPrefix(out, first.Output) {
		t.Fatalf("the running result's output %q is not what the build printed first (%q)", first.Output, out)
	}
	var list struct {
		Executions []struct {
			ID      string `json:"execution_id"`
			Session string `json:"session_id"`
			Command string `json:"command"`
			Status  string `json:"status"`
		} `json:"executions"`
	}
	resultJSON(t, callTool(t, c, "list_executions", nil), &list)
	if len(list.Executions) != 1 || list.Executions[0].ID != first.ExecutionID || list.Executions[0].Session != created.SandboxID ||
		list.Executions[0].Command != "npm run build" || list.Executions[0].Status != "completed" {
		t.Fatalf("list_executions: %+v", list)
	}
	// Done: files can be written again.
	if res := callTool(t, c, "write_files_to_sandbox", map[string]any{"sandbox_id": created.SandboxID,
		"files": map[string]string{"late.txt": "x"}}); res.IsError {
		t.Fatalf("write after the build: %+v", res.Content)
	}

	b.Stop(t)
	// Both build_output calls' outcome rows say the build went on, and as which execution.
	rows := auditOutcomeParams(t, root, "get_sandbox_output")
	want := "continuing as execution " + first.ExecutionID
	if len(rows) != 2 || rows[0]["build"] != want || rows[1]["build"] != want || rows[0]["execution_id"] != first.ExecutionID {
		t.Fatalf("get_sandbox_output outcome params: %v", rows)
	}
}

// TestLocalBuildWithinTheWaitCompletesInline: a build that ends within the
// wait is answered in the call, with its exit code, and its outcome row
// says it completed.
func TestLocalBuildWithinTheWaitCompletesInline(t *testing.T) {
	requireNodeRunner(t)
	root := brokerRoot(t)
	b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0"}})
	c := b.Client(t, testToken)
	pkg := `{"name":"quick","scripts":{"build":"echo compiled && exit 3","start":"node server.js"}}`
	var created projectCreated
	resultJSON(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "quick", "template": "node",
		"initial_files": map[string]string{"package.json": pkg}}), &created)
	var r buildResult
	resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "build_output"}), &r)
	if r.Status != "failed" || r.ExitCode == nil || *r.ExitCode != 3 || r.Success || !strings.Contains(r.Output, "compiled") ||
		!execIDPattern.MatchString(r.ExecutionID) {
		t.Fatalf("build_output: %+v", r)
	}
	b.Stop(t)
	rows := auditOutcomeParams(t, root, "get_sandbox_output")
	if len(rows) != 1 || rows[0]["build"] != "failed" || rows[0]["exit_code"] != float64(3) || rows[0]["execution_id"] != r.ExecutionID {
		t.Fatalf("get_sandbox_output outcome params: %v", rows)
	}
}

// auditOutcomeParams returns the params of tool's outcome rows, in order.
func auditOutcomeParams(t *testing.T, root, tool string) []map[string]any {
	t.Helper()
	var rows []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(runBroker(t, root, "audit", "export", "--format", "jsonl")), "\n") {
		var r struct {
			Phase, Tool string
			Params      map[string]any
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("export line %q: %v", line, err)
		}
		if r.Tool == tool && r.Phase == "outcome" {
			rows = append(rows, r.Params)
		}
	}
	return rows
}
