package middleware

import (
	"encoding/json"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
)

// RedactResult redacts every text a result carries: text content, embedded
// text resources, link names and structured content.
func RedactResult(r *redact.Redactor, res *mcp.CallToolResult) *mcp.CallToolResult {
	if res == nil {
		return nil
	}
	for i, c := range res.Content {
		switch t := c.(type) {
		case mcp.TextContent:
			t.Text = r.String(t.Text)
			res.Content[i] = t
		case *mcp.TextContent:
			t.Text = r.String(t.Text)
		case mcp.EmbeddedResource:
			t.Resource = redactResource(r, t.Resource)
			res.Content[i] = t
		case mcp.ResourceLink:
			t.Name, t.Description = r.String(t.Name), r.String(t.Description)
			res.Content[i] = t
		}
	}
	if res.StructuredContent != nil {
		if b, err := json.Marshal(res.StructuredContent); err == nil {
			var generic any
			if json.Unmarshal(b, &generic) == nil {
				res.StructuredContent = r.Value(generic)
			}
		}
	}
	return res
}

func redactResource(r *redact.Redactor, rc mcp.ResourceContents) mcp.ResourceContents {
	switch t := rc.(type) {
	case mcp.TextResourceContents:
		t.Text = r.String(t.Text)
		return t
	case *mcp.TextResourceContents:
		t.Text = r.String(t.Text)
	}
	return rc
}
