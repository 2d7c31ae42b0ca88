package codesandbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"
)

var fuzzNow = time.Unix(1_760_000_000, 0)

func TestParseRateLimit(t *testing.T) {
	h := func(kv ...string) http.Header {
		out := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			out.Set(kv[i], kv[i+1])
		}
		return out
	}
	cases := []struct {
		h      http.Header
		budget string
		wait   time.Duration
	}{
		{h(), "", 0},
		{h("x-csb-vms-remaining", "0", "x-csb-vms-used", "10"), "concurrently running VMs", 0},
		{h("x-csb-rate-hourly-remaining", "0", "x-csb-rate-hourly-reset", "1760000600"), "API requests per hour", 10 * time.Minute},
		{h("x-csb-sandbox-hourly-remaining", "-1", "x-csb-sandbox-hourly-reset", "1760000060000"), "sandboxes created per hour", time.Minute},
		{h("x-csb-rate-hourly-remaining", "0", "x-csb-rate-hourly-reset", "2025-10-09T09:00:00Z"), "API requests per hour", clampWait(time.Date(2025, 10, 9, 9, 0, 0, 0, time.UTC).Sub(fuzzNow))},
		{h("x-csb-rate-hourly-remaining", "5", "x-csb-rate-hourly-reset", "1760000600"), "", 0},
		{h("x-csb-rate-hourly-remaining", "0", "x-csb-rate-hourly-reset", "90"), "API requests per hour", 90 * time.Second},
		{h("Retry-After", "7"), "", 7 * time.Second},
		{h("Retry-After", "99999999999"), "", maxHeaderWait},
		{h("x-csb-rate-hourly-remaining", "0", "x-csb-rate-hourly-reset", "1700000000"), "API requests per hour", 0}, // in the past
		{h("x-csb-rate-hourly-remaining", "0", "x-csb-rate-hourly-reset", "soon"), "API requests per hour", 0},
	}
	for i, c := range cases {
		rl := ParseRateLimit(c.h, fuzzNow)
		if rl.Budget != c.budget || rl.Wait != c.wait {
			t.Errorf("case %d: %+v, want %q %v", i, rl, c.budget, c.wait)
		}
	}
}

func FuzzParseRateLimit(f *testing.F) {
	f.Add("0", "1760000600", "7")
	f.Add("-5", "2025-10-09T09:00:00Z", "Wed, 21 Oct 2015 07:28:00 GMT")
	f.Add("x", "99999999999999999999", "-1")
	f.Fuzz(func(t *testing.T, remaining, reset, retryAfter string) {
		h := http.Header{}
		h.Set("x-csb-rate-hourly-remaining", remaining)
		h.Set("x-csb-rate-hourly-reset", reset)
		h.Set("Retry-After", retryAfter)
		rl := ParseRateLimit(h, fuzzNow)
		if rl.Wait < 0 || rl.Wait > maxHeaderWait {
			t.Fatalf("wait %v out of range", rl.Wait)
		}
	})
}

func FuzzDecodeEnvelope(f *testing.F) {
	f.Add([]byte(`{"success":true,"errors":[],"data":{"id":"abc"}}`))
	f.Add([]byte(`{"success":false,"errors":["Sandbox not found"]}`))
	f.Add([]byte(`{"success":false,"errors":[{"message":"x","code":1}]}`))
	f.Add([]byte(`{"success":false}`))
	f.Add([]byte(`<html>502</html>`))
	f.Fuzz(func(t *testing.T, body []byte) {
		data, msg, err := decodeEnvelope(body)
		if len(msg) > maxServerMessage || !utf8.ValidString(msg) {
			t.Fatalf("message not bounded/clean: %q", msg)
		}
		for _, r := range msg {
			if r < 0x20 || r == 0x7f {
				t.Fatalf("control character in %q", msg)
			}
		}
		if err == nil && (len(bytes.TrimSpace(data)) == 0 || string(bytes.TrimSpace(data)) == "null") {
			t.Fatal("no error without data")
		}
	})
}

func FuzzStripANSI(f *testing.F) {
	f.Add([]byte("\x1b[1;32mok\x1b[0m\r\n"))
	f.Add([]byte("\x1b]0;t\x07x\x1b]8;;u\x1b\\y\x1b(B"))
	f.Add([]byte("plain text"))
	f.Fuzz(func(t *testing.T, b []byte) {
		out := CleanOutput(b)
		if bytes.IndexByte(out, 0x1b) >= 0 {
			t.Fatalf("ESC left in %q", out)
		}
		if len(out) > len(b) {
			t.Fatal("output grew")
		}
		// Text without ESC or CR passes through unchanged.
		if !bytes.ContainsAny(b, "\x1b\r") && !bytes.Equal(out, b) {
			t.Fatalf("%q changed to %q", b, out)
		}
	})
}

func FuzzShellQuote(f *testing.F) {
	f.Add("it's")
	f.Add("'; rm -rf / #")
	f.Fuzz(func(t *testing.T, s string) {
		q := ShellQuote(s)
		if !strings.HasPrefix(q, "'") || !strings.HasSuffix(q, "'") {
			t.Fatal(q)
		}
		// Outside the quotes only the '\'' sequence appears.
		inner := strings.ReplaceAll(q[1:len(q)-1], `'\''`, "")
		if strings.Contains(inner, "'") {
			t.Fatalf("unescaped quote in %q", q)
		}
	})
}

// FuzzPitcherMessage feeds arbitrary frames to the agent-message decoder
// and the error mapping the read loop uses.
func FuzzPitcherMessage(f *testing.F) {
	for _, m := range []map[string]any{
		{"id": 1, "method": "fs/readFile", "status": 0, "result": map[string]any{"content": []byte("x")}},
		{"id": 2, "status": 1, "error": map[string]any{"code": 102, "message": "no\x00such\nfile", "data": map[string]any{"errno": 2}}},
		{"method": "shell/out", "params": map[string]any{"shellId": "s", "out": "\x1b[1mhi"}},
		{"id": "x", "status": "0"},
		{"id": 3, "result": nil},
		{"id": 4, "error": nil},
		{"id": 5, "error": map[string]any{"message": "no code"}},
	} {
		b, _ := msgpack.Marshal(m)
		f.Add(b)
	}
	f.Add([]byte{0xc1})
	f.Fuzz(func(t *testing.T, b []byte) {
		var m inMsg
		if msgpack.Unmarshal(b, &m) != nil {
			return
		}
		if m.isResponse() && m.isNotification() {
			t.Fatalf("both a response and a notification: %+v", m)
		}
		if m.isResponse() && len(m.Error) > 0 {
			var pe *PitcherError
			if !errors.As(pitcherError("m", m), &pe) || len(pe.Message) > maxServerMessage || !utf8.ValidString(pe.Message) {
				t.Fatalf("error not bounded/clean: %+v", pe)
			}
		}
	})
}

func TestParseTimestamp(t *testing.T) {
	for in, want := range map[string]int64{ // JSON value → Unix milliseconds, 0 for no time
		`"1767225600"`:           1767225600000,
		`"1767225600123"`:        1767225600123,
		`"9999999999"`:           9999999999000, // below 1e10: seconds
		`"10000000000"`:          10000000000,   // from 1e10: milliseconds
		`1767225600`:             1767225600000,
		`1767225600123.9`:        1767225600123,
		`"  42abc"`:              42000, // parseInt: white space, then the digit prefix
		`"+7"`:                   7000,
		`"-7"`:                   -7000,
		`"0"`:                    0,
		`""`:                     0,
		`"abc"`:                  0,
		`"2026-01-01T00:00:00Z"`: 2026000, // parseInt reads the year, as the SDK would
		`null`:                   0,
		`true`:                   0,
		`{"a":1}`:                0,
		`[1]`:                    0,
		`"99999999999999999999"`: 0, // past a JS Date
		`1e300`:                  0,
	} {
		var ts Timestamp
		if err := json.Unmarshal([]byte(in), &ts); err != nil {
			t.Errorf("%s: %v", in, err)
			continue
		}
		got := int64(0)
		if !ts.IsZero() {
			got = ts.UnixMilli()
		}
		if got != want {
			t.Errorf("%s: %d, want %d", in, got, want)
		}
	}
}

// FuzzParseTimestamp: any JSON value decodes without error; a time, when
// there is one, is within a JS Date's range, and decimal seconds or
// milliseconds come back exactly.
func FuzzParseTimestamp(f *testing.F) {
	for _, s := range []string{`"1767225600"`, `"1767225600123"`, `1767225600`, `" -12x"`, `""`, `null`, `"0"`, `1e400`, `"١٢٣"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if !json.Valid(b) {
			return
		}
		var ts Timestamp
		if err := json.Unmarshal(b, &ts); err != nil {
			t.Fatalf("%q: %v", b, err)
		}
		if !ts.IsZero() && (ts.UnixMilli() > jsMaxMillis || ts.UnixMilli() < -jsMaxMillis) {
			t.Fatalf("%q: %v out of range", b, ts.Time)
		}
		var s string
		if json.Unmarshal(b, &s) != nil {
			return
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n <= 0 || n > jsMaxMillis {
			return
		}
		want := n
		if n < 1e10 {
			want = n * 1000
		}
		if ts.UnixMilli() != want {
			t.Fatalf("%q: %d ms, want %d", b, ts.UnixMilli(), want)
		}
	})
}
