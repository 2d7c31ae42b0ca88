package tools

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
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

// Bounds on what one call streams, as its result is bounded.
const (
	// maxNotifyBytes caps the output notifications of one call, counted as
	// JSON plus notifyOverhead each. Past it one last notification says
	// the stream was cut; the result and get_execution_output have the
	// output.
	maxNotifyBytes = 128 << 10
	notifyOverhead = 128 // a notification's JSON-RPC envelope and SSE framing
	// minProgressGap spaces progress notifications: they are a sign of life
	// (two a second at most), not a stream.
	minProgressGap = 500 * time.Millisecond
)

// notifier streams best-effort notifications while a call is open:
// progress when the client sent a progress token, output lines as log
// messages at the client's chosen level. Results never depend on it, and
// every text passes the output redactor first (the chain's redaction only
// sees the final result).
type notifier struct {
	srv    *server.MCPServer
	token  mcp.ProgressToken
	redact func(string) string

	mu           sync.Mutex
	n            float64
	lastProgress time.Time
	sent         int  // output notification bytes so far
	cut          bool // output past maxNotifyBytes is no longer sent
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
	n.mu.Lock()
	now := time.Now()
	if now.Sub(n.lastProgress) < minProgressGap {
		n.mu.Unlock()
		return
	}
	n.lastProgress = now
	n.n++
	seq := n.n
	n.mu.Unlock()
	_ = n.srv.SendNotificationToClient(ctx, "notifications/progress", map[string]any{
		"progressToken": n.token, "progress": seq, "message": n.redact(message),
	})
}

// output sends one chunk of a job's output as a log message, until the
// call has streamed maxNotifyBytes.
func (n *notifier) output(ctx context.Context, stream, data string) {
	if n == nil || data == "" || n.outputCut() {
		return
	}
	text := n.redact(data)
	quoted, _ := json.Marshal(text)
	n.mu.Lock()
	if n.sent+len(quoted)+notifyOverhead > maxNotifyBytes {
		n.cut = true
		sent := n.sent
		n.mu.Unlock()
		_ = n.srv.SendLogMessageToClient(ctx, mcp.NewLoggingMessageNotification(mcp.LoggingLevelWarning, "sandbox",
			fmt.Sprintf("[output notifications stopped after %d bytes for this call; the result and get_execution_output have the output]", sent)))
		return
	}
	n.sent += len(quoted) + notifyOverhead
	n.mu.Unlock()
	level := mcp.LoggingLevelInfo
	if stream == "stderr" {
		level = mcp.LoggingLevelWarning
	}
	_ = n.srv.SendLogMessageToClient(ctx, mcp.NewLoggingMessageNotification(level, "sandbox."+stream, text))
}

// outputCut reports whether the call's output notifications were cut.
func (n *notifier) outputCut() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cut
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
