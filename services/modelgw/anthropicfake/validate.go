package anthropicfake

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
)

// request is the body as validated; unknown fields are tolerated.
type request struct {
	Model       *string           `json:"model"`
	MaxTokens   *json.RawMessage  `json:"max_tokens"`
	Messages    []json.RawMessage `json:"messages"`
	System      json.RawMessage   `json:"system"`
	Stream      *bool             `json:"stream"`
	Tools       []json.RawMessage `json:"tools"`
	Temperature json.RawMessage   `json:"temperature"`
	TopP        json.RawMessage   `json:"top_p"`
	TopK        json.RawMessage   `json:"top_k"`
}

var toolName = regexp.MustCompile(`^[a-zA-Z0-9_-]{1,128}$`)

func invalid(format string, a ...any) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: fmt.Sprintf(format, a...)}
}

// parse validates the body as the API does and returns what a script sees.
func (f *Fake) parse(body []byte, version string, countTokens bool) (Request, *APIError) {
	var raw request
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&raw); err != nil {
		return Request{}, invalid("The request body is not valid JSON: %v", err)
	}
	if dec.More() {
		return Request{}, invalid("The request body is not valid JSON: trailing data")
	}
	var req Request
	if raw.Model == nil || *raw.Model == "" {
		return req, invalid("model: Field required")
	}
	req.Model = *raw.Model
	if raw.Stream != nil {
		req.Stream = *raw.Stream
	}
	if !countTokens {
		if raw.MaxTokens == nil {
			return req, invalid("max_tokens: Field required")
		}
		n, err := strconv.Atoi(string(*raw.MaxTokens))
		if err != nil || n < 1 {
			return req, invalid("max_tokens: Input should be a valid integer greater than or equal to 1")
		}
	}
	if version == "2026-10-21" && (raw.Temperature != nil || raw.TopP != nil || raw.TopK != nil) {
		return req, invalid("temperature, top_p and top_k are not supported in anthropic-version 2026-10-21")
	}
	if len(raw.Messages) == 0 {
		return req, invalid("messages: at least one message is required")
	}
	for i, t := range raw.Tools {
		var tool struct {
			Type        string          `json:"type"`
			Name        string          `json:"name"`
			InputSchema json.RawMessage `json:"input_schema"`
		}
		if err := json.Unmarshal(t, &tool); err != nil {
			return req, invalid("tools.%d: Input should be an object", i)
		}
		if !toolName.MatchString(tool.Name) {
			return req, invalid("tools.%d.name: String should match pattern '^[a-zA-Z0-9_-]{1,128}$'", i)
		}
		if tool.Type == "" || tool.Type == "custom" {
			if len(tool.InputSchema) == 0 || tool.InputSchema[0] != '{' {
				return req, invalid("tools.%d.custom.input_schema: Field required", i)
			}
		}
	}
	if err := parseMessages(raw.Messages, &req); err != nil {
		return req, err
	}
	req.System = raw.System
	if !countTokens && !f.knownModel(req.Model) {
		return req, &APIError{Status: http.StatusNotFound, Type: "not_found_error", Message: "model: " + req.Model}
	}
	return req, nil
}

func (f *Fake) knownModel(m string) bool {
	for _, k := range f.o.Models {
		if k == m {
			return true
		}
	}
	return false
}

// knownBlocks are the content block types a request may carry.
var knownBlocks = map[string]bool{"text": true, "image": true, "document": true, "tool_use": true, "tool_result": true,
	"thinking": true, "redacted_thinking": true, "server_tool_use": true, "web_search_tool_result": true,
	"search_result": true, "container_upload": true}

// parseMessages checks roles and blocks, and that every tool_use is
// answered by a tool_result in the very next message and every
// tool_result answers one.
func parseMessages(raws []json.RawMessage, req *Request) *APIError {
	var pending map[string]bool // tool_use IDs the next user message must answer
	for i, raw := range raws {
		var m struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		if err := json.Unmarshal(raw, &m); err != nil {
			return invalid("messages.%d: Input should be an object", i)
		}
		if m.Role != "user" && m.Role != "assistant" {
			return invalid("messages.%d.role: Input should be 'user' or 'assistant'", i)
		}
		if i == 0 && m.Role != "user" {
			return invalid("messages: first message must use the \"user\" role")
		}
		msg := Message{Role: m.Role}
		var s string
		switch {
		case len(m.Content) == 0:
			return invalid("messages.%d.content: Field required", i)
		case json.Unmarshal(m.Content, &s) == nil:
			msg.Content = []ContentBlock{{Type: "text", Text: s}}
		default:
			if err := json.Unmarshal(m.Content, &msg.Content); err != nil {
				return invalid("messages.%d.content: Input should be a valid list", i)
			}
		}
		answered := map[string]bool{}
		for j, b := range msg.Content {
			switch {
			case !knownBlocks[b.Type]:
				return invalid("messages.%d.content.%d: Input tag '%s' found using 'type' does not match any of the expected tags", i, j, b.Type)
			case b.Type == "tool_use" && m.Role != "assistant":
				return invalid("messages.%d.content.%d: tool_use blocks may only appear in assistant messages", i, j)
			case b.Type == "tool_result" && m.Role != "user":
				return invalid("messages.%d.content.%d: tool_result blocks may only appear in user messages", i, j)
			case b.Type == "tool_result" && !pending[b.ToolUseID]:
				return invalid("messages.%d.content.%d: unexpected `tool_use_id` found in `tool_result` blocks: %s. Each `tool_result` block must have a corresponding `tool_use` block in the previous message.", i, j, b.ToolUseID)
			case b.Type == "tool_result":
				answered[b.ToolUseID] = true
			}
		}
		for id := range pending {
			if !answered[id] {
				return invalid("messages.%d: `tool_use` ids were found without `tool_result` blocks immediately after: %s. Each `tool_use` block must have a corresponding `tool_result` block in the next message.", i-1, id)
			}
		}
		pending = nil
		if m.Role == "assistant" {
			req.Turn++
			for _, b := range msg.Content {
				if b.Type == "tool_use" {
					if pending == nil {
						pending = map[string]bool{}
					}
					pending[b.ID] = true
				}
			}
		}
		req.Messages = append(req.Messages, msg)
	}
	if len(pending) > 0 {
		return invalid("messages: the final assistant message has `tool_use` blocks without `tool_result` blocks after it")
	}
	return nil
}
