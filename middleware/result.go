package middleware

import (
	"encoding/json"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
)

// RedactResult redacts every text a result carries: text content, embedded
// text resources, links and structured content. Structured content that
// cannot be re-encoded is dropped rather than sent unredacted.
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
		case *mcp.EmbeddedResource:
			t.Resource = redactResource(r, t.Resource)
		case mcp.ResourceLink:
			redactLink(r, &t)
			res.Content[i] = t
		case *mcp.ResourceLink:
			redactLink(r, t)
		}
	}
	// mcp-go sends RawStructuredContent instead of StructuredContent when
	// it is set, so both are redacted.
	if raw := res.RawStructuredContent; len(raw) > 0 {
		res.RawStructuredContent = nil
		var generic any
		if json.Unmarshal(raw, &generic) == nil {
			if b, err := json.Marshal(r.Value(generic)); err == nil {
				res.RawStructuredContent = b
			}
		}
	}
	if res.StructuredContent != nil {
		sc := res.StructuredContent
		res.StructuredContent = nil
		if b, err := json.Marshal(sc); err == nil {
			var generic any
			if json.Unmarshal(b, &generic) == nil {
				res.StructuredContent = r.Value(generic)
			}
		}
	}
	return res
}

func redactLink(r *redact.Redactor, l *mcp.ResourceLink) {
	l.URI, l.Name, l.Title, l.Description = r.String(l.URI), r.String(l.Name), r.String(l.Title), r.String(l.Description)
}

func redactResource(r *redact.Redactor, rc mcp.ResourceContents) mcp.ResourceContents {
	switch t := rc.(type) {
	case mcp.TextResourceContents:
		t.Text, t.URI = r.String(t.Text), r.String(t.URI)
		return t
	case *mcp.TextResourceContents:
		t.Text = r.String(t.Text)
		t.URI = r.String(t.URI)
	}
	return rc
}
