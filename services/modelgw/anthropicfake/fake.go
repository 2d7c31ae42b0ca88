// Package anthropicfake is a stand-in for Anthropic's Messages API, exactly
// as much of it as the coding agents use: POST /v1/messages (JSON or
// streamed as server-sent events in the documented order, with tool_use
// blocks) and POST /v1/messages/count_tokens. It is strict the way the API
// is (authentication, anthropic-version, the request's shape, tool_use and
// tool_result pairing, unknown models, the 32 MB request limit) and answers
// errors in the API's shape; like the API it tolerates fields and betas it
// does not know. Replies come from a script, so a real CLI can be driven
// through a whole conversation, and every request is recorded.
//
// Reference: platform.claude.com/docs/en/api/messages,
// .../build-with-claude/streaming and .../api/errors (summarised in
// /work/shared/reference/anthropic-api-and-claude-code.md).
package anthropicfake

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Versions of the anthropic-version header the API accepts.
var Versions = map[string]bool{"2023-01-01": true, "2023-06-01": true, "2026-10-21": true}

// MaxRequestBytes is the API's request size limit (413 above it).
const MaxRequestBytes = 32 << 20

// Block is one content block of a scripted reply.
type Block struct {
	Type  string          `json:"type"`            // "text" or "tool_use"
	Text  string          `json:"text,omitempty"`  // text
	ID    string          `json:"id,omitempty"`    // tool_use; generated when empty
	Name  string          `json:"name,omitempty"`  // tool_use
	Input json.RawMessage `json:"input,omitempty"` // tool_use; {} when empty
}

// Text is a text block.
func Text(s string) Block { return Block{Type: "text", Text: s} }

// ToolUse is a tool_use block calling name with input (marshalled to JSON).
func ToolUse(name string, input any) Block {
	b, err := json.Marshal(input)
	if err != nil {
		panic(err)
	}
	return Block{Type: "tool_use", Name: name, Input: b}
}

// Reply is one scripted answer: content, or an API error.
type Reply struct {
	Content []Block
	// StopReason defaults to "tool_use" when Content has a tool_use block,
	// else "end_turn".
	StopReason string
	// Delay holds the answer back (a slow model), or, streaming, the
	// events after message_start.
	Delay time.Duration
	// Error, when set, is the answer: Status and the API's error type.
	Error *APIError
	// StreamError ends a streamed answer after message_start with an
	// `event: error` (the API's way of failing after the 200).
	StreamError *APIError
}

// APIError is an error answer in the API's shape.
type APIError struct {
	Status  int
	Type    string // invalid_request_error, rate_limit_error, overloaded_error, …
	Message string
}

// Request is what a script sees of a valid request.
type Request struct {
	Model    string
	Stream   bool
	System   json.RawMessage
	Messages []Message
	// Turn is how many assistant messages the history holds: the index of
	// the reply a linear script gives next.
	Turn int
}

// Message is one message of the history.
type Message struct {
	Role    string
	Content []ContentBlock // a string content is one text block
}

// ContentBlock is a block of the history, as sent.
type ContentBlock struct {
	Type      string          `json:"type"`
	Text      string          `json:"text,omitempty"`
	ID        string          `json:"id,omitempty"`
	Name      string          `json:"name,omitempty"`
	Input     json.RawMessage `json:"input,omitempty"`
	ToolUseID string          `json:"tool_use_id,omitempty"`
	Content   json.RawMessage `json:"content,omitempty"` // tool_result: string or blocks
	IsError   bool            `json:"is_error,omitempty"`
}

// ResultText is a tool_result's content as text (string content, or its
// text blocks joined).
func (b ContentBlock) ResultText() string {
	var s string
	if json.Unmarshal(b.Content, &s) == nil {
		return s
	}
	var parts []ContentBlock
	_ = json.Unmarshal(b.Content, &parts)
	var out []string
	for _, p := range parts {
		if p.Type == "text" {
			out = append(out, p.Text)
		}
	}
	return strings.Join(out, "\n")
}

// LastToolResults are the tool_result blocks of the last user message.
func (r Request) LastToolResults() []ContentBlock {
	if len(r.Messages) == 0 {
		return nil
	}
	var out []ContentBlock
	for _, b := range r.Messages[len(r.Messages)-1].Content {
		if b.Type == "tool_result" {
			out = append(out, b)
		}
	}
	return out
}

// Script picks the reply to a request.
type Script func(Request) Reply

// Linear answers the n-th assistant turn of every conversation with
// replies[n], and the turns past the end with a short final text; each
// conversation (each history) progresses on its own, so many agents can
// share one fake.
func Linear(replies ...Reply) Script {
	return func(r Request) Reply {
		if r.Turn < len(replies) {
			return replies[r.Turn]
		}
		return Reply{Content: []Block{Text("Done.")}}
	}
}

// Recorded is one request as it reached the fake. Keys are kept so tests
// can assert which key arrived (the fake is a test double; it never runs
// with a real key).
type Recorded struct {
	Method, Path, Query string
	APIKey              string // x-api-key
	Authorization       string
	Version, Beta       string
	UserAgent           string
	Model               string
	Stream              bool
	BodyBytes           int
	Status              int
	InputTokens         int
	OutputTokens        int
}

// Options configure a Fake.
type Options struct {
	// Key is the only API key accepted (x-api-key or Bearer).
	Key string
	// Models are the models that exist; default a few current ones.
	Models []string
	Script Script
}

// Fake is a running fake API.
type Fake struct {
	URL string
	o   Options
	srv *httptest.Server

	mu       sync.Mutex
	requests []Recorded
}

// DefaultModels exist when Options.Models is empty.
var DefaultModels = []string{"claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-4-5"}

// New starts a fake on a loopback port; Close stops it.
func New(o Options) *Fake {
	if len(o.Models) == 0 {
		o.Models = DefaultModels
	}
	if o.Script == nil {
		o.Script = Linear()
	}
	f := &Fake{o: o}
	f.srv = httptest.NewServer(f)
	f.URL = f.srv.URL
	return f
}

// Close stops the server.
func (f *Fake) Close() { f.srv.Close() }

// Requests returns every request so far.
func (f *Fake) Requests() []Recorded {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Recorded(nil), f.requests...)
}

func (f *Fake) record(r Recorded) {
	f.mu.Lock()
	f.requests = append(f.requests, r)
	f.mu.Unlock()
}

func newID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// writeError answers in the API's error shape.
func writeError(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	if status == http.StatusTooManyRequests {
		w.Header().Set("retry-after", "1")
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"type": "error", "error": map[string]string{"type": typ, "message": msg}, "request_id": w.Header().Get("request-id"),
	})
}

// ServeHTTP implements the API.
func (f *Fake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("request-id", newID("req_"))
	rec := Recorded{Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, APIKey: r.Header.Get("x-api-key"),
		Authorization: r.Header.Get("Authorization"), Version: r.Header.Get("anthropic-version"),
		Beta: r.Header.Get("anthropic-beta"), UserAgent: r.Header.Get("User-Agent")}
	sw := &statusWriter{ResponseWriter: w}
	defer func() {
		rec.Status = sw.status
		f.record(rec)
	}()
	f.serve(sw, r, &rec)
}

func (f *Fake) serve(w http.ResponseWriter, r *http.Request, rec *Recorded) {
	countTokens := false
	switch r.URL.Path {
	case "/v1/messages":
	case "/v1/messages/count_tokens":
		countTokens = true
	default:
		writeError(w, http.StatusNotFound, "not_found_error", "Not found")
		return
	}
	if r.Method != http.MethodPost {
		writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "Method Not Allowed")
		return
	}
	if msg := f.authError(r); msg != "" {
		writeError(w, http.StatusUnauthorized, "authentication_error", msg)
		return
	}
	v := r.Header.Get("anthropic-version")
	switch {
	case v == "":
		writeError(w, http.StatusBadRequest, "invalid_request_error", "anthropic-version: header is required")
		return
	case !Versions[v]:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "anthropic-version: "+strconv.Quote(v)+" is not a valid version")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxRequestBytes+1))
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "could not read the request body")
		return
	}
	rec.BodyBytes = len(body)
	if len(body) > MaxRequestBytes {
		writeError(w, http.StatusRequestEntityTooLarge, "request_too_large", "Request exceeds the maximum allowed number of bytes.")
		return
	}
	req, apiErr := f.parse(body, v, countTokens)
	rec.Model = req.Model
	rec.Stream = req.Stream
	if apiErr != nil {
		writeError(w, apiErr.Status, apiErr.Type, apiErr.Message)
		return
	}
	rec.InputTokens = estimateTokens(len(body))
	if countTokens {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]int{"input_tokens": rec.InputTokens})
		return
	}
	reply := f.o.Script(req)
	if reply.Error != nil {
		if !sleep(r, reply.Delay) {
			return
		}
		writeError(w, reply.Error.Status, reply.Error.Type, reply.Error.Message)
		return
	}
	content, stop := materialise(reply)
	rec.OutputTokens = outputTokens(content)
	msg := message{ID: newID("msg_"), Type: "message", Role: "assistant", Model: req.Model, Content: content,
		StopReason: &stop, Usage: usage{InputTokens: rec.InputTokens, OutputTokens: rec.OutputTokens}}
	if req.Stream {
		f.stream(w, r, msg, reply)
		return
	}
	if !sleep(r, reply.Delay) {
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(msg)
}

// authError checks the key: x-api-key, else a Bearer token.
func (f *Fake) authError(r *http.Request) string {
	key := r.Header.Get("x-api-key")
	if key == "" {
		if b, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			key = b
		}
	}
	switch {
	case key == "":
		return "x-api-key header is required"
	case key != f.o.Key:
		return "invalid x-api-key"
	}
	return ""
}

func sleep(r *http.Request, d time.Duration) bool {
	if d <= 0 {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// estimateTokens is the fake's token count: about four bytes a token.
func estimateTokens(n int) int { return max(1, n/4) }

func outputTokens(content []outBlock) int {
	n := 0
	for _, b := range content {
		if b.Text != nil {
			n += len(*b.Text)
		}
		n += len(b.Input)
	}
	return estimateTokens(n)
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Flush() {
	if fl, ok := s.ResponseWriter.(http.Flusher); ok {
		fl.Flush()
	}
}

// The response shapes.
type usage struct {
	InputTokens              int `json:"input_tokens"`
	OutputTokens             int `json:"output_tokens"`
	CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int `json:"cache_read_input_tokens"`
}

type outBlock struct {
	Type  string          `json:"type"`
	Text  *string         `json:"text,omitempty"`
	ID    string          `json:"id,omitempty"`
	Name  string          `json:"name,omitempty"`
	Input json.RawMessage `json:"input,omitempty"`
}

type message struct {
	ID           string     `json:"id"`
	Type         string     `json:"type"`
	Role         string     `json:"role"`
	Model        string     `json:"model"`
	Content      []outBlock `json:"content"`
	StopReason   *string    `json:"stop_reason"`
	StopSequence *string    `json:"stop_sequence"`
	Usage        usage      `json:"usage"`
}

func materialise(r Reply) ([]outBlock, string) {
	out := make([]outBlock, 0, len(r.Content))
	hasTool := false
	for _, b := range r.Content {
		switch b.Type {
		case "text":
			t := b.Text
			out = append(out, outBlock{Type: "text", Text: &t})
		case "tool_use":
			hasTool = true
			id := b.ID
			if id == "" {
				id = newID("toolu_")
			}
			in := b.Input
			if len(in) == 0 {
				in = json.RawMessage(`{}`)
			}
			out = append(out, outBlock{Type: "tool_use", ID: id, Name: b.Name, Input: in})
		default:
			panic(fmt.Sprintf("anthropicfake: scripted block type %q", b.Type))
		}
	}
	stop := r.StopReason
	if stop == "" {
		stop = "end_turn"
		if hasTool {
			stop = "tool_use"
		}
	}
	return out, stop
}

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
