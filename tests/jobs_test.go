package tests

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
)

// requireBwrap fails in CI and skips elsewhere when bubblewrap cannot make
// a sandbox here.
func requireBwrap(t testing.TB) {
	t.Helper()
	err := exec.Command("bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
		"--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "true").Run()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("bubblewrap cannot create a sandbox (required in CI: .ci/run installs it): %v", err)
		}
		t.Skipf("bubblewrap unavailable: %v", err)
	}
}

// backends runs fn once per sandbox backend, each with its own broker.
func backends(t *testing.T, extra map[string]string, fn func(t *testing.T, backend string, b *Broker, c *client.Client)) {
	runBackends(t, extra, fn, sandboxBackends...)
}

// backendsAndGVisor is backends plus the Docker backend under gVisor
// (SANDBOX_RUNTIME=runsc, named docker-runsc), for what the runtime
// changes: the sandbox's processes are not host processes there.
func backendsAndGVisor(t *testing.T, extra map[string]string, fn func(t *testing.T, backend string, b *Broker, c *client.Client)) {
	runBackends(t, extra, fn, "docker", "docker-runsc", "process", "process_rootfs")
}

func runBackends(t *testing.T, extra map[string]string, fn func(t *testing.T, backend string, b *Broker, c *client.Client), names ...string) {
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			b := startBackend(t, name, BrokerOpts{Env: extra})
			fn(t, name, b, b.Client(t, testToken))
		})
	}
}

type jobEvent struct {
	Seq            int64  `json:"seq"`
	TS             string `json:"ts"`
	Type           string `json:"type"`
	Data           string `json:"data"`
	Code           *int   `json:"code"`
	Message        string `json:"message"`
	TimeoutSeconds int    `json:"timeout_seconds"`
}

type execResult struct {
	ExecutionID string     `json:"execution_id"`
	SessionID   string     `json:"session_id"`
	Status      string     `json:"status"`
	ExitCode    *int       `json:"exit_code"`
	Output      []jobEvent `json:"output"`
	Dropped     int64      `json:"dropped"`
	NextSince   int64      `json:"next_since"`
	More        bool       `json:"more"`
}

func startAsync(t *testing.T, c *client.Client, args map[string]any) execResult {
	t.Helper()
	res := callTool(t, c, "execute_code_async", args)
	if res.IsError {
		t.Fatalf("execute_code_async: %+v", res.Content)
	}
	var r execResult
	resultJSON(t, res, &r)
	if r.Status != "running" || r.ExecutionID == "" {
		t.Fatalf("start: %+v", r)
	}
	return r
}

// readUntilDone polls by cursor with long-polls, checking that seqs are
// contiguous (no loss, no duplication).
func readUntilDone(t *testing.T, c *client.Client, id string, onEvent func(status string, e jobEvent)) (string, []jobEvent) {
	t.Helper()
	var since int64
	var all []jobEvent
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		res := callTool(t, c, "get_execution_output", map[string]any{"execution_id": id, "since": since, "wait": true, "max_wait_s": 10})
		if res.IsError {
			t.Fatalf("get_execution_output: %+v", res.Content)
		}
		var r execResult
		resultJSON(t, res, &r)
		if r.Dropped != 0 {
			t.Fatalf("dropped %d", r.Dropped)
		}
		for _, e := range r.Output {
			if e.Seq != since+1 {
				t.Fatalf("seq %d after %d", e.Seq, since)
			}
			since = e.Seq
			all = append(all, e)
			if onEvent != nil {
				onEvent(r.Status, e)
			}
		}
		if r.NextSince != since {
			t.Fatalf("next_since %d, last seq %d", r.NextSince, since)
		}
		if r.Status != "running" && !r.More {
			return r.Status, all
		}
	}
	t.Fatal("execution did not end in 60 s")
	return "", nil
}

func stdoutOf(events []jobEvent) string {
	var b strings.Builder
	for _, e := range events {
		if e.Type == "stdout" {
			b.WriteString(e.Data)
		}
	}
	return b.String()
}

func TestJobStreamsByCursor(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		r := startAsync(t, c, map[string]any{"command": `for i in 1 2 3 4 5; do echo "line $i"; sleep 1; done`})
		firstWhileRunning := false
		status, events := readUntilDone(t, c, r.ExecutionID, func(status string, e jobEvent) {
			if e.Type == "stdout" && strings.Contains(e.Data, "line 1") && status == "running" {
				firstWhileRunning = true
			}
		})
		if status != "completed" {
			t.Fatalf("status %s", status)
		}
		if got := stdoutOf(events); got != "line 1\nline 2\nline 3\nline 4\nline 5\n" {
			t.Fatalf("stdout %q", got)
		}
		if !firstWhileRunning {
			t.Error("line 1 was not readable while the job ran")
		}
		if events[0].Type != "ready" || events[len(events)-1].Type != "exit" || *events[len(events)-1].Code != 0 {
			t.Fatalf("events %+v", events)
		}
		// Reading again from a cursor returns exactly the tail.
		res := callTool(t, c, "get_execution_output", map[string]any{"execution_id": r.ExecutionID, "since": events[len(events)-2].Seq})
		var tail execResult
		resultJSON(t, res, &tail)
		if len(tail.Output) != 1 || tail.Output[0].Seq != events[len(events)-1].Seq {
			t.Fatalf("tail %+v", tail)
		}
	})
}

// A long-poll gathers output that arrives within its window: a job
// printing ten lines at intervals is read in a few calls, not eleven.
func TestJobOutputGatheredPerCall(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		r := startAsync(t, c, map[string]any{"command": `for i in $(seq 1 10); do echo "line $i"; sleep 0.05; done`})
		var since int64
		var out strings.Builder
		calls := 0
		for {
			calls++
			var page execResult
			resultJSON(t, callTool(t, c, "get_execution_output", map[string]any{"execution_id": r.ExecutionID, "since": since, "wait": true, "max_wait_s": 10}), &page)
			for _, e := range page.Output {
				if e.Seq != since+1 {
					t.Fatalf("seq %d after %d", e.Seq, since)
				}
				since = e.Seq
				if e.Type == "stdout" {
					out.WriteString(e.Data)
				}
			}
			if page.Status != "running" && !page.More {
				break
			}
			if calls > 30 {
				t.Fatal("the job did not end")
			}
		}
		if strings.Count(out.String(), "line ") != 10 || !strings.HasSuffix(out.String(), "line 10\n") {
			t.Fatalf("stdout %q", out.String())
		}
		if calls > 6 {
			t.Fatalf("%d calls for 10 lines printed 50 ms apart: output was not gathered", calls)
		}
	})
}

func TestJobInteractiveStdinAndCancel(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		r := startAsync(t, c, map[string]any{"command": `read -r name; echo "hello $name"; read -r n; echo "sum $((n + 1))"`, "interactive": true})
		for _, in := range []string{"world\n", "41\n"} {
			res := callTool(t, c, "send_stdin", map[string]any{"execution_id": r.ExecutionID, "input_data": in})
			if res.IsError {
				t.Fatalf("send_stdin: %+v", res.Content)
			}
		}
		status, events := readUntilDone(t, c, r.ExecutionID, nil)
		if status != "completed" || stdoutOf(events) != "hello world\nsum 42\n" {
			t.Fatalf("%s %q", status, stdoutOf(events))
		}
		mustToolError(t, callTool(t, c, "send_stdin", map[string]any{"execution_id": r.ExecutionID, "input_data": "late\n"}), "CONFLICT")

		// cancel_execution: SIGTERM reaches a trap, which exits 7.
		trap := startAsync(t, c, map[string]any{"session_id": r.SessionID, "command": `trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.1; done`})
		readFor(t, c, trap.ExecutionID, "ready")
		res := callTool(t, c, "cancel_execution", map[string]any{"execution_id": trap.ExecutionID})
		var st struct {
			Status   string `json:"status"`
			ExitCode *int   `json:"exit_code"`
		}
		resultJSON(t, res, &st)
		if st.Status != "cancelled" || st.ExitCode == nil || *st.ExitCode != 7 {
			t.Fatalf("cancel: %+v", st)
		}
		_, events = readUntilDone(t, c, trap.ExecutionID, nil)
		if !strings.Contains(stdoutOf(events), "got-term") || events[len(events)-1].Type != "cancelled" {
			t.Fatalf("events %+v", events)
		}
		// The session still works after the job (nothing was swept wrongly).
		sync := callTool(t, c, "execute_code", map[string]any{"session_id": r.SessionID, "command": "echo after; exit 3"})
		var done execResult
		resultJSON(t, sync, &done)
		if done.Status != "failed" || done.ExitCode == nil || *done.ExitCode != 3 || stdoutOf(done.Output) != "after\n" {
			t.Fatalf("execute_code: %+v", done)
		}
	})
}

// readFor long-polls until some stdout contains want.
func readFor(t *testing.T, c *client.Client, id, want string) {
	t.Helper()
	var since int64
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var r execResult
		resultJSON(t, callTool(t, c, "get_execution_output", map[string]any{"execution_id": id, "since": since, "wait": true, "max_wait_s": 5}), &r)
		for _, e := range r.Output {
			if strings.Contains(e.Data, want) {
				return
			}
		}
		since = r.NextSince
	}
	t.Fatalf("%q never appeared", want)
}

func TestJobConcurrencyLimits(t *testing.T) {
	backends(t, map[string]string{"SANDBOX_MAX_CONCURRENT": "2", "SANDBOX_MAX_PER_SESSION": "1"}, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		a := startAsync(t, c, map[string]any{"session_id": "lim-a", "command": "sleep 60"})
		e := mustToolError(t, callTool(t, c, "execute_code_async", map[string]any{"session_id": "lim-a", "command": "true"}), "QUOTA_EXCEEDED")
		if !e.Retryable || !strings.Contains(e.Message, "session") {
			t.Fatalf("per-session refusal: %+v", e)
		}
		startAsync(t, c, map[string]any{"session_id": "lim-b", "command": "sleep 60"})
		e = mustToolError(t, callTool(t, c, "execute_code_async", map[string]any{"session_id": "lim-c", "command": "true"}), "QUOTA_EXCEEDED")
		if !strings.Contains(e.Message, "broker") {
			t.Fatalf("global refusal: %+v", e)
		}
		callTool(t, c, "cancel_execution", map[string]any{"execution_id": a.ExecutionID, "force": true})
		startAsync(t, c, map[string]any{"session_id": "lim-c", "command": "true"})
	})
}

func TestJobSurvivesBrokerRestart(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		r := startAsync(t, c, map[string]any{"command": `echo before-restart; sleep 120`})
		readFor(t, c, r.ExecutionID, "before-restart")
		done := callTool(t, c, "execute_code", map[string]any{"session_id": r.SessionID, "command": "echo finished-before"})
		var fin execResult
		resultJSON(t, done, &fin)
		b.Kill()
		b2 := startBackend(t, backend, BrokerOpts{Root: b.Root})
		c2 := b2.Client(t, testToken)
		var st struct {
			Status string `json:"status"`
			Error  string `json:"error"`
		}
		resultJSON(t, callTool(t, c2, "get_execution_status", map[string]any{"execution_id": r.ExecutionID}), &st)
		if st.Status != "error" || !strings.Contains(st.Error, "restarted") {
			t.Fatalf("status after restart: %+v", st)
		}
		var out execResult
		resultJSON(t, callTool(t, c2, "get_execution_output", map[string]any{"execution_id": r.ExecutionID}), &out)
		if !strings.Contains(stdoutOf(out.Output), "before-restart") || out.Output[len(out.Output)-1].Type != "error" {
			t.Fatalf("output after restart: %+v", out)
		}
		resultJSON(t, callTool(t, c2, "get_execution_status", map[string]any{"execution_id": fin.ExecutionID}), &st)
		if st.Status != "completed" {
			t.Fatalf("finished job after restart: %+v", st)
		}
		var list struct {
			Executions []struct {
				ID string `json:"execution_id"`
			} `json:"executions"`
		}
		resultJSON(t, callTool(t, c2, "list_executions", map[string]any{"session_id": r.SessionID}), &list)
		if len(list.Executions) != 2 {
			t.Fatalf("list: %+v", list)
		}
	})
}

func TestJobArgumentsRefused(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		cases := []struct {
			args map[string]any
			code string
		}{
			{map[string]any{"command": "env", "environment": map[string]any{"LD_PRELOAD": "/x.so"}}, "INVALID_INPUT"},
			{map[string]any{"command": "env", "environment": map[string]any{"HTTPS_PROXY": "http://evil"}}, "INVALID_INPUT"},
			{map[string]any{"command": "env", "environment": map[string]any{"bad-name": "1"}}, "INVALID_INPUT"},
			{map[string]any{"command": "pwd", "working_directory": "../etc"}, "PATH_TRAVERSAL"},
			{map[string]any{"command": "pwd", "working_directory": "/etc"}, "PATH_TRAVERSAL"},
			{map[string]any{"command": "x", "sandbox_config": map[string]any{"network": "everything"}}, "INVALID_INPUT"},
			{map[string]any{"command": "x", "sandbox_config": map[string]any{"network": map[string]any{"allowed_domains": []string{"10.0.0.1/8"}}}}, "INVALID_INPUT"},
			{map[string]any{"command": "x", "timeout_seconds": 100000}, "INVALID_INPUT"},
		}
		for _, tc := range cases {
			mustToolError(t, callTool(t, c, "execute_code", tc.args), tc.code)
		}
		mustToolError(t, callTool(t, c, "get_execution_status", map[string]any{"execution_id": "exec_" + strings.Repeat("a", 32)}), "SANDBOX_NOT_FOUND")

		// A working directory inside the workspace, and the environment, reach the command.
		var r execResult
		resultJSON(t, callTool(t, c, "execute_code", map[string]any{"command": "mkdir -p sub/dir && cd sub/dir && pwd"}), &r)
		resultJSON(t, callTool(t, c, "execute_code", map[string]any{"session_id": r.SessionID, "command": `pwd; echo "$GREETING"`,
			"working_directory": "sub/dir", "environment": map[string]any{"GREETING": "hi there"}}), &r)
		if out := stdoutOf(r.Output); !strings.HasSuffix(strings.Split(out, "\n")[0], "/sub/dir") || !strings.Contains(out, "hi there") {
			t.Fatalf("cwd/env: %q", out)
		}
		// A symlink out of the workspace is not a working directory.
		resultJSON(t, callTool(t, c, "execute_code", map[string]any{"session_id": r.SessionID, "command": "ln -s /etc escape"}), &r)
		res := callTool(t, c, "execute_code", map[string]any{"session_id": r.SessionID, "command": "pwd", "working_directory": "escape"})
		if !res.IsError {
			resultJSON(t, res, &r)
			if strings.Contains(stdoutOf(r.Output), "/etc") {
				t.Fatalf("working directory followed a symlink out: %+v", r)
			}
		}
	})
}

func TestJobEgressPolicy(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		probe := `python3 - <<'EOF'
import os, urllib.request, urllib.error
print("proxy=" + ("set" if os.environ.get("HTTPS_PROXY") else "unset"))
try:
    urllib.request.urlopen("http://blocked.example.net/", timeout=10)
    print("fetched")
except urllib.error.HTTPError as e:
    print("http", e.code, e.read().decode()[:200])
except Exception as e:
    print("error", type(e).__name__)
EOF`
		var r execResult
		resultJSON(t, callTool(t, c, "execute_code", map[string]any{"command": probe}), &r)
		if out := stdoutOf(r.Output); !strings.Contains(out, "proxy=unset") || !strings.Contains(out, "error") {
			t.Fatalf("network none: %q", out)
		}
		resultJSON(t, callTool(t, c, "execute_code", map[string]any{"command": probe,
			"sandbox_config": map[string]any{"network": map[string]any{"allowed_domains": []string{"*.example.org"}}}}), &r)
		out := stdoutOf(r.Output)
		if !strings.Contains(out, "proxy=set") || !strings.Contains(out, "http 403") || !strings.Contains(out, "blocked.example.net") ||
			!strings.Contains(out, "(rule: allowed_domains [*.example.org])") {
			t.Fatalf("allow-list: %q", out)
		}
	})
}

// An HTTPS client through the proxy sees only "Tunnel connection failed:
// 403"; the tool result says which host was refused and by which rule,
// in the output stream and in egress_denied, for execute_code,
// get_execution_output and get_execution_status. The hosts are refused
// before any DNS lookup, so no network is needed.
func TestEgressDenialShown(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		probe := `python3 - <<'EOF'
import urllib.request
for url in ["https://blocked.example.net/", "https://blocked.example.net/again", "https://bad.example.org/"]:
    try:
        urllib.request.urlopen(url, timeout=10)
        print("fetched", url)
    except Exception as e:
        print("error", e)
EOF`
		type denial struct {
			Host, Reason, Rule string
			Port, Count        int
		}
		type withDenials struct {
			execResult
			EgressDenied []denial `json:"egress_denied"`
			Hint         string   `json:"hint"`
		}
		var r withDenials
		res := callTool(t, c, "execute_code", map[string]any{"command": probe, "sandbox_config": map[string]any{
			"network": map[string]any{"allowed_domains": []string{"*.example.org"}, "denied_domains": []string{"bad.example.org"}}}})
		if res.IsError {
			t.Fatalf("execute_code: %+v", res.Content)
		}
		resultJSON(t, res, &r)
		if out := stdoutOf(r.Output); !strings.Contains(out, "Tunnel connection failed: 403") || strings.Contains(out, "fetched") {
			t.Fatalf("probe output %q", out)
		}
		want := []denial{
			{Host: "blocked.example.net", Port: 443, Reason: "not_in_allowed_domains", Rule: "allowed_domains [*.example.org]", Count: 2},
			{Host: "bad.example.org", Port: 443, Reason: "in_denied_domains", Rule: `denied_domains entry "bad.example.org"`, Count: 1},
		}
		check := func(what string, got []denial) {
			t.Helper()
			if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
				t.Fatalf("%s: egress_denied %+v, want %+v", what, got, want)
			}
		}
		check("execute_code", r.EgressDenied)
		if !strings.Contains(r.Hint, "egress_denied") {
			t.Errorf("hint %q", r.Hint)
		}
		var logged []jobEvent
		for _, e := range r.Output {
			if e.Type == "egress_denied" {
				logged = append(logged, e)
			}
		}
		if len(logged) != 2 || !strings.Contains(logged[0].Message, "blocked.example.net:443") {
			t.Fatalf("egress_denied events %+v", logged)
		}
		var page withDenials
		resultJSON(t, callTool(t, c, "get_execution_output", map[string]any{"execution_id": r.ExecutionID}), &page)
		check("get_execution_output", page.EgressDenied)
		var status struct {
			EgressDenied []denial `json:"egress_denied"`
		}
		resultJSON(t, callTool(t, c, "get_execution_status", map[string]any{"execution_id": r.ExecutionID}), &status)
		check("get_execution_status", status.EgressDenied)
	})
}
