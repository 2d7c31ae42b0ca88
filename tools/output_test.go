package tools

import (
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
)

func TestCleanOutput(t *testing.T) {
	for in, want := range map[string]string{
		"\x1b[31mred\x1b[0m ok":             "red ok",
		"a\rb\r\nc":                         "a\nb\nc",
		"evil\u202Etxt.exe":                 "eviltxt.exe",
		"line\u2028next\u2029para":          "line\nnext\npara",
		"\uFEFFhid\u200Bden\u200Dx":         "hiddenx",
		"tag\U000E0069\U000E0067s":          "tags",
		"caf\u00e9 \u65e5\u672c \U0001F600": "caf\u00e9 \u65e5\u672c \U0001F600",
		"bad\xffutf8":                       "bad\uFFFDutf8",
		"00\x1b\xfa":                        "00\uFFFD", // ESC before a multi-byte character
	} {
		if got, _ := cleanOutput([]byte(in), 1<<10); got != want {
			t.Errorf("cleanOutput(%q) = %q, want %q", in, got, want)
		}
	}
	got, cut := cleanOutput([]byte(strings.Repeat("é", 100)), 51)
	if !cut || !strings.HasPrefix(got, strings.Repeat("é", 25)+"\n[output truncated: 150 more bytes]") {
		t.Errorf("cap: %q %v", got, cut)
	}
}

// FuzzCleanOutput: whatever a program prints, what reaches the model is
// valid UTF-8 without escapes, controls (bar \n and \t) or invisible
// characters, and within the cap plus its marker.
func FuzzCleanOutput(f *testing.F) {
	for _, s := range []string{"plain", "\x1b[2J\x1b]8;;http://x\x07link", "\u202Eabc", "a\u2028b", "\uFEFF\u200B", "\xc2\x9b31m", "\xff\xfe"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		const max = 64
		got, cut := cleanOutput(in, max)
		if !utf8.ValidString(got) {
			t.Fatalf("invalid UTF-8: %q", got)
		}
		body := got
		if cut {
			i := strings.LastIndex(got, "\n[output truncated: ")
			if i < 0 || i > max {
				t.Fatalf("truncated without a marker within the cap: %q", got)
			}
			body = got[:i]
		} else if len(got) > max {
			t.Fatalf("%d bytes over the %d cap without truncation", len(got), max)
		}
		for _, r := range body {
			if r == '\n' || r == '\t' {
				continue
			}
			if unicode.IsControl(r) || textsafe.Invisible(r) {
				t.Fatalf("%U survived in %q", r, got)
			}
		}
	})
}
