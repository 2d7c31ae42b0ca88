package tests

import (
	"net/url"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/client"

	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
)

const csbKey = "csb_v1_test_0123456789abcdef"

func csbBroker(t *testing.T) (*csbfake.Server, *client.Client) {
	t.Helper()
	fake := csbfake.New(t, csbKey)
	// The react template is the operator's own, with a dev task on 5173;
	// the others fork the universal image.
	fake.AddTemplate("rtpl42", map[string][]byte{"package.json": []byte(`{"name":"starter"}`)}, 5173)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{
		"CSB_API_KEY": csbKey, "CSB_API_URL": fake.URL(), "SANDBOX_BACKEND": "none",
		"CSB_TEMPLATES": `{"react": {"id": "rtpl42", "port": 5173}}`}})
	return fake, b.Client(t, testToken)
}

type projectCreated struct {
	SandboxID  string `json:"sandbox_id"`
	PreviewURL string `json:"preview_url"`
	Provider   string `json:"provider"`
}

type projectOutput struct {
	Output     string `json:"output"`
	ExitCode   int    `json:"exit_code"`
	Success    bool   `json:"success"`
	PreviewURL string `json:"preview_url"`
	Truncated  bool   `json:"truncated"`
}

func TestCodeSandboxProjectLifecycle(t *testing.T) {
	fake, c := csbBroker(t)
	var created projectCreated
	res := callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "shop-front", "template": "react",
		"initial_files": map[string]string{"package.json": `{"name":"shop","scripts":{"build":"vite build"}}`, "index.html": "<h1>Shop</h1>"}})
	if res.IsError {
		t.Fatalf("create: %+v", res.Content)
	}
	resultJSON(t, res, &created)
	if created.Provider != "codesandbox" || created.SandboxID == "" {
		t.Fatalf("created %+v", created)
	}
	st, ok := fake.Sandbox(created.SandboxID)
	if !ok || !st.Running || st.Privacy == 0 {
		t.Fatalf("fake sandbox %+v (want running and private)", st)
	}
	if _, ok := findFile(st.Files, "index.html"); !ok {
		t.Fatalf("initial files not written: %v", keys(st.Files))
	}
	u, err := url.Parse(created.PreviewURL)
	if err != nil || u.Scheme != "https" || !strings.HasPrefix(u.Host, created.SandboxID+"-") || !strings.HasSuffix(u.Host, ".csb.app") {
		t.Fatalf("preview url %q", created.PreviewURL)
	}

	res = callTool(t, c, "write_files_to_sandbox", map[string]any{"sandbox_id": created.SandboxID, "files": map[string]string{"src/main.jsx": "export default 1"}})
	if res.IsError {
		t.Fatalf("write: %+v", res.Content)
	}
	var out projectOutput
	resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "build_output"}), &out)
	if !out.Success || out.Output == "" {
		t.Fatalf("build %+v", out)
	}
	// Secrets in sandbox output are redacted.
	fake.AppendDevLog(created.SandboxID, "leaked ghp_"+strings.Repeat("Z9y8", 9)+" and key "+csbKey+"\n")
	resultJSON(t, callTool(t, c, "get_sandbox_output", map[string]any{"sandbox_id": created.SandboxID, "output_type": "console_log"}), &out)
	if strings.Contains(out.Output, "Z9y8Z9y8") || strings.Contains(out.Output, csbKey) || !strings.Contains(out.Output, "leaked") {
		t.Fatalf("console_log not redacted: %q", out.Output)
	}

	var list struct {
		Sandboxes []struct {
			ID string `json:"sandbox_id"`
		} `json:"sandboxes"`
	}
	resultJSON(t, callTool(t, c, "list_sandboxes", map[string]any{}), &list)
	if len(list.Sandboxes) != 1 || list.Sandboxes[0].ID != created.SandboxID {
		t.Fatalf("list %+v", list)
	}
	// An unknown ID is refused without touching the API.
	fake.ResetRequests()
	mustToolError(t, callTool(t, c, "write_files_to_sandbox", map[string]any{"sandbox_id": "abcdef", "files": map[string]string{"a.txt": "x"}}), "SANDBOX_NOT_FOUND")
	if n := len(fake.Requests()); n != 0 {
		t.Fatalf("%d requests for a sandbox the caller does not own", n)
	}
}

func findFile(files map[string][]byte, suffix string) ([]byte, bool) {
	for p, b := range files {
		if strings.HasSuffix(p, "/"+suffix) || p == suffix {
			return b, true
		}
	}
	return nil, false
}

func keys(m map[string][]byte) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestCodeSandboxRefusalsReachNoNetwork(t *testing.T) {
	fake, c := csbBroker(t)
	fake.ResetRequests()
	bad := []struct {
		args map[string]any
		code string
	}{
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{"../evil.js": "x"}}, "PATH_TRAVERSAL"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{".env": "A=1"}}, "PATH_TRAVERSAL"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{".git/config": "x"}}, "PATH_TRAVERSAL"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{"node_modules/a.js": "x"}}, "PATH_TRAVERSAL"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{".codesandbox/tasks.json": "{}"}}, "PATH_TRAVERSAL"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{"/etc/passwd": "x"}}, "PATH_TRAVERSAL"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{"/root/.ssh/id": "x"}}, "PATH_TRAVERSAL"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{"a\x01b": "x"}}, "INVALID_INPUT"},
		{map[string]any{"project_name": "bad name!", "template": "react"}, "INVALID_INPUT"},
		{map[string]any{"project_name": strings.Repeat("a", 51), "template": "react"}, "INVALID_INPUT"},
		{map[string]any{"project_name": "x", "template": "angular"}, "INVALID_INPUT"},
		{map[string]any{"project_name": "x", "template": "react", "initial_files": map[string]string{"big.txt": strings.Repeat("a", 1<<20+1)}}, "FILE_SIZE_EXCEEDED"},
	}
	many := map[string]string{}
	for i := 0; i < 21; i++ {
		many["f"+strings.Repeat("x", i)+".txt"] = "x"
	}
	bad = append(bad, struct {
		args map[string]any
		code string
	}{map[string]any{"project_name": "x", "template": "react", "initial_files": many}, "INVALID_INPUT"})
	for _, tc := range bad {
		mustToolError(t, callTool(t, c, "create_sandbox_for_project", tc.args), tc.code)
	}
	// write_files_to_sandbox: 10 files of 500 KB, the same path rules.
	eleven := map[string]string{}
	for i := 0; i < 11; i++ {
		eleven["f"+strings.Repeat("x", i)+".txt"] = "x"
	}
	for _, tc := range []struct {
		files map[string]string
		code  string
	}{
		{eleven, "INVALID_INPUT"},
		{map[string]string{"big.txt": strings.Repeat("a", 500<<10+1)}, "FILE_SIZE_EXCEEDED"},
		{map[string]string{"src/../../x": "x"}, "PATH_TRAVERSAL"},
		{map[string]string{"app/.env.local": "A=1"}, "PATH_TRAVERSAL"},
	} {
		mustToolError(t, callTool(t, c, "write_files_to_sandbox", map[string]any{"sandbox_id": "abcdef", "files": tc.files}), tc.code)
	}
	if n := len(fake.Requests()); n != 0 {
		t.Fatalf("%d requests reached CodeSandbox for refused calls", n)
	}
}

func TestCodeSandboxRateLimit(t *testing.T) {
	fake, c := csbBroker(t)
	fake.Inject(csbfake.Fault{Status: 429, N: 10, Budget: "sandboxes"})
	e := mustToolError(t, callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "x", "template": "node"}), "RATE_LIMIT_EXCEEDED")
	if !e.Retryable || e.RetryAfterS == nil || *e.RetryAfterS < 1 {
		t.Fatalf("%+v", e)
	}
	if strings.Contains(e.Message, csbKey) {
		t.Fatal("key in message")
	}
}
