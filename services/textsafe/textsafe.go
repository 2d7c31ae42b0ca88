// Package textsafe names the characters that can hide or disguise text a
// person or a model reads: file names, branch names, program output.
package textsafe

import "unicode"

// Invisible reports characters that render as nothing, or that change how
// the text around them reads, without being seen themselves:
//
//   - format characters (Cf): the bidi embeddings, overrides, isolates and
//     marks, zero-width space and joiners, U+FEFF, the soft hyphen, and
//     the tag characters used to smuggle text past a reader;
//   - other default-ignorable code points: Hangul fillers, variation
//     selectors (which can also carry hidden bytes);
//   - the line and paragraph separators U+2028 and U+2029 (Zl, Zp), which
//     break a line in some viewers and not in others.
//
// C0 and C1 controls are unicode.IsControl's business, not this one's.
func Invisible(r rune) bool {
	return unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp, unicode.Other_Default_Ignorable_Code_Point, unicode.Variation_Selector)
}

// LineSeparator reports U+2028 and U+2029: output filters turn them into
// a plain newline rather than dropping the line break.
func LineSeparator(r rune) bool {
	return unicode.In(r, unicode.Zl, unicode.Zp)
}
