package modelgw

import (
	"bytes"
	"encoding/json"
)

// Usage is what one model call consumed, as the API's answer reports it.
type Usage struct {
	InputTokens              int64 `json:"input_tokens"`
	OutputTokens             int64 `json:"output_tokens"`
	CacheCreationInputTokens int64 `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int64 `json:"cache_read_input_tokens"`
}

// Total is every token the call is charged for.
func (u Usage) Total() int64 {
	return u.InputTokens + u.OutputTokens + u.CacheCreationInputTokens + u.CacheReadInputTokens
}

// usagePart is a usage object as sent: absent fields stay nil, because a
// streamed message_delta repeats only some counts (cumulatively).
type usagePart struct {
	InputTokens              *int64 `json:"input_tokens"`
	OutputTokens             *int64 `json:"output_tokens"`
	CacheCreationInputTokens *int64 `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     *int64 `json:"cache_read_input_tokens"`
}

// merge takes every count p carries; counts are cumulative, never summed.
func (u *Usage) merge(p *usagePart) {
	if p == nil {
		return
	}
	set := func(dst *int64, v *int64) {
		if v != nil && *v >= 0 {
			*dst = *v
		}
	}
	set(&u.InputTokens, p.InputTokens)
	set(&u.OutputTokens, p.OutputTokens)
	set(&u.CacheCreationInputTokens, p.CacheCreationInputTokens)
	set(&u.CacheReadInputTokens, p.CacheReadInputTokens)
}

// maxMeterLine bounds one SSE line the meter looks into; usage lives in
// message_start and message_delta, which are small. Longer lines (large
// text deltas) pass through unread.
const maxMeterLine = 64 << 10

// maxMeterJSON bounds a non-streamed answer the meter keeps to read its
// usage; past it the usage is unknown.
const maxMeterJSON = 16 << 20

// meter watches an answer's bytes on their way to the agent and keeps the
// usage it reports: a streamed answer's message_start and message_delta
// events, or a JSON answer's usage object. It never changes the bytes.
type meter struct {
	stream bool
	usage  Usage
	seen   bool // a usage object was read

	line    []byte // the SSE line being read
	skip    bool   // the current line is too long: ignore it
	body    bytes.Buffer
	tooLong bool
}

// Write observes p.
func (m *meter) Write(p []byte) (int, error) {
	if !m.stream {
		if !m.tooLong {
			if m.body.Len()+len(p) > maxMeterJSON {
				m.tooLong = true
				m.body = bytes.Buffer{}
			} else {
				m.body.Write(p)
			}
		}
		return len(p), nil
	}
	for _, b := range p {
		if b == '\n' {
			if !m.skip {
				m.sseLine(bytes.TrimSuffix(m.line, []byte("\r")))
			}
			m.line, m.skip = m.line[:0], false
			continue
		}
		if m.skip {
			continue
		}
		if len(m.line) >= maxMeterLine {
			m.skip = true
			continue
		}
		m.line = append(m.line, b)
	}
	return len(p), nil
}

// sseLine reads one line of the event stream. Only data lines matter: the
// JSON's type field names the event as its event line does.
func (m *meter) sseLine(line []byte) {
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return
	}
	var ev struct {
		Type    string `json:"type"`
		Message *struct {
			Usage *usagePart `json:"usage"`
		} `json:"message"`
		Usage *usagePart `json:"usage"`
	}
	if json.Unmarshal(bytes.TrimSpace(data), &ev) != nil {
		return
	}
	switch ev.Type {
	case "message_start":
		if ev.Message != nil && ev.Message.Usage != nil {
			m.usage.merge(ev.Message.Usage)
			m.seen = true
		}
	case "message_delta":
		if ev.Usage != nil {
			m.usage.merge(ev.Usage)
			m.seen = true
		}
	}
}

// Result returns the usage read, and whether the answer reported any.
func (m *meter) Result() (Usage, bool) {
	if !m.stream {
		if m.tooLong || m.body.Len() == 0 {
			return Usage{}, false
		}
		var msg struct {
			Usage       *usagePart `json:"usage"`
			InputTokens *int64     `json:"input_tokens"` // count_tokens
		}
		if json.Unmarshal(m.body.Bytes(), &msg) != nil {
			return Usage{}, false
		}
		switch {
		case msg.Usage != nil:
			m.usage.merge(msg.Usage)
			m.seen = true
		case msg.InputTokens != nil:
			// count_tokens answers a count, which costs nothing.
			m.seen = true
		}
	}
	return m.usage, m.seen
}
