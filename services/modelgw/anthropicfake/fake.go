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
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
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
