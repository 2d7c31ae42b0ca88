package textsafe

import "testing"

func TestInvisible(t *testing.T) {
	for _, r := range []rune{
		0x202A, 0x202E, 0x2066, 0x2069, 0x200E, 0x200F, 0x061C, // bidi
		0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF, 0x00AD, // zero-width, BOM, soft hyphen
		0x2028, 0x2029, // line and paragraph separators
		0xE0041, 0xE007F, // tag characters
		0x115F, 0x3164, 0xFE0F, 0xE0100, // Hangul filler, variation selectors
	} {
		if !Invisible(r) {
			t.Errorf("Invisible(%U) = false", r)
		}
	}
	for _, r := range []rune{'a', ' ', '.', '-', 'é', 'ß', '中', 0x05D0, 0x0627, 0x1F600, 0x00A0, '\uFFFD'} {
		if Invisible(r) {
			t.Errorf("Invisible(%U) = true", r)
		}
	}
	if !LineSeparator(0x2028) || !LineSeparator(0x2029) || LineSeparator('\n') {
		t.Error("LineSeparator")
	}
}
