package agenttask

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/jobs"
)

// Caps on what one stream line becomes.
const (
	maxLine      = 4 << 20  // a longer line is skipped, with a note
	maxEventData = 16 << 10 // text of one event
	maxOutput    = 64 << 10 // the final answer kept for the result
)

// Outcome is what the agent's stream said about how the task ended.
type Outcome struct {
	Output string // the agent's final answer
	// Ended says the stream's closing record was seen (Claude Code's
	// result line, OpenCode's last step_finish).
	Ended   bool
	IsError bool
	Error   string // what went wrong, as the agent put it
	Turns   int
}

// Reader turns one agent's stdout (JSON lines) into execution events.
// Feed is called with the output as it arrives, in any chunking.
type Reader struct {
	agent   string
	line    []byte
	skipped int // bytes of the current over-long line
	out     Outcome
	text    strings.Builder // OpenCode: the text of the current step
}

// NewReader reads agent's stream.
func NewReader(agent string) *Reader { return &Reader{agent: agent} }

// Feed consumes a chunk and returns the events of the lines it completed.
func (r *Reader) Feed(data []byte) []jobs.Event {
	var evs []jobs.Event
	for len(data) > 0 {
		i := bytes.IndexByte(data, '\n')
		part := data
		if i >= 0 {
			part = data[:i]
		}
		switch {
		case r.skipped > 0 || len(r.line)+len(part) > maxLine:
			r.skipped += len(r.line) + len(part)
			r.line = r.line[:0]
		default:
			r.line = append(r.line, part...)
		}
		if i < 0 {
			break
		}
		data = data[i+1:]
		if r.skipped > 0 {
			evs = append(evs, jobs.Event{Type: jobs.EventStdout, Data: fmt.Sprintf("[a stream line of %d bytes was skipped]\n", r.skipped)})
			r.skipped = 0
			continue
		}
		evs = append(evs, r.lineEvents(r.line)...)
		r.line = r.line[:0]
	}
	return evs
}

// Flush returns the events of a last line without a newline.
func (r *Reader) Flush() []jobs.Event {
	if len(r.line) == 0 {
		return nil
	}
	evs := r.lineEvents(r.line)
	r.line = nil
	return evs
}

// Outcome is what the stream said so far.
func (r *Reader) Outcome() Outcome { return r.out }

func (r *Reader) lineEvents(line []byte) []jobs.Event {
	line = bytes.TrimSpace(line)
	if len(line) == 0 {
		return nil
	}
	if line[0] != '{' || !json.Valid(line) {
		// Not part of the stream (a wrapper's message): kept as it is.
		return []jobs.Event{{Type: jobs.EventStdout, Data: capText(string(line)+"\n", maxEventData)}}
	}
	if r.agent == OpenCode {
		return r.openCode(line)
	}
	return r.claude(line)
}

func capText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n
	for i > 0 && s[i]&0xC0 == 0x80 {
		i--
	}
	return s[:i] + "…[truncated]"
}

// inputText renders a tool's input for an event.
func inputText(raw json.RawMessage) string {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		return ""
	}
	return capText(b.String(), maxEventData)
}

// block is a content block of Claude Code's messages.
type block struct {
	Type    string          `json:"type"`
	Text    string          `json:"text"`
	Name    string          `json:"name"`
	Input   json.RawMessage `json:"input"`
	Content json.RawMessage `json:"content"` // tool_result: string or blocks
	IsError bool            `json:"is_error"`
}

// resultText is a tool_result's content as text.
func resultText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []block
	_ = json.Unmarshal(raw, &parts)
	var out []string
	for _, p := range parts {
		if p.Type == "text" {
			out = append(out, p.Text)
		} else if p.Type != "" {
			out = append(out, "["+p.Type+"]")
		}
	}
	return strings.Join(out, "\n")
}

// claude reads one line of `claude -p --output-format stream-json`:
// system, assistant, user (tool results) and the closing result line.
func (r *Reader) claude(line []byte) []jobs.Event {
	var rec struct {
		Type    string `json:"type"`
		Subtype string `json:"subtype"`
		Message struct {
			Content json.RawMessage `json:"content"`
		} `json:"message"`
		Result   string   `json:"result"`
		IsError  bool     `json:"is_error"`
		NumTurns int      `json:"num_turns"`
		Errors   []string `json:"errors"`
	}
	if json.Unmarshal(line, &rec) != nil {
		return nil
	}
	var blocks []block
	if len(rec.Message.Content) > 0 && rec.Message.Content[0] == '[' {
		_ = json.Unmarshal(rec.Message.Content, &blocks)
	}
	var evs []jobs.Event
	switch rec.Type {
	case "assistant":
		for _, b := range blocks {
			switch b.Type {
			case "text":
				evs = append(evs, jobs.Event{Type: jobs.EventAssistant, Data: capText(b.Text, maxEventData)})
			case "tool_use":
				evs = append(evs, jobs.Event{Type: jobs.EventToolUse, Tool: capText(b.Name, 128), Data: inputText(b.Input)})
			}
		}
	case "user":
		for _, b := range blocks {
			if b.Type == "tool_result" {
				evs = append(evs, jobs.Event{Type: jobs.EventToolResult, Data: capText(resultText(b.Content), maxEventData), IsError: b.IsError})
			}
		}
	case "result":
		r.out = Outcome{Output: capText(rec.Result, maxOutput), Ended: true, IsError: rec.IsError, Turns: rec.NumTurns}
		if rec.IsError {
			r.out.Error = capText(rec.Result, 1000)
			if len(rec.Errors) > 0 {
				r.out.Error = capText(strings.Join(rec.Errors, "; "), 1000)
			}
			if r.out.Error == "" {
				r.out.Error = "the agent ended with " + capText(rec.Subtype, 64)
			}
		}
		evs = append(evs, jobs.Event{Type: jobs.EventResult, Data: r.out.Output, IsError: rec.IsError, Message: r.out.Error})
	}
	return evs
}

// openCode reads one line of `opencode run --format json`: step_start,
// text, tool_use (a finished tool call with its output), step_finish and
// error. The answer is the text of the last step.
func (r *Reader) openCode(line []byte) []jobs.Event {
	var rec struct {
		Type string `json:"type"`
		Part struct {
			Text   string `json:"text"`
			Tool   string `json:"tool"`
			Reason string `json:"reason"`
			State  struct {
				Status string          `json:"status"`
				Input  json.RawMessage `json:"input"`
				Output string          `json:"output"`
				Error  string          `json:"error"`
			} `json:"state"`
		} `json:"part"`
		Error json.RawMessage `json:"error"`
	}
	if json.Unmarshal(line, &rec) != nil {
		return nil
	}
	switch rec.Type {
	case "step_start":
		r.text.Reset()
	case "text":
		r.text.WriteString(rec.Part.Text)
		return []jobs.Event{{Type: jobs.EventAssistant, Data: capText(rec.Part.Text, maxEventData)}}
	case "tool_use":
		failed := rec.Part.State.Status == "error"
		out := rec.Part.State.Output
		if failed {
			out = rec.Part.State.Error
		}
		return []jobs.Event{
			{Type: jobs.EventToolUse, Tool: capText(rec.Part.Tool, 128), Data: inputText(rec.Part.State.Input)},
			{Type: jobs.EventToolResult, Data: capText(out, maxEventData), IsError: failed},
		}
	case "step_finish":
		r.out.Turns++
		if rec.Part.Reason != "tool-calls" {
			r.out.Output, r.out.Ended = capText(r.text.String(), maxOutput), true
			return []jobs.Event{{Type: jobs.EventResult, Data: r.out.Output}}
		}
	case "error":
		msg := errorMessage(rec.Error)
		r.out.IsError, r.out.Error, r.out.Ended = true, msg, true
		return []jobs.Event{{Type: jobs.EventResult, IsError: true, Message: msg}}
	}
	return nil
}

// errorMessage digs a message out of an error object of unknown shape.
func errorMessage(raw json.RawMessage) string {
	var e struct {
		Name    string `json:"name"`
		Message string `json:"message"`
		Data    struct {
			Message string `json:"message"`
		} `json:"data"`
	}
	_ = json.Unmarshal(raw, &e)
	msg := e.Data.Message
	if msg == "" {
		msg = e.Message
	}
	if msg == "" {
		msg = e.Name
	}
	if msg == "" {
		msg = "the agent reported an error"
	}
	return capText(msg, 1000)
}
