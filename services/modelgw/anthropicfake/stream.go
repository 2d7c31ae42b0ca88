package anthropicfake

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// stream writes msg as the documented event sequence: message_start, a
// ping, per block content_block_start, deltas and content_block_stop,
// then message_delta (stop reason, cumulative output tokens) and
// message_stop.
func (f *Fake) stream(w http.ResponseWriter, r *http.Request, msg message, reply Reply) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	send := func(event string, data any) {
		b, _ := json.Marshal(data)
		fmt.Fprintf(w, "event: %s\ndata: %s\n\n", event, b)
		if fl != nil {
			fl.Flush()
		}
	}
	start := msg
	start.Content = []outBlock{}
	start.StopReason = nil
	start.Usage = usage{InputTokens: msg.Usage.InputTokens, OutputTokens: 1}
	send("message_start", map[string]any{"type": "message_start", "message": start})
	send("ping", map[string]string{"type": "ping"})
	if !sleep(r, reply.Delay) {
		return
	}
	if e := reply.StreamError; e != nil {
		send("error", map[string]any{"type": "error", "error": map[string]string{"type": e.Type, "message": e.Message}})
		return
	}
	for i, b := range msg.Content {
		head := b
		switch b.Type {
		case "text":
			empty := ""
			head.Text = &empty
		case "tool_use":
			head.Input = json.RawMessage(`{}`)
		}
		send("content_block_start", map[string]any{"type": "content_block_start", "index": i, "content_block": head})
		switch b.Type {
		case "text":
			for _, part := range chunks(*b.Text, 16) {
				send("content_block_delta", map[string]any{"type": "content_block_delta", "index": i,
					"delta": map[string]string{"type": "text_delta", "text": part}})
			}
		case "tool_use":
			// The first fragment may be empty, as the API's is.
			for _, part := range append([]string{""}, chunks(string(b.Input), 24)...) {
				send("content_block_delta", map[string]any{"type": "content_block_delta", "index": i,
					"delta": map[string]string{"type": "input_json_delta", "partial_json": part}})
			}
		}
		send("content_block_stop", map[string]any{"type": "content_block_stop", "index": i})
	}
	send("message_delta", map[string]any{"type": "message_delta",
		"delta": map[string]any{"stop_reason": *msg.StopReason, "stop_sequence": nil},
		"usage": map[string]int{"output_tokens": msg.Usage.OutputTokens}})
	send("message_stop", map[string]string{"type": "message_stop"})
}

// chunks splits s into pieces of at most n bytes, on rune boundaries.
func chunks(s string, n int) []string {
	var out []string
	for len(s) > n {
		i := n
		for i > 0 && !isRuneStart(s[i]) {
			i--
		}
		if i == 0 {
			i = n
		}
		out = append(out, s[:i])
		s = s[i:]
	}
	if s != "" {
		out = append(out, s)
	}
	return out
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }
