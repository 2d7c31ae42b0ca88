package process

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"testing"
)

func FuzzParseStat(f *testing.F) {
	f.Add([]byte("123 (bash) S 1 123 123 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 98765 1000 100 0"))
	f.Add([]byte("7 (a) b) c) Z 1 7 7 0 -1 4 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0"))
	f.Add([]byte("1 (x"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, ok := parseStat(b)
		if !ok {
			return
		}
		// What parsed must be the fields after the last ')'.
		f := bytes.Fields(b[bytes.LastIndexByte(b, ')')+1:])
		if len(f) < 20 || len(f[0]) != 1 || f[0][0] != st.state {
			t.Fatalf("parsed %+v from %q", st, b)
		}
		if start, err := strconv.ParseUint(string(f[19]), 10, 64); err != nil || start != st.start {
			t.Fatalf("start %d from %q", st.start, b)
		}
	})
}

func FuzzParsePidFile(f *testing.F) {
	f.Add([]byte("1234 5678\n"))
	f.Add([]byte("1 2"))
	f.Add([]byte("-5 3"))
	f.Add([]byte("99999999999999999999 1"))
	f.Fuzz(func(t *testing.T, b []byte) {
		k, ok := parsePidFile(b)
		if !ok {
			return
		}
		// Never a pid that would signal a group, init or everything.
		if k.pid <= 1 || k.pid > 1<<22 {
			t.Fatalf("accepted pid %d from %q", k.pid, b)
		}
		if got, ok := parsePidFile(fmt.Appendf(nil, "%d %d\n", k.pid, k.start)); !ok || got != k {
			t.Fatalf("round trip %v -> %v", k, got)
		}
	})
}

func FuzzParseCounter(f *testing.F) {
	f.Add("oom 0\noom_kill 3\n", "oom_kill")
	f.Add("under_oom 0\noom_kill -1", "oom_kill")
	f.Fuzz(func(t *testing.T, s, key string) {
		n, ok := parseCounter(s, key)
		if ok && n < 0 {
			t.Fatalf("negative counter %d", n)
		}
		if ok && !strings.Contains(s, key) {
			t.Fatalf("found %q in %q", key, s)
		}
	})
}
