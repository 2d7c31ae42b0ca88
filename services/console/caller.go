package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// caller makes the console's tool calls: a real mcp-go client over the
// in-process transport, one per call, with the person's principal on the
// context. The server's middleware chain does the rest.
type caller struct {
	srv *server.MCPServer
}

// toolError is a tool's structured error result.
type toolError struct {
	Code        string `json:"error"`
	Message     string `json:"message"`
	Retryable   bool   `json:"retryable"`
	RetryAfterS int64  `json:"retry_after_s"`
}

func (e *toolError) Error() string { return e.Code + ": " + e.Message }

// status is the HTTP status the console answers a tool error with.
func (e *toolError) status() int {
	switch e.Code {
	case "PERMISSION_DENIED":
		return http.StatusForbidden
	case "UNAUTHENTICATED":
		return http.StatusUnauthorized
	case "RATE_LIMIT_EXCEEDED", "QUOTA_EXCEEDED":
		return http.StatusTooManyRequests
	case "SANDBOX_NOT_FOUND":
		return http.StatusNotFound
	case "CONFLICT":
		return http.StatusConflict
	case "UNAVAILABLE", "NOT_CONFIGURED":
		return http.StatusServiceUnavailable
	case "INTERNAL_ERROR":
		return http.StatusInternalServerError
	}
	return http.StatusBadRequest
}

// callOpts stream a call's notifications (progress, log messages).
type callOpts struct {
	onNotify func(mcp.JSONRPCNotification)
	progress string // progress token
}

// call runs one tool as p. A tool error comes back as *toolError; other
// errors mean the call could not be made.
func (c caller) call(ctx context.Context, p identity.Principal, name string, args map[string]any, o callOpts) (*mcp.CallToolResult, error) {
	cl, err := client.NewInProcessClient(c.srv)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	ctx = identity.WithPrincipal(ctx, p)
	if err := cl.Start(ctx); err != nil {
		return nil, err
	}
	init := mcp.InitializeRequest{}
	init.Params.ProtocolVersion = mcp.LATEST_LEGACY_PROTOCOL_VERSION
	init.Params.ClientInfo = mcp.Implementation{Name: "sandbox-broker-console", Version: "1"}
	if _, err := cl.Initialize(ctx, init); err != nil {
		return nil, fmt.Errorf("console: initialize: %w", err)
	}
	req := mcp.CallToolRequest{}
	req.Params.Name = name
	req.Params.Arguments = args
	if o.onNotify != nil {
		cl.OnNotification(o.onNotify)
		//lint:ignore SA1019 the broker speaks the protocol revision where logging/setLevel asks for output notifications
		if err := cl.SetLevel(ctx, mcp.SetLevelRequest{Params: mcp.SetLevelParams{Level: mcp.LoggingLevelInfo}}); err != nil {
			return nil, fmt.Errorf("console: set level: %w", err)
		}
		if o.progress != "" {
			req.Params.Meta = &mcp.Meta{ProgressToken: o.progress}
		}
	}
	res, err := cl.CallTool(ctx, req)
	if err != nil {
		return nil, err
	}
	if res.IsError {
		return nil, resultError(res)
	}
	return res, nil
}

// resultError reads a tool's {error, message, retryable, retry_after_s}.
func resultError(res *mcp.CallToolResult) error {
	te := &toolError{Code: "INTERNAL_ERROR", Message: "the tool failed"}
	if b, err := json.Marshal(res.StructuredContent); err == nil && res.StructuredContent != nil {
		_ = json.Unmarshal(b, te)
	} else if text := firstText(res); text != "" {
		_ = json.Unmarshal([]byte(text), te)
	}
	return te
}

func firstText(res *mcp.CallToolResult) string {
	for _, c := range res.Content {
		if t, ok := mcp.AsTextContent(c); ok {
			return t.Text
		}
	}
	return ""
}

// decode reads a result's structured content (or its first text, which
// holds the same JSON) into v.
func decode(res *mcp.CallToolResult, v any) error {
	var b []byte
	if res.StructuredContent != nil {
		var err error
		if b, err = json.Marshal(res.StructuredContent); err != nil {
			return err
		}
	} else {
		b = []byte(firstText(res))
	}
	if len(b) == 0 {
		return errors.New("console: the tool returned no JSON")
	}
	return json.Unmarshal(b, v)
}

// callJSON runs a tool and decodes its result into v.
func (c caller) callJSON(ctx context.Context, p identity.Principal, name string, args map[string]any, v any) error {
	res, err := c.call(ctx, p, name, args, callOpts{})
	if err != nil {
		return err
	}
	return decode(res, v)
}
