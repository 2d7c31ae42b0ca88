package modelgw

import (
	"testing"
)

const sampleStream = "event: message_start\r\n" +
	`data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"usage":{"input_tokens":120,"output_tokens":1,"cache_creation_input_tokens":7,"cache_read_input_tokens":3}}}` + "\n\n" +
	"event: ping\ndata: {\"type\":\"ping\"}\n\n" +
	"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"usage: {\\\"output_tokens\\\": 999}\"}}\n\n" +
	"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n" +
	"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"output_tokens\":42}}\n\n" +
	"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"

// TestMeterReadsStreamedUsage: cumulative counts are taken, not summed;
// a text delta that looks like usage is not; chunking does not matter.
func TestMeterReadsStreamedUsage(t *testing.T) {
	want := Usage{InputTokens: 120, OutputTokens: 42, CacheCreationInputTokens: 7, CacheReadInputTokens: 3}
	for _, size := range []int{1, 2, 7, 64, len(sampleStream)} {
		m := &meter{stream: true}
		for i := 0; i < len(sampleStream); i += size {
			_, _ = m.Write([]byte(sampleStream[i:min(i+size, len(sampleStream))]))
		}
		got, ok := m.Result()
		if !ok || got != want {
			t.Fatalf("chunks of %d: %+v %v, want %+v", size, got, ok, want)
		}
		if got.Total() != 172 {
			t.Fatalf("total %d", got.Total())
		}
	}
	m := &meter{}
	_, _ = m.Write([]byte(`{"id":"msg_1","content":[{"type":"text","text":"x"}],"usage":{"input_tokens":10,"output_tokens":5}}`))
	if got, ok := m.Result(); !ok || got.Total() != 15 {
		t.Fatalf("json: %+v %v", got, ok)
	}
	m = &meter{}
	_, _ = m.Write([]byte(`{"input_tokens":10}`))
	if got, ok := m.Result(); !ok || got.Total() != 0 {
		t.Fatalf("count_tokens is free: %+v %v", got, ok)
	}
	m = &meter{}
	_, _ = m.Write([]byte(`<html>bad gateway</html>`))
	if _, ok := m.Result(); ok {
		t.Fatal("usage read from a non-JSON body")
	}
}

// FuzzMeter: any byte stream, in any chunking, gives the same usage as in
// one piece, never negative, and never panics.
func FuzzMeter(f *testing.F) {
	f.Add([]byte(sampleStream), uint8(3), true)
	f.Add([]byte(`{"usage":{"input_tokens":1,"output_tokens":2}}`), uint8(1), false)
	f.Add([]byte("data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":-5}}\n"), uint8(5), true)
	f.Fuzz(func(t *testing.T, data []byte, chunk uint8, stream bool) {
		whole := &meter{stream: stream}
		_, _ = whole.Write(data)
		parts := &meter{stream: stream}
		n := int(chunk) + 1
		for i := 0; i < len(data); i += n {
			_, _ = parts.Write(data[i:min(i+n, len(data))])
		}
		u1, ok1 := whole.Result()
		u2, ok2 := parts.Result()
		if u1 != u2 || ok1 != ok2 {
			t.Fatalf("chunking changed the result: %+v/%v vs %+v/%v", u1, ok1, u2, ok2)
		}
		if u1.InputTokens < 0 || u1.OutputTokens < 0 || u1.CacheCreationInputTokens < 0 || u1.CacheReadInputTokens < 0 {
			t.Fatalf("negative usage %+v", u1)
		}
	})
}
