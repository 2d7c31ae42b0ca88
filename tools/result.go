package tools

import (
	"encoding/json"

	"github.com/mark3labs/mcp-go/mcp"
)

// jsonResult returns v as structured content with its JSON text alongside,
// for clients that read only text.
func jsonResult(v any) (*mcp.CallToolResult, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	return &mcp.CallToolResult{Content: []mcp.Content{mcp.NewTextContent(string(b))}, StructuredContent: v}, nil
}
