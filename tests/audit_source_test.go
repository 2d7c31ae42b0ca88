package tests

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/client/transport"
)

type sourceRow struct {
	Phase      string `json:"phase"`
	Tool       string `json:"tool"`
	Transport  string `json:"transport"`
	ClientAddr string `json:"client_addr"`
	UserAgent  string `json:"user_agent"`
	MCPSession string `json:"mcp_session"`
	Toolset    string `json:"toolset"`
}

func exportSourceRows(t *testing.T, root string) []sourceRow {
	t.Helper()
	var rows []sourceRow
	for _, line := range strings.Split(strings.TrimSpace(runBroker(t, root, "audit", "export", "--format", "jsonl")), "\n") {
		var r sourceRow
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("export line %q: %v", line, err)
		}
		rows = append(rows, r)
	}
	return rows
}

// TestAuditRowsSayWhereCallsCameFrom is issue 10 item 21 end to end: over
// HTTP every row of a call carries the peer's address, the (cleaned)
// user agent, the MCP session and the toolset; over stdio the transport.
// audit tail shows them, and audit verify still passes.
func TestAuditRowsSayWhereCallsCameFrom(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none"}})
	c, err := client.NewStreamableHttpClient(b.URL+"/mcp", transport.WithHTTPHeaders(map[string]string{
		"Authorization": "Bearer " + testToken, "User-Agent": "audit-e2e/1.0 \u202eevil"}))
	if err != nil {
		t.Fatal(err)
	}
	initClient(t, c)
	callTool(t, c, "get_usage", nil)
	callTool(t, c, "get_usage", map[string]any{"bogus": 1}) // refused at validation
	session := c.GetSessionId()
	c.Close()
	b.Stop(t)
	rows := exportSourceRows(t, b.Root)
	if len(rows) != 3 || session == "" {
		t.Fatalf("rows %+v, session %q", rows, session)
	}
	for _, r := range rows {
		if r.Transport != "http" || !strings.HasPrefix(r.ClientAddr, "127.0.0.1:") || r.UserAgent != "audit-e2e/1.0 \uFFFDevil" ||
			r.MCPSession != session || r.Toolset != "account" {
			t.Errorf("row %+v", r)
		}
	}
	if tail := runBroker(t, b.Root, "audit", "tail", "-n", "1"); !strings.Contains(tail, `"mcp_session":"`+session+`"`) {
		t.Errorf("audit tail: %s", tail)
	}
	if code, out := verifyCLI(t, b.Root); code != 0 {
		t.Fatalf("verify: %d %s", code, out)
	}

	root := brokerRoot(t)
	sc := StartStdio(t, root, map[string]string{"SANDBOX_BACKEND": "none"})
	callTool(t, sc, "get_usage", nil)
	sc.Close()
	for _, r := range exportSourceRows(t, root) {
		if r.Transport != "stdio" || r.ClientAddr != "" || r.UserAgent != "" || r.Toolset != "account" {
			t.Errorf("stdio row %+v", r)
		}
	}
}
