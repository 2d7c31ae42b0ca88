package tools

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// allTools is every tool and resource read the broker can serve.
func allTools(t *testing.T) []ServerTool {
	t.Helper()
	g := DefaultGroup(Deps{})
	out, err := g.Enable([]string{"all"}, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range g.Resources([]string{"all"}) {
		out = append(out, r.Read)
	}
	return out
}

// TestEveryArgumentIsAudited: every argument of every tool reaches the
// audit summary (in clear, as keys or as a digest), and no digest field's
// value does. Args already refuses a field without an audit tag.
func TestEveryArgumentIsAudited(t *testing.T) {
	for _, tool := range allTools(t) {
		if err := tool.Args.CheckAudit(); err != nil {
			t.Errorf("%s: %v", tool.Tool.Name, err)
		}
		if tool.Args.Toolset == "" {
			t.Errorf("%s: no toolset for the audit rows", tool.Tool.Name)
		}
	}
}

// TestAuditRowsKeepSecurityArguments is issue 10 item 20: calls go through
// the real chain into a real audit log, and the intent rows hold the
// network policy, environment names (not values), the toolset, and for
// GitHub the repository, branch, paths and PR flag; resource reads their
// URI. Code, file contents and secrets never appear.
func TestAuditRowsKeepSecurityArguments(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	keys, err := audit.LoadKeys(audit.KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	auditPath := filepath.Join(root, "audit.db")
	log, err := audit.Open(ctx, audit.Options{Path: auditPath, CheckpointPath: filepath.Join(root, "audit.checkpoints"), Keys: keys, CheckpointInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	store, err := quota.Open(ctx, filepath.Join(root, "state.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	byName := map[string]ServerTool{}
	for _, tool := range allTools(t) {
		byName[tool.Tool.Name] = tool
	}
	chain := middleware.Chain(middleware.Deps{
		Specs: func(name string) (middleware.ArgSpec, bool) {
			tool, ok := byName[name]
			return tool.Args, ok
		},
		Limits:   func(identity.Principal) quota.Limits { return quota.LimitsFor(quota.TierPro, 1000) },
		Limiter:  store,
		Audit:    log,
		Metrics:  middleware.NewMetrics(),
		Redactor: redact.New(nil, nil),
		Log:      zerolog.Nop(),
	})
	pctx := identity.WithPrincipal(ctx, identity.Principal{ID: "alice", Tier: quota.TierPro})
	call := func(name, raw string) {
		t.Helper()
		h := byName[name].Handler
		for i := len(chain) - 1; i >= 0; i-- {
			h = chain[i](h)
		}
		var req mcp.CallToolRequest
		req.Params.Name = name
		req.Params.RawArguments = json.RawMessage(raw)
		if _, err := h(pctx, req); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	// Nothing is configured behind the tools, so each fails after its
	// intent row is written; that row is what this test reads.
	call("execute_code", `{"command":"curl -H \"X: never-logged-command\" https://api.example.com","session_id":"sess_abc",
		"environment":{"API_KEY":"never-logged-env-value","REGION":"eu"},"working_directory":"sub",
		"sandbox_config":{"network":{"allowed_domains":["API.example.com","*.example.org"],"denied_domains":["bad.example.org"]}}}`)
	call("execute_code_async", `{"command":"true","sandbox_config":{"network":"public"}}`)
	call("commit_and_push_to_github", `{"repo_id":"site","branch":"sandbox/fix","files":{"src/a.go":"never-logged-file-content","README.md":"x"},
		"commit_message":"never-logged-message","create_pr":true,"pr_title":"t"}`)
	call("commit_session_files", `{"repo_id":"site","branch":"sandbox/fix","session_id":"sess_abc","paths":["out/report.csv","src/main.py"],"commit_message":"m"}`)
	call("read_github_file", `{"repo_id":"site","file_path":"docs/setup.md","branch":"sandbox/fix"}`)
	call(ResourceRead, `{"uri":"sandbox://sess_abc/out/report.csv"}`)
	call("upload_file", `{"session_id":"sess_abc","path":"notes/a.txt","content":"never-logged-upload"}`)
	call("create_sandbox_for_project", `{"project_name":"site","template":"react","initial_files":{"src/App.jsx":"never-logged-jsx"}}`)

	var buf bytes.Buffer
	if err := audit.Export(ctx, auditPath, "jsonl", &buf); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "never-logged") {
		t.Fatalf("a value that must not be logged reached the audit log:\n%s", buf.String())
	}
	intents := map[string][]audit.Entry{}
	sc := bufio.NewScanner(&buf)
	for sc.Scan() {
		var e audit.Entry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatal(err)
		}
		if e.Phase == audit.PhaseIntent {
			intents[e.Tool] = append(intents[e.Tool], e)
		}
	}
	for _, c := range []struct {
		tool, toolset string
		want          map[string]any // dotted path into params → value
	}{
		{"execute_code", ToolsetJobs, map[string]any{
			"sandbox_config.network": map[string]any{"mode": "allow", "allowed_domains": []any{"api.example.com", "*.example.org"}, "denied_domains": []any{"bad.example.org"}},
			"environment.keys":       []any{"API_KEY", "REGION"},
			"environment.count":      2.0,
			"session_id":             "sess_abc",
			"working_directory":      "sub",
		}},
		{"execute_code_async", ToolsetJobs, map[string]any{"sandbox_config.network": map[string]any{"mode": "public"}}},
		{"commit_and_push_to_github", ToolsetGitHub, map[string]any{
			"repo_id": "site", "branch": "sandbox/fix", "files.keys": []any{"README.md", "src/a.go"}, "create_pr": true,
		}},
		{"commit_session_files", ToolsetGitHub, map[string]any{
			"repo_id": "site", "branch": "sandbox/fix", "session_id": "sess_abc", "paths": []any{"out/report.csv", "src/main.py"},
		}},
		{"read_github_file", ToolsetGitHub, map[string]any{"repo_id": "site", "file_path": "docs/setup.md", "branch": "sandbox/fix"}},
		{ResourceRead, ToolsetSandbox, map[string]any{"uri": "sandbox://sess_abc/out/report.csv"}},
		{"upload_file", ToolsetFiles, map[string]any{"path": "notes/a.txt", "content.bytes": 19.0}},
		{"create_sandbox_for_project", ToolsetProjects, map[string]any{"template": "react", "initial_files.keys": []any{"src/App.jsx"}}},
	} {
		rows := intents[c.tool]
		if len(rows) != 1 {
			t.Errorf("%s: %d intent rows", c.tool, len(rows))
			continue
		}
		var params map[string]any
		if err := json.Unmarshal(rows[0].Params, &params); err != nil {
			t.Fatal(err)
		}
		for path, want := range c.want {
			if got := lookup(params, path); !reflect.DeepEqual(got, want) {
				t.Errorf("%s: params.%s = %#v, want %#v (params %s)", c.tool, path, got, want, rows[0].Params)
			}
		}
		if rows[0].Toolset != c.toolset {
			t.Errorf("%s: toolset %q, want %q", c.tool, rows[0].Toolset, c.toolset)
		}
	}
}

func lookup(m map[string]any, path string) any {
	var v any = m
	for _, k := range strings.Split(path, ".") {
		mm, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = mm[k]
	}
	return v
}
