package agenttask

import (
	"os"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/jobs"
)

// The testdata streams were recorded from the real CLIs (Claude Code
// 2.1.331, OpenCode 1.18.33) driven by anthropicfake: a Bash call, a Write
// and a final answer; a call refused by the gateway's budget; OpenCode's
// bash call and answer.

func feedAll(t *testing.T, agent, file string, chunk int) (*Reader, []jobs.Event) {
	t.Helper()
	data, err := os.ReadFile("testdata/" + file)
	if err != nil {
		t.Fatal(err)
	}
	r := NewReader(agent)
	var evs []jobs.Event
	for i := 0; i < len(data); i += chunk {
		evs = append(evs, r.Feed(data[i:min(i+chunk, len(data))])...)
	}
	return r, append(evs, r.Flush()...)
}

func types(evs []jobs.Event) string {
	var out []string
	for _, e := range evs {
		s := e.Type
		if e.Tool != "" {
			s += ":" + e.Tool
		}
		out = append(out, s)
	}
	return strings.Join(out, ",")
}

func TestClaudeCodeStream(t *testing.T) {
	for _, chunk := range []int{1, 13, 4096, 1 << 20} {
		r, evs := feedAll(t, ClaudeCode, "claude-code.ndjson", chunk)
		want := "assistant,tool_use:Bash,tool_result,tool_use:Write,tool_result,assistant,result"
		if got := types(evs); got != want {
			t.Fatalf("chunk %d: events %s, want %s", chunk, got, want)
		}
		if evs[1].Data != `{"command":"ls -la; cat data.csv; env | sort","description":"list"}` ||
			!strings.Contains(evs[2].Data, "a,b\n1,2") || evs[6].Data != "Wrote summary.txt" {
			t.Fatalf("event payloads: %+v", evs)
		}
		o := r.Outcome()
		if !o.Ended || o.IsError || o.Output != "Wrote summary.txt" || o.Turns != 3 {
			t.Fatalf("outcome %+v", o)
		}
	}
}

func TestClaudeCodeStreamAPIError(t *testing.T) {
	r, evs := feedAll(t, ClaudeCode, "claude-code-budget.ndjson", 100)
	last := evs[len(evs)-1]
	o := r.Outcome()
	if last.Type != jobs.EventResult || !last.IsError || !o.IsError || !strings.Contains(o.Error, "model request budget (1 requests) is used up") {
		t.Fatalf("last %+v outcome %+v", last, o)
	}
}

func TestOpenCodeStream(t *testing.T) {
	r, evs := feedAll(t, OpenCode, "opencode.ndjson", 7)
	if got, want := types(evs), "tool_use:bash,tool_result,assistant,result"; got != want {
		t.Fatalf("events %s, want %s", got, want)
	}
	if evs[1].Data != "hi from bash\n" || evs[0].Data != `{"command":"echo hi from bash","description":"say hi"}` {
		t.Fatalf("tool events %+v", evs[:2])
	}
	o := r.Outcome()
	if !o.Ended || o.IsError || o.Output != "All done here." || o.Turns != 2 {
		t.Fatalf("outcome %+v", o)
	}
	r = NewReader(OpenCode)
	evs = r.Feed([]byte(`{"type":"error","error":{"name":"APIError","data":{"message":"budget used up","statusCode":429}}}` + "\n"))
	if len(evs) != 1 || !evs[0].IsError || r.Outcome().Error != "budget used up" {
		t.Fatalf("error event %+v outcome %+v", evs, r.Outcome())
	}
}

// TestReaderBounds: an over-long line is skipped with a note, text that is
// not JSON passes as stdout, and event text is capped.
func TestReaderBounds(t *testing.T) {
	r := NewReader(ClaudeCode)
	long := strings.Repeat("x", maxLine+10)
	evs := r.Feed([]byte(long[:maxLine/2]))
	evs = append(evs, r.Feed([]byte(long[maxLine/2:]+"\nplain text\n"))...)
	if len(evs) != 2 || evs[0].Type != jobs.EventStdout || !strings.Contains(evs[0].Data, "skipped") ||
		evs[1].Data != "plain text\n" {
		t.Fatalf("%+v", evs)
	}
	big := `{"type":"assistant","message":{"content":[{"type":"text","text":"` + strings.Repeat("é", maxEventData) + `"}]}}` + "\n"
	evs = r.Feed([]byte(big))
	if len(evs) != 1 || len(evs[0].Data) > maxEventData+20 || !strings.HasSuffix(evs[0].Data, "…[truncated]") {
		t.Fatalf("cap: %d bytes", len(evs[0].Data))
	}
}

// FuzzReader: any stream, in any chunking, gives the same events as whole
// and never panics.
func FuzzReader(f *testing.F) {
	for _, name := range []string{"claude-code.ndjson", "opencode.ndjson"} {
		data, _ := os.ReadFile("testdata/" + name)
		f.Add(data, uint8(7), name == "opencode.ndjson")
	}
	f.Add([]byte(`{"type":"result","is_error":true,"errors":["x"]}`), uint8(1), false)
	f.Fuzz(func(t *testing.T, data []byte, chunk uint8, oc bool) {
		agent := ClaudeCode
		if oc {
			agent = OpenCode
		}
		whole := NewReader(agent)
		a := append(whole.Feed(data), whole.Flush()...)
		parts := NewReader(agent)
		var b []jobs.Event
		n := int(chunk) + 1
		for i := 0; i < len(data); i += n {
			b = append(b, parts.Feed(data[i:min(i+n, len(data))])...)
		}
		b = append(b, parts.Flush()...)
		if types(a) != types(b) || whole.Outcome() != parts.Outcome() {
			t.Fatalf("chunking changed the result")
		}
		for _, e := range a {
			if len(e.Data) > maxEventData+64 && e.Type != jobs.EventResult {
				t.Fatalf("event of %d bytes", len(e.Data))
			}
		}
	})
}

func TestParsePolicies(t *testing.T) {
	p, err := ParsePolicies(`{"pro": {"network": "public", "max_timeout_s": 900}, "free": {"tokens_per_day": 0}}`)
	if err != nil {
		t.Fatal(err)
	}
	if p["pro"].Network != "public" || p["pro"].MaxTimeout.Seconds() != 900 || p["pro"].Budget != DefaultPolicies["pro"].Budget ||
		p["free"].Budget.TokensPerDay != 0 || p["free"].Network != "none" {
		t.Fatalf("%+v", p)
	}
	for _, bad := range []string{`{"gold":{}}`, `{"pro":{"network":"everything"}}`, `{"pro":{"max_timeout_s":0}}`,
		`{"pro":{"colour":"red"}}`, `{"free":{"requests_per_day":-1}}`, `[1]`} {
		if _, err := ParsePolicies(bad); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}
