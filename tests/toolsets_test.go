package tests

import (
	"context"
	"encoding/json"
	"os/exec"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/mcp"
)

// TestUnconfiguredToolsetsAreNotListed: a broker without a sandbox backend,
// project provider or GitHub allow-list lists only what it can serve, and
// refuses to start when such a toolset is asked for by name.
func TestUnconfiguredToolsetsAreNotListed(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none"}})
	c := b.Client(t, testToken)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := c.ListTools(ctx, mcp.ListToolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tl := range list.Tools {
		names = append(names, tl.Name)
	}
	sort.Strings(names)
	if strings.Join(names, ",") != "get_usage" {
		t.Fatalf("tools listed without backend, provider or GitHub: %v", names)
	}
	templates, err := c.ListResourceTemplates(ctx, mcp.ListResourceTemplatesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(templates.ResourceTemplates) != 0 {
		t.Fatalf("session file templates listed without a backend: %+v", templates.ResourceTemplates)
	}
	// A call to an unlisted tool is refused by the protocol layer.
	var req mcp.CallToolRequest
	req.Params.Name = "run_code"
	req.Params.Arguments = map[string]any{"language": "python", "code": "print(1)"}
	if res, err := c.CallTool(ctx, req); err == nil && !res.IsError {
		t.Fatalf("run_code answered without a backend: %+v", res)
	}

	for _, tc := range []struct{ toolsets, want string }{
		{"github", "GITHUB_REPOS_FILE"},
		{"account,sandbox", "SANDBOX_BACKEND=none"},
		{"projects", "CSB_API_KEY"},
	} {
		cmd := exec.Command(brokerBin, "serve", "--transport", "http", "--addr", "127.0.0.1:0", "--toolsets", tc.toolsets)
		cmd.Env = brokerEnv(brokerRoot(t), testToken, map[string]string{"SANDBOX_BACKEND": "none"})
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "toolset") || !strings.Contains(string(out), tc.want) {
			t.Errorf("--toolsets %s: %v\n%s", tc.toolsets, err, out)
		}
	}
}

// SANDBOX_MAX_TIMEOUT reaches the published schema and the validator alike.
func TestConfiguredTimeoutBoundIsPublished(t *testing.T) {
	requireBwrap(t)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "process", "SANDBOX_MAX_TIMEOUT": "120"}})
	c := b.Client(t, testToken)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := c.ListTools(ctx, mcp.ListToolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	bounds := map[string]string{"run_code": "timeout_s", "execute_code": "timeout_seconds", "execute_code_async": "timeout_seconds"}
	for _, tl := range list.Tools {
		field, ok := bounds[tl.Name]
		if !ok {
			continue
		}
		delete(bounds, tl.Name)
		var s struct {
			Properties map[string]map[string]any `json:"properties"`
		}
		raw, _ := json.Marshal(tl.InputSchema)
		if err := json.Unmarshal(raw, &s); err != nil {
			t.Fatal(err)
		}
		if s.Properties[field]["maximum"] != float64(120) {
			t.Errorf("%s.%s: maximum %v, want 120", tl.Name, field, s.Properties[field]["maximum"])
		}
	}
	if len(bounds) > 0 {
		t.Fatalf("tools not listed: %v", bounds)
	}
	e := mustToolError(t, callTool(t, c, "execute_code", map[string]any{"command": "true", "timeout_seconds": 121}), "INVALID_INPUT")
	if !strings.Contains(e.Message, "timeout_seconds") || !strings.Contains(e.Message, "at most 120") || e.Retryable {
		t.Fatalf("timeout past the bound: %+v", e)
	}
}
