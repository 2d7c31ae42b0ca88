package tools

import (
	"context"
	"fmt"
	"time"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"
)

type progressTokenKey struct{}

// withProgressToken keeps the call's progress token for the handler.
func withProgressToken(ctx context.Context, req mcp.CallToolRequest) context.Context {
	if req.Params.Meta != nil && req.Params.Meta.ProgressToken != nil {
		return context.WithValue(ctx, progressTokenKey{}, req.Params.Meta.ProgressToken)
	}
	return ctx
}

// notifier streams best-effort notifications while a call is open:
// progress when the client sent a progress token, output lines as log
// messages at the client's chosen level. Results never depend on it, and
// every text passes the output redactor first (the chain's redaction only
// sees the final result).
type notifier struct {
	srv    *server.MCPServer
	token  mcp.ProgressToken
	redact func(string) string
	n      float64
}

func newNotifier(ctx context.Context, redact func(string) string) *notifier {
	srv := server.ServerFromContext(ctx)
	if srv == nil || redact == nil {
		return nil
	}
	tok, _ := ctx.Value(progressTokenKey{}).(mcp.ProgressToken)
	return &notifier{srv: srv, token: tok, redact: redact}
}

func (n *notifier) progress(ctx context.Context, message string) {
	if n == nil || n.token == nil {
		return
	}
	n.n++
	_ = n.srv.SendNotificationToClient(ctx, "notifications/progress", map[string]any{
		"progressToken": n.token, "progress": n.n, "message": n.redact(message),
	})
}

// output sends one chunk of a job's output as a log message.
func (n *notifier) output(ctx context.Context, stream, data string) {
	if n == nil || data == "" {
		return
	}
	level := mcp.LoggingLevelInfo
	if stream == "stderr" {
		level = mcp.LoggingLevelWarning
	}
	_ = n.srv.SendLogMessageToClient(ctx, mcp.NewLoggingMessageNotification(level, "sandbox."+stream, n.redact(data)))
}

// tick sends a progress notification every interval until the returned
// func is called; it is how a blocking run reports that it is alive.
func (n *notifier) tick(ctx context.Context, what string, every time.Duration) (stop func()) {
	if n == nil || n.token == nil {
		return func() {}
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(finished)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case now := <-t.C:
				n.progress(ctx, fmt.Sprintf("%s: running for %ds", what, int(now.Sub(start).Seconds())))
			}
		}
	}()
	return func() { close(done); <-finished }
}
