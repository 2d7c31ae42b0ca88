package tests

import (
	"context"
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
