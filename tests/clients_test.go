package tests

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestClientCLIs runs the connect guides' own clients, pinned in
// tests/ts/package.json: the MCP Inspector CLI over Streamable HTTP and
// stdio, and Claude Code's `claude mcp add` and `claude mcp list` (which
// connects to each server to report its health; it needs no network and no
// Anthropic account for that).
func TestClientCLIs(t *testing.T) {
	_, npm := requireNode(t)
	dir, err := filepath.Abs("ts")
	if err != nil {
		t.Fatal(err)
	}
	ensureNodeModules(t, npm, dir)
	bin := func(name string) string { return filepath.Join(dir, "node_modules", ".bin", name) }
	operator := "cli-operator-" + strings.Repeat("c", 24)
	b := startOAuthBroker(t, operator, map[string]string{"SANDBOX_BACKEND": "none"})
	stdioRoot := brokerRoot(t)
	withRootOverlay(t, stdioRoot, nil) // the stdio brokers mount it: unmounted at cleanup
	home := t.TempDir()                // Claude Code keeps its server list under HOME,
	work := t.TempDir()                // per project directory

	run := func(name string, args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = work
		cmd.Env = append(os.Environ(), "HOME="+home, "NO_COLOR=1", "DISABLE_AUTOUPDATER=1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1")
		cmd.WaitDelay = 10 * time.Second
		out, err := cmd.Output()
		if err != nil {
			var stderr string
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = string(ee.Stderr)
			}
			t.Fatalf("%s %s: %v\n%s\n%s", filepath.Base(name), strings.Join(args, " "), err, out, stderr)
		}
		return string(out)
	}
	usage := func(out string) string {
		t.Helper()
		var res struct {
			StructuredContent struct {
				Principal string `json:"principal"`
			} `json:"structuredContent"`
		}
		if err := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &res); err != nil {
			t.Fatalf("inspector output %q: %v", out, err)
		}
		return res.StructuredContent.Principal
	}

	// Inspector CLI, Streamable HTTP with a bearer token.
	out := run(bin("mcp-inspector"), "--cli", b.URL+"/mcp", "--transport", "http", "--header", "Authorization: Bearer "+operator,
		"--method", "tools/call", "--tool-name", "get_usage")
	if p := usage(out); p != "operator" {
		t.Errorf("inspector over HTTP: principal %q", p)
	}
	// Inspector CLI, stdio (the broker as a subprocess, as in the desktop guides).
	out = run(bin("mcp-inspector"), "--cli", "-e", "SANDBOX_ROOT="+stdioRoot, "-e", "SANDBOX_BACKEND=none", "-e", "MCP_TRANSPORT=stdio",
		"--method", "tools/call", "--tool-name", "get_usage", brokerBin, "serve")
	if p := usage(out); p != "local" {
		t.Errorf("inspector over stdio: principal %q", p)
	}

	// Claude Code: the README's two `claude mcp add` lines, then the health check.
	run(bin("claude"), "mcp", "add", "--transport", "http", "sandbox-http", b.URL+"/mcp", "--header", "Authorization: Bearer "+operator)
	run(bin("claude"), "mcp", "add", "sandbox-stdio", "-e", "SANDBOX_ROOT="+stdioRoot, "-e", "SANDBOX_BACKEND=none", "--",
		brokerBin, "serve", "--transport", "stdio")
	run(bin("claude"), "mcp", "add", "--transport", "http", "sandbox-oauth", b.URL+"/mcp")
	list := run(bin("claude"), "mcp", "list")
	for _, line := range strings.Split(list, "\n") {
		switch {
		case strings.HasPrefix(line, "sandbox-http:"), strings.HasPrefix(line, "sandbox-stdio:"):
			if !strings.Contains(line, "Connected") {
				t.Errorf("claude mcp list: %s", line)
			}
		case strings.HasPrefix(line, "sandbox-oauth:"):
			// No token: Claude Code reports that the server needs authentication.
			if strings.Contains(line, "✔") || !strings.Contains(strings.ToLower(line), "auth") {
				t.Errorf("claude mcp list, OAuth server without a token: %s", line)
			}
		}
	}
	for _, name := range []string{"sandbox-http:", "sandbox-stdio:", "sandbox-oauth:"} {
		if !strings.Contains(list, name) {
			t.Errorf("claude mcp list lacks %s\n%s", name, list)
		}
	}
	t.Logf("claude mcp list:\n%s", list)
}
