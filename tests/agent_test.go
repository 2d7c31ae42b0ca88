package tests

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
	fake "github.com/sandbox-broker/sandbox-broker/services/modelgw/anthropicfake"
)

// The real Claude Code CLI (and OpenCode) in the agent runner, driven by a
// scripted fake of the Messages API behind the broker's model gateway.

// realModelKey is the operator's key: the fake accepts only it, and it
// must never reach a sandbox.
const realModelKey = "sk-ant-api03-OPERATORKEY-never-in-a-sandbox-0123456789abcdef"

func requireAgentImage(t testing.TB) {
	t.Helper()
	requireDocker(t)
	if err := exec.Command("docker", "image", "inspect", "sandbox-broker/runner-agent:latest").Run(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("the agent runner image is missing (required in CI: .ci/run builds it with runners/build.sh)")
		}
		t.Skip("the agent runner image is missing; run runners/build.sh agent")
	}
}

// Each case's prompt carries a marker; the script answers by it and by the
// turn, so one fake serves every task of the test.
const (
	caseSummary  = "[case:summary]"
	caseLeak     = "[case:leak]"
	caseNetwork  = "[case:network]"
	caseSleep    = "[case:sleep]"
	caseOpenCode = "[case:opencode]"
	caseTwoCalls = "[case:twocalls]"
)

func firstUserText(r fake.Request) string {
	if len(r.Messages) == 0 {
		return ""
	}
	var b strings.Builder
	for _, c := range r.Messages[0].Content {
		b.WriteString(c.Text)
	}
	return b.String()
}

// toolResult is the text of the last tool result, without the reminders
// Claude Code appends to it, or "".
func toolResult(r fake.Request) string {
	if res := r.LastToolResults(); len(res) > 0 {
		return reminders.ReplaceAllString(res[0].ResultText(), "")
	}
	return ""
}

var reminders = regexp.MustCompile(`(?s)\s*<system-reminder>.*?</system-reminder>\s*`)

// bash calls Claude Code's Bash tool with the longest tool timeout (10
// min), as an agent expecting slow work does: on a loaded machine the
// default 2 min can pass before pandas has imported.
func bash(cmd string) fake.Block {
	return fake.ToolUse("Bash", map[string]any{"command": cmd, "description": "run a command", "timeout": 600000})
}

func text(s string) fake.Reply { return fake.Reply{Content: []fake.Block{fake.Text(s)}} }

// agentScript answers each case. networkProbe is the shell line the
// network case runs (it names the broker's port, known only later).
func agentScript(networkProbe *string) fake.Script {
	var mu sync.Mutex
	return func(r fake.Request) fake.Reply {
		p := firstUserText(r)
		switch {
		case strings.Contains(p, caseSummary):
			switch r.Turn {
			case 0:
				return fake.Reply{Content: []fake.Block{fake.Text("I'll read the CSV first."),
					bash(`python3 -c 'import pandas as pd; d = pd.read_csv("data.csv"); print(f"rows={len(d)} mean_b={d.b.mean():.2f}")'`)}}
			case 1:
				// The summary is what the tool printed: only a real run
				// of the agent's tool can produce it.
				return fake.Reply{Content: []fake.Block{fake.ToolUse("Write", map[string]any{
					"file_path": "/mnt/data/summary.txt", "content": "Summary of data.csv: " + strings.TrimSpace(toolResult(r)) + "\n"})}}
			}
			var stats string
			for _, m := range r.Messages {
				for _, c := range m.Content {
					if c.Type == "tool_result" && strings.HasPrefix(c.ResultText(), "rows=") {
						stats = strings.TrimSpace(reminders.ReplaceAllString(c.ResultText(), ""))
					}
				}
			}
			return text("summary.txt is written: " + stats)
		case strings.Contains(p, caseLeak):
			if r.Turn == 0 {
				// Everything the sandbox could read the key from while the
				// agent runs: its environment and every process's.
				return fake.Reply{Content: []fake.Block{bash(`{ env; for p in /proc/[0-9]*; do tr '\0' '\n' < $p/environ; tr '\0' ' ' < $p/cmdline; echo; done; } > /mnt/data/dump.txt 2>/dev/null; echo "key=$ANTHROPIC_API_KEY"`)}}
			}
			return text("dumped; " + strings.TrimSpace(toolResult(r)))
		case strings.Contains(p, caseNetwork):
			mu.Lock()
			probe := *networkProbe
			mu.Unlock()
			if r.Turn == 0 {
				return fake.Reply{Content: []fake.Block{bash(probe)}}
			}
			return text("probed:\n" + toolResult(r))
		case strings.Contains(p, caseSleep):
			if r.Turn == 0 {
				return fake.Reply{Content: []fake.Block{fake.ToolUse("Bash", map[string]any{
					"command":     `python3 -c "import time; time.sleep(531)" & setsid python3 -c "import time; time.sleep(532)" & python3 -c "import time; time.sleep(533)"`,
					"description": "wait", "timeout": 600000})}}
			}
			return text("slept")
		case strings.Contains(p, caseOpenCode):
			if r.Turn == 0 {
				return fake.Reply{Content: []fake.Block{fake.ToolUse("bash", map[string]any{
					"command": `python3 -c 'import pandas as pd; print(len(pd.read_csv("data.csv")))' > /mnt/data/count.txt; cat /mnt/data/count.txt`, "description": "count rows"})}}
			}
			return text("OpenCode counted " + strings.TrimSpace(toolResult(r)) + " rows.")
		case strings.Contains(p, caseTwoCalls):
			if r.Turn == 0 {
				return fake.Reply{Content: []fake.Block{bash("echo one")}}
			}
			return text("two calls done")
		}
		return text("unknown case")
	}
}

type agentEnv struct {
	b      *Broker
	fake   *fake.Fake
	gh     *ghfake.Fake
	tokens map[string]string
	probe  *string
}

// startAgentBroker starts the fake model, a fake GitHub and a broker with
// agent tasks: alice is pro (tasks may use public egress), bob is free
// with a budget of one model request a day.
func startAgentBroker(t *testing.T) *agentEnv {
	t.Helper()
	requireAgentImage(t)
	probe := ""
	f := fake.New(fake.Options{Key: realModelKey, Script: agentScript(&probe)})
	t.Cleanup(f.Close)
	gh := ghfake.New()
	t.Cleanup(gh.Close)
	gh.AddRepo("acme", "site")
	gh.Grant(fineGrainedPAT, "acme", "site", true)
	repos, _ := json.Marshal([]map[string]any{{"repo_id": "site", "owner": "acme", "name": "site", "allowed_branches": []string{"sandbox/*"},
		"base_branch": "main", "token_env": "SITE_GITHUB_TOKEN"}})
	reposFile := filepath.Join(t.TempDir(), "repos.json")
	if err := os.WriteFile(reposFile, repos, 0o600); err != nil {
		t.Fatal(err)
	}
	tokensFile, tokens := writeTokens(t, map[string]string{"alice": "pro", "bob": "free"})
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{
		"SANDBOX_BACKEND": "docker", "SANDBOX_POOL_SIZE": "0", "MCP_TOKENS_FILE": tokensFile, "RATE_LIMIT_PER_MINUTE": "1000",
		"ANTHROPIC_API_KEY": realModelKey, "ANTHROPIC_API_URL": f.URL,
		"AGENT_TIERS":       `{"pro": {"network": "public"}, "free": {"requests_per_day": 1}}`,
		"GITHUB_REPOS_FILE": reposFile, "GITHUB_API_URL": gh.URL(), "SITE_GITHUB_TOKEN": fineGrainedPAT,
	}})
	u, _ := url.Parse(b.URL)
	probe = networkProbe(u.Port(), f.URL)
	return &agentEnv{b: b, fake: f, gh: gh, tokens: tokens, probe: &probe}
}

// networkProbe asks, through the job's proxy, for the metadata service, a
// private address, the broker's own port under three loopback names, the
// fake model API directly, and paths of the gateway that are not model
// calls; then the broker's port with the proxy bypassed.
func networkProbe(brokerPort, fakeURL string) string {
	targets := []string{
		"http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://127.0.0.1:" + brokerPort + "/healthz",
		"http://localhost:" + brokerPort + "/healthz", "http://[::1]:" + brokerPort + "/healthz", fakeURL + "/v1/messages",
		"http://model-gateway.invalid/mcp", "http://model-gateway.invalid/v1/models",
	}
	var b strings.Builder
	for _, u := range targets {
		fmt.Fprintf(&b, `printf '%%s %%s\n' '%s' "$(curl -s -m 5 -o /dev/null -w '%%{http_code}' '%s')"; `, u, u)
	}
	fmt.Fprintf(&b, `printf 'direct %%s\n' "$(curl -s -m 3 --noproxy '*' -o /dev/null -w '%%{http_code}' http://127.0.0.1:%s/healthz)"`, brokerPort)
	return b.String()
}

type taskResult struct {
	ExecutionID     string   `json:"execution_id"`
	SessionID       string   `json:"session_id"`
	Status          string   `json:"status"`
	Output          string   `json:"output"`
	FilesCreated    []string `json:"files_created"`
	DurationSeconds float64  `json:"duration_seconds"`
	Error           string   `json:"error"`
	ErrorCode       string   `json:"error_code"`
	Network         string   `json:"network"`
	Commit          *struct {
		CommitSHA string `json:"commit_sha"`
		Branch    string `json:"branch"`
		PRURL     string `json:"pr_url"`
	} `json:"commit"`
	CommitError string `json:"commit_error"`
	// inline: execute_task answered with the outcome (not followed after).
	inline bool
	Files  []struct {
		Name string `json:"name"`
		URI  string `json:"uri"`
	} `json:"files"`
}

type taskEvent struct {
	jobEvent
	Tool    string          `json:"tool"`
	IsError bool            `json:"is_error"`
	Detail  json.RawMessage `json:"detail"`
}

// runTask runs a task to its end: past execute_task's 50 s wait (a loaded
// machine) it follows the execution and reads the outcome from its task
// event, as a client would.
func runTask(t testing.TB, c *client.Client, args map[string]any) (taskResult, string) {
	t.Helper()
	res := callTool(t, c, "execute_task", args)
	if res.IsError {
		t.Fatalf("execute_task: %+v", res.Content)
	}
	var r taskResult
	resultJSON(t, res, &r)
	raw, _ := json.Marshal(res)
	if r.Status != "running" {
		r.inline = true
		return r, string(raw)
	}
	return followTask(t, c, r)
}

// followTask long-polls a running task until it ends and returns the
// outcome its task event carries.
func followTask(t testing.TB, c *client.Client, r taskResult) (taskResult, string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Minute); time.Now().Before(deadline); {
		var page struct {
			Status string `json:"status"`
		}
		resultJSON(t, callTool(t, c, "get_execution_output", map[string]any{"execution_id": r.ExecutionID, "wait": true, "max_wait_s": 50, "since": 1 << 40}), &page)
		if page.Status == "running" {
			continue
		}
		_, evs, _ := taskEvents(t, c, r.ExecutionID)
		for _, e := range evs {
			if e.Type == "task" {
				var out taskResult
				if err := json.Unmarshal(e.Detail, &out); err != nil {
					t.Fatal(err)
				}
				return out, string(e.Detail)
			}
		}
		t.Fatalf("execution %s ended (%s) without a task event", r.ExecutionID, page.Status)
	}
	t.Fatalf("task %s did not end", r.ExecutionID)
	return r, ""
}

// taskEvents reads all of an execution's events.
func taskEvents(t testing.TB, c *client.Client, id string) (string, []taskEvent, string) {
	t.Helper()
	res := callTool(t, c, "get_execution_output", map[string]any{"execution_id": id})
	if res.IsError {
		t.Fatalf("get_execution_output: %+v", res.Content)
	}
	var r struct {
		Status string      `json:"status"`
		Output []taskEvent `json:"output"`
	}
	resultJSON(t, res, &r)
	raw, _ := json.Marshal(res)
	return r.Status, r.Output, string(raw)
}

func eventTypes(evs []taskEvent) string {
	var out []string
	for _, e := range evs {
		s := e.Type
		if e.Tool != "" {
			s += ":" + e.Tool
		}
		out = append(out, s)
	}
	return strings.Join(out, ",")
}

func getFile(t testing.TB, c *client.Client, session, path string) []byte {
	t.Helper()
	res := callTool(t, c, "get_files", map[string]any{"session_id": session, "paths": []string{path}})
	if res.IsError {
		t.Fatalf("get_files: %+v", res.Content)
	}
	var r struct {
		Files []struct {
			Path, Content, MIMEType, URI, Error string
			SizeBytes                           int64 `json:"size_bytes"`
		} `json:"files"`
	}
	resultJSON(t, res, &r)
	f := r.Files[0]
	data, err := base64.StdEncoding.DecodeString(f.Content)
	if err != nil || f.Error != "" || f.SizeBytes != int64(len(data)) || !strings.HasPrefix(f.URI, "sandbox://"+session+"/") {
		t.Fatalf("get_files %s: %+v (%v)", path, f, err)
	}
	return data
}

// agentContainers lists the broker's agent-runner containers.
func agentContainers(t testing.TB, root string) []string {
	t.Helper()
	out, err := exec.Command("docker", "ps", "-q", "--filter", "label=sandbox.root="+root, "--filter", "label=sandbox.language=agent").Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(out))
}

// processesIn lists a container's processes as the host sees them.
func processesIn(t testing.TB, id string) string {
	t.Helper()
	out, err := exec.Command("docker", "top", id, "-eo", "pid,args").CombinedOutput()
	if err != nil {
		t.Fatalf("docker top: %v %s", err, out)
	}
	return string(out)
}

func TestAgentTasks(t *testing.T) {
	env := startAgentBroker(t)
	alice := env.b.Client(t, env.tokens["alice"])
	csv := base64.StdEncoding.EncodeToString([]byte("a,b\n1,2\n3,4\n5,6\n"))

	t.Run("summary from an uploaded CSV, committed to GitHub", func(t *testing.T) {
		r, raw := runTask(t, alice, map[string]any{
			"task":  caseSummary + " Summarise data.csv into summary.txt.",
			"files": []map[string]any{{"path": "data.csv", "content": csv}}, "timeout": 120,
			"repo_id": "site", "branch": "sandbox/summary", "create_pr": true,
		})
		if r.Status != "completed" || r.Output != "summary.txt is written: rows=3 mean_b=4.00" || r.Error != "" {
			t.Fatalf("result %s", raw)
		}
		if strings.Join(r.FilesCreated, ",") != "summary.txt" || r.inline && (len(r.Files) != 1 || r.Files[0].URI != "sandbox://"+r.SessionID+"/summary.txt") {
			t.Fatalf("files %s", raw)
		}
		if got := string(getFile(t, alice, r.SessionID, "summary.txt")); got != "Summary of data.csv: rows=3 mean_b=4.00\n" {
			t.Fatalf("summary.txt = %q", got)
		}
		if r.Commit == nil || r.Commit.CommitSHA == "" || r.Commit.PRURL == "" {
			t.Fatalf("commit %s", raw)
		}
		if data, ok := env.gh.File("acme", "site", "sandbox/summary", "summary.txt"); !ok || string(data) != "Summary of data.csv: rows=3 mean_b=4.00\n" {
			t.Fatalf("GitHub has %q %v", data, ok)
		}
		status, evs, _ := taskEvents(t, alice, r.ExecutionID)
		want := "ready,assistant,tool_use:Bash,tool_result,tool_use:Write,tool_result,assistant,result,task,exit"
		if status != "completed" || eventTypes(evs) != want {
			t.Fatalf("status %s events %s, want %s", status, eventTypes(evs), want)
		}
		if evs[3].Data != "rows=3 mean_b=4.00" || !strings.Contains(evs[2].Data, "read_csv") {
			t.Fatalf("tool events %+v", evs[2:4])
		}
		// Every model call went out with the operator's key, from the
		// real CLI, and each is one intent and one outcome audit row with
		// the model and token counts, never the prompt.
		for _, q := range env.fake.Requests() {
			if q.APIKey != realModelKey || !strings.HasPrefix(q.UserAgent, "claude-cli/") {
				t.Fatalf("upstream request %+v", q)
			}
		}
		rows := auditRows(t, env.b.Root, audit.Filter{Tool: "model.messages"})
		calls := map[string]bool{}
		for _, row := range rows {
			if row.Phase == "intent" && strings.Contains(string(row.Params), r.ExecutionID) {
				calls[row.CallID] = true
			}
		}
		var mine []audit.Entry
		for _, row := range rows {
			if calls[row.CallID] {
				mine = append(mine, row)
			}
		}
		if len(calls) != 3 || len(mine) != 6 {
			t.Fatalf("%d model calls with %d audit rows for the task, want 3 with 6: %+v", len(calls), len(mine), mine)
		}
		for _, row := range rows {
			if strings.Contains(string(row.Params), "Summarise") || strings.Contains(string(row.Params), realModelKey) {
				t.Fatalf("audit row leaks: %s", row.Params)
			}
		}
		var out struct {
			Model        string `json:"model"`
			Status       int    `json:"status"`
			InputTokens  int    `json:"input_tokens"`
			OutputTokens int    `json:"output_tokens"`
		}
		_ = json.Unmarshal(mine[1].Params, &out)
		if mine[1].Phase != "outcome" || mine[1].Outcome != "success" || mine[1].Principal != "alice" ||
			out.Model != "claude-sonnet-4-5" || out.Status != 200 || out.InputTokens < 1000 || out.OutputTokens < 1 {
			t.Fatalf("outcome row %+v %s", mine[1], mine[1].Params)
		}
	})

	t.Run("the real key is in no environment, file, /proc or output", func(t *testing.T) {
		r, raw := runTask(t, alice, map[string]any{"task": caseLeak + " dump", "timeout": 120})
		if r.Status != "completed" {
			t.Fatalf("result %s", raw)
		}
		dump := string(getFile(t, alice, r.SessionID, "dump.txt"))
		// The dump is real: it holds the agent's environment, whose key is
		// the placeholder, and the CLI's command line.
		if !strings.Contains(dump, "ANTHROPIC_API_KEY=sandbox-placeholder-key") || !strings.Contains(dump, "claude") {
			t.Fatalf("dump lacks the agent's environment:\n%.2000s", dump)
		}
		_, _, evRaw := taskEvents(t, alice, r.ExecutionID)
		for what, s := range map[string]string{"dump": dump, "result": raw, "events": evRaw} {
			for _, secret := range []string{realModelKey, fineGrainedPAT, "[REDACTED]"} {
				if strings.Contains(s, secret) {
					t.Fatalf("%s contains %q", what, secret)
				}
			}
		}
		// The agent printed the placeholder; it is shown as it is, and it
		// is useless against the API itself.
		if !strings.Contains(r.Output, "key=sandbox-placeholder-key-useless-outside-the-gateway") {
			t.Fatalf("output %q", r.Output)
		}
		req, _ := http.NewRequest(http.MethodPost, env.fake.URL+"/v1/messages", strings.NewReader(`{"model":"claude-sonnet-4-5","max_tokens":5,"messages":[{"role":"user","content":"x"}]}`))
		req.Header.Set("x-api-key", "sandbox-placeholder-key-useless-outside-the-gateway")
		req.Header.Set("anthropic-version", "2023-06-01")
		if resp := do(t, req); resp.StatusCode != http.StatusUnauthorized {
			t.Fatalf("the placeholder key was accepted by the API: %d", resp.StatusCode)
		}
		// What the agent may have written anywhere writable in its
		// container (the root filesystem is read-only).
		for _, id := range agentContainers(t, env.b.Root) {
			cmd := exec.Command("docker", "exec", "-i", "--user", "0", id, "sh", "-c", "grep -rlsF -f /dev/stdin /tmp /mnt/data /run/sandbox /home; echo scanned")
			cmd.Stdin = strings.NewReader(realModelKey + "\n" + fineGrainedPAT + "\n")
			out, _ := cmd.CombinedOutput()
			if strings.TrimSpace(string(out)) != "scanned" {
				t.Fatalf("container %s: %s", id, out)
			}
		}
	})

	t.Run("private addresses, metadata and the broker stay out of reach in public mode", func(t *testing.T) {
		r, raw := runTask(t, alice, map[string]any{"task": caseNetwork + " probe", "timeout": 120, "network": "public"})
		if r.Status != "completed" || r.Network != "public" {
			t.Fatalf("result %s", raw)
		}
		lines := strings.Split(strings.TrimSpace(strings.TrimPrefix(r.Output, "probed:\n")), "\n")
		if len(lines) != 9 {
			t.Fatalf("probe output %q", r.Output)
		}
		for _, l := range lines {
			target, code, _ := strings.Cut(l, " ")
			want := "403" // refused by the egress proxy
			switch {
			case target == "direct":
				want = "000" // no network interface but loopback
			case strings.Contains(target, "model-gateway.invalid"):
				want = "404" // the gateway serves model calls only
			}
			if code != want {
				t.Errorf("%s answered %s, want %s", target, code, want)
			}
		}
		// The mode the call chose is in its audit row.
		found := false
		var seen []string
		for _, row := range auditRows(t, env.b.Root, audit.Filter{Tool: "execute_task"}) {
			var p struct {
				Network struct {
					Mode string `json:"mode"`
				} `json:"network"`
			}
			if row.Phase == "intent" && json.Unmarshal(row.Params, &p) == nil && p.Network.Mode == "public" {
				found = true
			}
			seen = append(seen, string(row.Phase)+" "+string(row.Params))
		}
		if !found {
			t.Fatalf("no execute_task audit row records network public: %q", seen)
		}
	})

	t.Run("timeout stops the agent and everything it started", func(t *testing.T) {
		start := time.Now()
		r, raw := runTask(t, alice, map[string]any{"task": caseSleep + " wait", "timeout": 10})
		if r.Status != "timeout" || !strings.Contains(r.Error, "timeout") || time.Since(start) > 45*time.Second {
			t.Fatalf("after %s: %s", time.Since(start), raw)
		}
		status, _, _ := taskEvents(t, alice, r.ExecutionID)
		if status != "timeout" {
			t.Fatalf("execution status %s", status)
		}
		for _, id := range agentContainers(t, env.b.Root) {
			if ps := processesIn(t, id); strings.Contains(ps, "time.sleep(53") || strings.Contains(ps, "claude") {
				t.Fatalf("left running in %s:\n%s", id, ps)
			}
		}
	})

	t.Run("cancel stops the agent and everything it started", func(t *testing.T) {
		done := make(chan taskResult, 1)
		go func() {
			c := env.b.Client(t, env.tokens["alice"])
			res := callTool(t, c, "execute_task", map[string]any{"task": caseSleep + " wait", "timeout": 300})
			var r taskResult
			resultJSON(t, res, &r)
			done <- r
		}()
		var id string
		for deadline := time.Now().Add(40 * time.Second); id == "" && time.Now().Before(deadline); {
			var list struct {
				Executions []struct {
					ID      string `json:"execution_id"`
					Status  string `json:"status"`
					Network string `json:"network"`
				} `json:"executions"`
			}
			resultJSON(t, callTool(t, alice, "list_executions", nil), &list)
			for _, e := range list.Executions {
				if e.Status == "running" && strings.HasPrefix(e.Network, "model-gateway") {
					id = e.ID
				}
			}
			time.Sleep(200 * time.Millisecond) // polling a list, not waiting for an effect
		}
		if id == "" {
			t.Fatal("the task never showed as running")
		}
		// Once the agent's sleeps run, cancel: the whole tree must go.
		waitFor(t, 60*time.Second, func() bool {
			for _, c := range agentContainers(t, env.b.Root) {
				if strings.Contains(processesIn(t, c), "time.sleep(533)") {
					return true
				}
			}
			return false
		})
		res := callTool(t, alice, "cancel_execution", map[string]any{"execution_id": id})
		if res.IsError {
			t.Fatalf("cancel: %+v", res.Content)
		}
		r := <-done
		if r.Status != "failed" || !strings.Contains(r.Error, "cancelled") {
			t.Fatalf("task %+v", r)
		}
		if status, _, _ := taskEvents(t, alice, id); status != "cancelled" {
			t.Fatalf("execution status %s", status)
		}
		for _, c := range agentContainers(t, env.b.Root) {
			if ps := processesIn(t, c); strings.Contains(ps, "time.sleep(53") || strings.Contains(ps, "claude") {
				t.Fatalf("left running in %s:\n%s", c, ps)
			}
		}
	})

	t.Run("opencode", func(t *testing.T) {
		r, raw := runTask(t, alice, map[string]any{"task": caseOpenCode + " count the rows of data.csv", "agent": "opencode",
			"files": []map[string]any{{"path": "data.csv", "content": csv}}, "timeout": 120})
		if r.Status != "completed" || r.Output != "OpenCode counted 3 rows." || strings.Join(r.FilesCreated, ",") != "count.txt" {
			t.Fatalf("result %s", raw)
		}
		_, evs, raw := taskEvents(t, alice, r.ExecutionID)
		// OpenCode tries registry.npmjs.org at start; the task's network
		// (none) refuses it, and it carries on.
		evs = slices.DeleteFunc(evs, func(e taskEvent) bool { return e.Type == "egress_denied" })
		if got := eventTypes(evs); got != "ready,tool_use:bash,tool_result,assistant,result,task,exit" || strings.Contains(raw, `"host":"model-gateway.invalid"`) {
			t.Fatalf("events %s: %s", got, raw)
		}
	})

	t.Run("budget exhaustion", func(t *testing.T) {
		bob := env.b.Client(t, env.tokens["bob"])
		r, raw := runTask(t, bob, map[string]any{"task": caseTwoCalls + " go", "timeout": 120})
		if r.Status != "failed" || r.ErrorCode != "QUOTA_EXCEEDED" || !strings.Contains(r.Error, "request budget (1 requests)") {
			t.Fatalf("result %s", raw)
		}
		e := mustToolError(t, callTool(t, bob, "execute_task", map[string]any{"task": caseTwoCalls + " again"}), "QUOTA_EXCEEDED")
		if !e.Retryable || e.RetryAfterS == nil {
			t.Fatalf("refusal %+v", e)
		}
	})

	t.Run("bad input is refused before anything starts", func(t *testing.T) {
		before := len(agentContainers(t, env.b.Root))
		ws, _ := os.ReadDir(filepath.Join(env.b.Root, "workspaces"))
		big := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte("x"), 11<<19)) // two make 11 MiB
		bob := env.b.Client(t, env.tokens["bob"])
		for _, c := range []struct {
			name string
			c    *client.Client
			args map[string]any
			code string
			msg  string
		}{
			{"path outside", alice, map[string]any{"task": "x", "files": []map[string]any{{"path": "../etc/x", "content": csv}}}, "PATH_TRAVERSAL", ""},
			{"absolute path", alice, map[string]any{"task": "x", "files": []map[string]any{{"path": "/etc/passwd", "content": csv}}}, "PATH_TRAVERSAL", ""},
			{"not base64", alice, map[string]any{"task": "x", "files": []map[string]any{{"path": "a.txt", "content": "%%%not base64"}}}, "INVALID_INPUT", "base64"},
			{"over 10 MiB", alice, map[string]any{"task": "x", "files": []map[string]any{{"path": "a", "content": big}, {"path": "b", "content": big}}}, "FILE_SIZE_EXCEEDED", "10485760"},
			{"task too long", alice, map[string]any{"task": strings.Repeat("t", 32769)}, "INVALID_INPUT", "at most 32768"},
			{"timeout over the tier", bob, map[string]any{"task": "x", "timeout": 301}, "INVALID_INPUT", "at most 300 seconds"},
			{"model", alice, map[string]any{"task": "x", "model": "claude-opus-9"}, "INVALID_INPUT", "allowed: claude-sonnet-4-5, claude-haiku-4-5"},
			{"network beyond the tier", bob, map[string]any{"task": "x", "network": "public"}, "PERMISSION_DENIED", "none"},
			{"repository outside the allow-list", alice, map[string]any{"task": "x", "repo_id": "other", "branch": "sandbox/x"}, "INVALID_REPO", ""},
			{"base branch", alice, map[string]any{"task": "x", "repo_id": "site", "branch": "main"}, "INVALID_BRANCH", ""},
		} {
			e := mustToolError(t, callTool(t, c.c, "execute_task", c.args), c.code)
			if !strings.Contains(e.Message, c.msg) {
				t.Errorf("%s: %q lacks %q", c.name, e.Message, c.msg)
			}
		}
		after, _ := os.ReadDir(filepath.Join(env.b.Root, "workspaces"))
		if n := len(agentContainers(t, env.b.Root)); n != before || len(after) != len(ws) {
			t.Fatalf("refused calls started something: containers %d→%d, workspaces %d→%d", before, n, len(ws), len(after))
		}
	})

	t.Run("the agent's stream arrives as log and progress notifications", func(t *testing.T) {
		c := env.b.Client(t, env.tokens["alice"])
		var mu sync.Mutex
		logs := map[string][]string{}
		progress := 0
		c.OnNotification(func(n mcp.JSONRPCNotification) {
			mu.Lock()
			defer mu.Unlock()
			switch n.Method {
			case "notifications/message":
				logger, _ := n.Params.AdditionalFields["logger"].(string)
				data, _ := n.Params.AdditionalFields["data"].(string)
				logs[logger] = append(logs[logger], data)
			case "notifications/progress":
				progress++
			}
		})
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		//lint:ignore SA1019 the broker negotiates the legacy protocol, where setLevel asks for log notifications
		if err := c.SetLevel(ctx, mcp.SetLevelRequest{Params: mcp.SetLevelParams{Level: mcp.LoggingLevelDebug}}); err != nil {
			t.Fatal(err)
		}
		var req mcp.CallToolRequest
		req.Params.Name = "execute_task"
		req.Params.Arguments = map[string]any{"task": caseTwoCalls + " go", "timeout": 120}
		req.Params.Meta = &mcp.Meta{ProgressToken: "task"}
		res, err := c.CallTool(ctx, req)
		if err != nil || res.IsError {
			t.Fatalf("execute_task: %v %+v", err, res)
		}
		mu.Lock()
		defer mu.Unlock()
		if !slices.Contains(logs["sandbox.tool_use"], `Bash {"command":"echo one","description":"run a command","timeout":600000}`) ||
			len(logs["sandbox.tool_result"]) != 1 || !strings.HasPrefix(logs["sandbox.tool_result"][0], "one") ||
			!slices.Contains(logs["sandbox.result"], "two calls done") || progress < 1 {
			t.Fatalf("notifications: %d progress, logs %q", progress, logs)
		}
	})

	t.Run("the agent runner runs tasks only, with its own limits", func(t *testing.T) {
		var runners struct {
			Runners []struct{ Language string } `json:"runners"`
		}
		resultJSON(t, callTool(t, alice, "list_runners", nil), &runners)
		for _, r := range runners.Runners {
			if r.Language == "agent" {
				t.Fatal("list_runners offers the agent runner")
			}
		}
		mustToolError(t, callTool(t, alice, "run_code", map[string]any{"language": "agent", "code": "echo hi"}), "UNKNOWN_LANGUAGE")
		ids := agentContainers(t, env.b.Root)
		if len(ids) == 0 {
			t.Fatal("no agent container to inspect")
		}
		out, err := exec.Command("docker", "inspect", "-f", "{{.HostConfig.Memory}} {{.HostConfig.NanoCpus}} {{.HostConfig.NetworkMode}} {{.HostConfig.ReadonlyRootfs}}", ids[0]).Output()
		if err != nil || strings.TrimSpace(string(out)) != "4294967296 2000000000 none true" {
			t.Fatalf("agent container limits: %q %v", out, err)
		}
	})

	t.Run("cleanup_session is close_session", func(t *testing.T) {
		r, _ := runTask(t, alice, map[string]any{"task": caseTwoCalls + " go", "timeout": 120})
		if res := callTool(t, alice, "cleanup_session", map[string]any{"session_id": r.SessionID}); res.IsError {
			t.Fatalf("cleanup: %+v", res.Content)
		}
		mustToolError(t, callTool(t, alice, "get_files", map[string]any{"session_id": r.SessionID, "paths": []string{"x"}}), "SANDBOX_NOT_FOUND")
		mustToolError(t, callTool(t, alice, "close_session", map[string]any{"session_id": r.SessionID}), "SANDBOX_NOT_FOUND")
	})

	// After the cases above: executions, a time-out, errors (the cancelled
	// and the over-budget task).
	t.Run("metrics", func(t *testing.T) {
		metrics := get(t, env.b, env.tokens["alice"], "/metrics")
		for _, want := range []string{`sandbox_executions_total{backend="docker",language="agent"}`, `sandbox_timeouts_total{backend="docker",language="agent"} 1`,
			`sandbox_errors_total{backend="docker",language="agent"}`, `sandbox_duration_seconds_count{backend="docker",language="agent"}`, "sandbox_active_sessions "} {
			if !strings.Contains(metrics, want) {
				t.Errorf("metrics lack %s:\n%s", want, grepLines(metrics, "sandbox_"))
			}
		}
	})
}

// waitFor polls cond (an outside effect: a process appearing) until it holds.
func waitFor(t *testing.T, d time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("condition not met within %s", d)
}
