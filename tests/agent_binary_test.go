package tests

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/client"
)

// TestSandboxesRunTheAgentBuiltAlone: with cmd/sandbox-agent beside the
// broker (as `make build` and the image leave them), every sandbox's
// agent is that binary, not the broker's own (which starts tens of
// milliseconds slower): the file at the agent's path inside the sandbox
// hashes to it.
func TestSandboxesRunTheAgentBuiltAlone(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(filepath.Dir(brokerBin), "sandbox-agent"))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	want := hex.EncodeToString(sum[:])
	backends(t, nil, func(t *testing.T, backend string, br *Broker, c *client.Client) {
		var r runResult
		resultJSON(t, callTool(t, c, "run_code", map[string]any{"language": "bash", "code": "sha256sum < /opt/sandbox/broker"}), &r)
		if got, _, _ := strings.Cut(r.Stdout, " "); !r.Success || got != want {
			t.Fatalf("the sandbox's agent hashes to %q (run %+v), want the agent built alone's %s", got, r, want)
		}
		if !strings.Contains(br.Logs(), `"built_alone":true`) {
			t.Errorf("the broker did not log that it installed the agent built alone")
		}
	})
}
