package process

import (
	"fmt"
	"strings"
	"testing"
)

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
