package tests

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// maxNotifyBytes mirrors tools.maxNotifyBytes: what one call may stream as
// output notifications.
const maxNotifyBytes = 128 << 10

// TestOutputFloodNotificationsAreCapped: a command flooding output for
// seconds streams at most the per-call cap of notifications to a real
// client, and the last output notification says the stream was cut (issue
// 15: an 8-second flood streamed 3.6-5.1 MB).
func TestOutputFloodNotificationsAreCapped(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		var mu sync.Mutex
		var total, progress int
		var last string
		c.OnNotification(func(n mcp.JSONRPCNotification) {
			raw, _ := json.Marshal(n)
			mu.Lock()
			defer mu.Unlock()
			total += len(raw)
			switch n.Method {
			case "notifications/message":
				if d, ok := n.Params.AdditionalFields["data"].(string); ok {
					last = d
				}
			case "notifications/progress":
				progress++
			}
		})
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		// The broker negotiates the legacy protocol, where logging/setLevel
		// is how a client asks for log notifications.
		//lint:ignore SA1019 the deprecation is for protocol 2026-07-28
		if err := c.SetLevel(ctx, mcp.SetLevelRequest{Params: mcp.SetLevelParams{Level: mcp.LoggingLevelDebug}}); err != nil {
			t.Fatal(err)
		}
		var req mcp.CallToolRequest
		req.Params.Name = "execute_code"
		req.Params.Arguments = map[string]any{"command": "timeout 4 yes 'flood flood flood flood flood flood flood'; echo done", "timeout_seconds": 20}
		req.Params.Meta = &mcp.Meta{ProgressToken: "flood"}
		res, err := c.CallTool(ctx, req)
		if err != nil || res.IsError {
			t.Fatalf("execute_code: %v %+v", err, res)
		}
		var r execResult
		resultJSON(t, res, &r)
		if r.Status != "completed" {
			t.Fatalf("status %q", r.Status)
		}
		mu.Lock()
		defer mu.Unlock()
		t.Logf("%s: %d notification bytes (%d progress notifications)", backend, total, progress)
		// Output is capped; progress (at most one a second) and JSON framing
		// come on top.
		if total > maxNotifyBytes+16<<10 {
			t.Fatalf("%d notification bytes for one call, cap %d", total, maxNotifyBytes)
		}
		if !strings.Contains(last, "notifications stopped") {
			t.Fatalf("the last output notification does not say the stream was cut: %q", last[:min(len(last), 200)])
		}
	})
}
