package anthropicfake

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
)

func post(t *testing.T, url, key string, hdr map[string]string, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("x-api-key", key)
	}
	req.Header.Set("anthropic-version", "2023-06-01")
	for k, v := range hdr {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

type apiErr struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
	RequestID string `json:"request_id"`
}

// TestRefusesWhatTheAPIRefuses sends each kind of bad request and expects
// the API's status, error type and error shape.
func TestRefusesWhatTheAPIRefuses(t *testing.T) {
	f := New(Options{Key: "k-right"})
	defer f.Close()
	ok := `{"model":"claude-sonnet-4-5","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`
	for _, c := range []struct {
		name, path, key string
		hdr             map[string]string
		body            string
		status          int
		typ, msg        string
	}{
		{"no key", "/v1/messages", "", nil, ok, 401, "authentication_error", "x-api-key header is required"},
		{"wrong key", "/v1/messages", "k-wrong", nil, ok, 401, "authentication_error", "invalid x-api-key"},
		{"no version", "/v1/messages", "k-right", map[string]string{"anthropic-version": ""}, ok, 400, "invalid_request_error", "anthropic-version"},
		{"bad version", "/v1/messages", "k-right", map[string]string{"anthropic-version": "2020-01-01"}, ok, 400, "invalid_request_error", "not a valid version"},
		{"unknown path", "/v1/complete", "k-right", nil, ok, 404, "not_found_error", "Not found"},
		{"not json", "/v1/messages", "k-right", nil, `{"model":`, 400, "invalid_request_error", "not valid JSON"},
		{"no model", "/v1/messages", "k-right", nil, `{"max_tokens":1,"messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error", "model: Field required"},
		{"no max_tokens", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error", "max_tokens"},
		{"zero max_tokens", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":0,"messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error", "max_tokens"},
		{"no messages", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[]}`, 400, "invalid_request_error", "at least one message"},
		{"assistant first", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"assistant","content":"x"}]}`, 400, "invalid_request_error", "first message"},
		{"bad role", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"system","content":"x"}]}`, 400, "invalid_request_error", "role"},
		{"unknown block", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":[{"type":"video"}]}]}`, 400, "invalid_request_error", "does not match"},
		{"orphan tool_result", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_x","content":"1"}]}]}`, 400, "invalid_request_error", "unexpected `tool_use_id`"},
		{"unanswered tool_use", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":"a"},{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"Bash","input":{}}]},{"role":"user","content":"b"}]}`, 400, "invalid_request_error", "without `tool_result`"},
		{"bad tool name", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"tools":[{"name":"a b","input_schema":{}}],"messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error", "tools.0.name"},
		{"tool without schema", "/v1/messages", "k-right", nil, `{"model":"claude-sonnet-4-5","max_tokens":1,"tools":[{"name":"t"}],"messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error", "input_schema"},
		{"temperature on the new version", "/v1/messages", "k-right", map[string]string{"anthropic-version": "2026-10-21"}, `{"model":"claude-sonnet-4-5","max_tokens":1,"temperature":1,"messages":[{"role":"user","content":"x"}]}`, 400, "invalid_request_error", "temperature"},
		{"unknown model", "/v1/messages", "k-right", nil, `{"model":"claude-nope","max_tokens":1,"messages":[{"role":"user","content":"x"}]}`, 404, "not_found_error", "model: claude-nope"},
		{"too large", "/v1/messages", "k-right", nil, `{"model":"` + strings.Repeat("a", MaxRequestBytes) + `"}`, 413, "request_too_large", "maximum"},
	} {
		t.Run(c.name, func(t *testing.T) {
			resp := post(t, f.URL+c.path, c.key, c.hdr, c.body)
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d", resp.StatusCode, c.status)
			}
			var e apiErr
			if err := json.NewDecoder(resp.Body).Decode(&e); err != nil {
				t.Fatal(err)
			}
			if e.Type != "error" || e.Error.Type != c.typ || !strings.Contains(e.Error.Message, c.msg) || !strings.HasPrefix(e.RequestID, "req_") {
				t.Fatalf("got %+v, want type %s with %q", e, c.typ, c.msg)
			}
		})
	}
	// Unknown fields and betas are tolerated, as the API does; a Bearer
	// key works like x-api-key.
	resp := post(t, f.URL+"/v1/messages?beta=true", "", map[string]string{"Authorization": "Bearer k-right", "anthropic-beta": "claude-code-20250219,new-thing-2099"},
		`{"model":"claude-sonnet-4-5","max_tokens":5,"context_management":{"x":1},"output_config":{},"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
}

type sseEvent struct {
	name string
	data map[string]any
}

// readSSE parses a stream strictly: every event has an event line and a
// data line whose type equals the event name, separated by blank lines.
func readSSE(t *testing.T, r io.Reader) []sseEvent {
	t.Helper()
	var out []sseEvent
	sc := bufio.NewScanner(r)
	var name string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			var d map[string]any
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &d); err != nil {
				t.Fatalf("data line %q: %v", line, err)
			}
			if d["type"] != name {
				t.Fatalf("event %q carries type %v", name, d["type"])
			}
			out = append(out, sseEvent{name, d})
		case line == "":
		default:
			t.Fatalf("unexpected line %q", line)
		}
	}
	return out
}

// TestStreamFollowsTheDocumentedOrder drives a two-turn tool conversation
// over SSE and checks the event order, indexes, the tool input rebuilt from
// its JSON fragments, and usage.
func TestStreamFollowsTheDocumentedOrder(t *testing.T) {
	f := New(Options{Key: "k", Script: Linear(
		Reply{Content: []Block{Text("Let me check the file, it is long enough to split."), ToolUse("Bash", map[string]any{"command": "wc -l data.csv"})}},
		Reply{Content: []Block{Text("3 lines.")}},
	)})
	defer f.Close()
	body := `{"model":"claude-sonnet-4-5","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"count"}]}`
	resp := post(t, f.URL+"/v1/messages", "k", map[string]string{"Accept": "application/json"}, body)
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	evs := readSSE(t, resp.Body)
	var names []string
	var text, input bytes.Buffer
	var toolID string
	for _, e := range evs {
		names = append(names, e.name)
		switch e.name {
		case "content_block_start":
			cb := e.data["content_block"].(map[string]any)
			if cb["type"] == "tool_use" {
				toolID = cb["id"].(string)
				if e.data["index"].(float64) != 1 {
					t.Fatalf("tool block index %v", e.data["index"])
				}
			}
		case "content_block_delta":
			d := e.data["delta"].(map[string]any)
			switch d["type"] {
			case "text_delta":
				text.WriteString(d["text"].(string))
			case "input_json_delta":
				input.WriteString(d["partial_json"].(string))
			}
		case "message_delta":
			if e.data["delta"].(map[string]any)["stop_reason"] != "tool_use" {
				t.Fatalf("stop reason %v", e.data["delta"])
			}
			if e.data["usage"].(map[string]any)["output_tokens"].(float64) < 1 {
				t.Fatalf("usage %v", e.data["usage"])
			}
		}
	}
	got := strings.Join(compact(names), ",")
	want := "message_start,ping,content_block_start,content_block_delta,content_block_stop,content_block_start,content_block_delta,content_block_stop,message_delta,message_stop"
	if got != want {
		t.Fatalf("event order\n got %s\nwant %s", got, want)
	}
	if text.String() != "Let me check the file, it is long enough to split." || input.String() != `{"command":"wc -l data.csv"}` {
		t.Fatalf("text %q input %q", text.String(), input.String())
	}
	// The second turn must answer the tool_use; the fake checks the pairing.
	body2 := `{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{"role":"user","content":"count"},` +
		`{"role":"assistant","content":[{"type":"text","text":"Let me check"},{"type":"tool_use","id":"` + toolID + `","name":"Bash","input":{"command":"wc -l data.csv"}}]},` +
		`{"role":"user","content":[{"type":"tool_result","tool_use_id":"` + toolID + `","content":"3 data.csv"}]}]}`
	resp = post(t, f.URL+"/v1/messages", "k", nil, body2)
	var msg struct {
		Content    []map[string]any `json:"content"`
		StopReason string           `json:"stop_reason"`
		Usage      map[string]int   `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&msg); err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d: %v", resp.StatusCode, err)
	}
	if msg.StopReason != "end_turn" || msg.Content[0]["text"] != "3 lines." || msg.Usage["input_tokens"] < 1 {
		t.Fatalf("second turn %+v", msg)
	}
	reqs := f.Requests()
	if len(reqs) != 2 || !reqs[0].Stream || reqs[1].Stream || reqs[0].APIKey != "k" {
		t.Fatalf("recorded %+v", reqs)
	}
}

// compact folds runs of content_block_delta into one name.
func compact(names []string) []string {
	var out []string
	for _, n := range names {
		if n == "content_block_delta" && len(out) > 0 && out[len(out)-1] == n {
			continue
		}
		out = append(out, n)
	}
	return out
}

func TestCountTokensAndScriptedErrors(t *testing.T) {
	f := New(Options{Key: "k", Script: Linear(Reply{Error: &APIError{Status: 529, Type: "overloaded_error", Message: "Overloaded"}})})
	defer f.Close()
	resp := post(t, f.URL+"/v1/messages/count_tokens", "k", nil, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hello there"}]}`)
	var n map[string]int
	if err := json.NewDecoder(resp.Body).Decode(&n); err != nil || n["input_tokens"] < 1 {
		t.Fatalf("count_tokens: %v %v", n, err)
	}
	resp = post(t, f.URL+"/v1/messages", "k", nil, `{"model":"claude-sonnet-4-5","max_tokens":5,"messages":[{"role":"user","content":"x"}]}`)
	var e apiErr
	_ = json.NewDecoder(resp.Body).Decode(&e)
	if resp.StatusCode != 529 || e.Error.Type != "overloaded_error" {
		t.Fatalf("got %d %+v", resp.StatusCode, e)
	}
}
