package tools

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
)

// cleanOutput makes program output safe to show a model: invalid UTF-8 is
// replaced, ANSI CSI/OSC and other escape sequences and control characters
// (bar \n and \t) are removed, and the text is capped at max bytes with a
// marker saying how much was dropped.
func cleanOutput(b []byte, max int) (string, bool) {
	s := stripEscapes(strings.ToValidUTF8(string(b), "\uFFFD"))
	if len(s) <= max {
		return s, false
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + fmt.Sprintf("\n[output truncated: %d more bytes]", len(s)-cut), true
}

// stripEscapes removes terminal escape sequences, control characters and
// invisible characters (textsafe.Invisible; U+2028 and U+2029 become a
// newline), so output cannot hide text from a human reviewer or restyle a
// terminal.
func stripEscapes(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == 0x1b: // ESC
			i = skipEscape(s, i)
			continue
		case c == '\n' || c == '\t':
			b.WriteByte(c)
		case c == '\r':
			// A bare CR would let output overwrite what a reviewer sees.
			if i+1 < len(s) && s[i+1] == '\n' {
				break
			}
			b.WriteByte('\n')
		case c < 0x20 || c == 0x7f:
			// other C0 controls: dropped
		case c < utf8.RuneSelf:
			b.WriteByte(c)
		default:
			r, size := utf8.DecodeRuneInString(s[i:])
			if r == 0x9b { // C1 CSI
				i = skipCSI(s, i+size)
				continue
			}
			if textsafe.LineSeparator(r) {
				b.WriteByte('\n')
				i += size
				continue
			}
			if r >= 0x80 && r <= 0x9f || textsafe.Invisible(r) {
				// C1 controls, bidi controls, zero-width and other
				// invisible characters are dropped.
				i += size
				continue
			}
			b.WriteString(s[i : i+size])
			i += size
			continue
		}
		i++
	}
	return b.String()
}

// skipEscape returns the index after the escape sequence starting at i.
func skipEscape(s string, i int) int {
	i++ // ESC
	if i >= len(s) {
		return i
	}
	switch s[i] {
	case '[':
		return skipCSI(s, i+1)
	case ']', 'P', '_', '^', 'X': // OSC, DCS, APC, PM, SOS: up to BEL or ST
		for j := i + 1; j < len(s); j++ {
			if s[j] == 0x07 {
				return j + 1
			}
			if s[j] == 0x1b && j+1 < len(s) && s[j+1] == '\\' {
				return j + 2
			}
		}
		return len(s)
	default: // two-byte sequences such as ESC c, ESC ( B
		if s[i] >= utf8.RuneSelf {
			return i // not part of the escape: never split a character
		}
		if (s[i] == '(' || s[i] == ')' || s[i] == '#') && i+1 < len(s) && s[i+1] < utf8.RuneSelf {
			return i + 2
		}
		return i + 1
	}
}

func skipCSI(s string, i int) int {
	for ; i < len(s); i++ {
		if s[i] >= 0x40 && s[i] <= 0x7e {
			return i + 1
		}
	}
	return len(s)
}
