package codesandbox

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode"
)

// Timestamp is a VM time from GET /vm/running. The SDK types
// last_active_at and session_started_at as strings (types.gen.d.ts:198-199)
// holding Unix seconds or milliseconds, and reads them with parseTimestamp
// (dist/esm/index.js:11900-11908): parseInt of the string (or the number
// as is), values below 1e10 taken as seconds, others as milliseconds, and
// an empty or unparsable value as no time. Timestamp does the same, so
// decoding never fails on it; IsZero reports "no time". Zero is no time
// too: the SDK means that by its `timestamp === 0` test, though a string
// "0" slips past it and becomes 1970.
type Timestamp struct{ time.Time }

// jsMaxMillis is the largest |time| a JavaScript Date holds (±8.64e15 ms);
// beyond it the SDK's Date is invalid and its parseTimestamp gives no time.
const jsMaxMillis = 8.64e15

// UnmarshalJSON takes a JSON string or number; anything else is no time.
func (t *Timestamp) UnmarshalJSON(b []byte) error {
	t.Time = parseTimestamp(b)
	return nil
}

// parseTimestamp reads one JSON value as the SDK's parseTimestamp would.
func parseTimestamp(b []byte) time.Time {
	b = bytes.TrimSpace(b)
	var n float64
	switch {
	case len(b) > 0 && b[0] == '"':
		var s string
		if json.Unmarshal(b, &s) != nil {
			return time.Time{}
		}
		v, ok := parseIntPrefix(s)
		if !ok {
			return time.Time{}
		}
		n = v
	case len(b) > 0 && (b[0] == '-' || b[0] >= '0' && b[0] <= '9'):
		v, err := strconv.ParseFloat(string(b), 64)
		if err != nil {
			return time.Time{}
		}
		n = v
	default: // null, bools, objects, arrays
		return time.Time{}
	}
	if n == 0 {
		return time.Time{}
	}
	ms := n
	if n < 1e10 {
		ms = n * 1000
	}
	if math.IsNaN(ms) || math.Abs(ms) > jsMaxMillis {
		return time.Time{}
	}
	return time.UnixMilli(int64(ms)).UTC()
}

// parseIntPrefix is JavaScript's parseInt(s, 10): leading white space, an
// optional sign, then the longest run of decimal digits; none is NaN (ok
// false).
func parseIntPrefix(s string) (float64, bool) {
	s = strings.TrimLeftFunc(s, unicode.IsSpace)
	neg := false
	if s != "" && (s[0] == '+' || s[0] == '-') {
		neg = s[0] == '-'
		s = s[1:]
	}
	end := 0
	for end < len(s) && s[end] >= '0' && s[end] <= '9' {
		end++
	}
	if end == 0 {
		return 0, false
	}
	v, err := strconv.ParseFloat(s[:end], 64)
	if err != nil { // out of float64's range: no JS Date either
		return 0, false
	}
	if neg {
		v = -v
	}
	return v, true
}
