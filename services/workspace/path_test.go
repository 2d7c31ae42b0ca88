package workspace

import (
	"path"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
)

func TestValidatePath(t *testing.T) {
	const (
		ok  = brokererr.Code("")
		pt  = brokererr.PathTraversal
		inv = brokererr.InvalidInput
	)
	proj := ProjectForbiddenNames
	cases := []struct {
		in        string
		forbidden []string
		want      brokererr.Code
	}{
		{"a.txt", nil, ok},
		{"dir/sub/file.csv", nil, ok},
		{"résumé/日本語.txt", nil, ok},
		{"emoji 😀 name.png", nil, ok},
		{"with space", nil, ok},
		{"...", nil, ok},
		{"..a", nil, ok},
		{"a..", nil, ok},
		{".hidden", nil, ok},
		{"C:x", nil, ok}, // a plain Linux file name
		{"a%2Fb", nil, ok},
		{strings.Repeat("a/", MaxPathDepth-1) + "a", nil, ok},
		{strings.Repeat("x", MaxNameBytes), nil, ok},

		{"", nil, inv},
		{"/etc/passwd", nil, pt},
		{"/", nil, pt},
		{"..", nil, pt},
		{".", nil, pt},
		{"../x", nil, pt},
		{"a/../b", nil, pt},
		{"a/./b", nil, pt},
		{"./a", nil, pt},
		{"a/..", nil, pt},
		{"a//b", nil, pt},
		{"a/", nil, pt},
		{"C:\\x", nil, pt},
		{"a\\..\\b", nil, pt},
		{"a\x00b", nil, inv},
		{"a\nb", nil, inv},
		{"a\rb", nil, inv},
		{"a\x7fb", nil, inv},
		{"a\u0085b", nil, inv},             // C1 control
		{"invoice\u202Etxt.exe", nil, inv}, // right-to-left override
		{"a\u2028b.txt", nil, inv},         // line separator
		{"a\u2029b", nil, inv},             // paragraph separator
		{"\uFEFFreport.csv", nil, inv},     // BOM / zero-width no-break space
		{"re\u200Bport.csv", nil, inv},     // zero-width space
		{"a\u200Db", nil, inv},             // zero-width joiner
		{"a\u00ADb", nil, inv},             // soft hyphen
		{"a\U000E0041b", nil, inv},         // tag character
		{"\u3164.txt", nil, inv},           // Hangul filler
		{"a\uFE0Fb", nil, inv},             // variation selector
		{"a\u200Eb", nil, inv},             // left-to-right mark
		{"bad\xffutf8", nil, inv},
		{strings.Repeat("a/", MaxPathDepth) + "a", nil, inv},
		{strings.Repeat("x", MaxNameBytes+1), nil, inv},
		{strings.Repeat("abcdefgh/", 120), nil, inv}, // > MaxPathBytes

		// Forbidden names: any component, case-insensitive, name or name.*.
		{".git/config", proj, pt},
		{".GIT/x", proj, pt},
		{"sub/.git/HEAD", proj, pt},
		{"sub/.git", proj, pt},
		{"node_modules/x", proj, pt},
		{"a/Node_Modules/b", proj, pt},
		{".env", proj, pt},
		{"x/.env", proj, pt},
		{".env.local", proj, pt},
		{".Env.Production", proj, pt},
		{".codesandbox/tasks.json", proj, pt},
		{".envrc", proj, ok},
		{".github/workflows/ci.yml", proj, ok},
		{".gitignore", proj, ok},
		{"env", proj, ok},
		{"my.env", proj, ok},
		{"node_modules_backup/x", proj, ok},
		{".git/config", nil, ok}, // only forbidden when asked
	}
	for _, c := range cases {
		got, err := ValidatePath(c.in, c.forbidden...)
		if code := brokererr.CodeOf(err); code != c.want {
			t.Errorf("ValidatePath(%q, %v) = %q, %v; want code %q", c.in, c.forbidden, got, err, c.want)
			continue
		}
		if err == nil && got != c.in {
			t.Errorf("ValidatePath(%q) = %q; want it unchanged", c.in, got)
		}
		if err != nil && brokererr.As(err) == nil {
			t.Errorf("ValidatePath(%q) error %T is not *brokererr.Error", c.in, err)
		}
	}
}

func FuzzValidatePath(f *testing.F) {
	for _, s := range []string{"a", "a/b", "../x", "a/./b", "/etc/passwd", "a//b", "C:\\x", "a\x00b",
		".git/config", "résumé.txt", "\xff", "a/..", "...", "a\u2028b", "\uFEFFx", "a\u200Bb"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		got, err := ValidatePath(p, ProjectForbiddenNames...)
		if err != nil {
			if brokererr.As(err) == nil {
				t.Fatalf("error %T is not *brokererr.Error", err)
			}
			return
		}
		if got != p {
			t.Fatalf("accepted %q but returned %q", p, got)
		}
		if !filepath.IsLocal(got) || path.Clean(got) != got || path.IsAbs(got) {
			t.Fatalf("accepted non-local or non-canonical %q", got)
		}
		for _, s := range strings.Split(got, "/") {
			if s == ".." || s == "." || s == "" {
				t.Fatalf("accepted %q with component %q", got, s)
			}
			if _, bad := forbiddenComponent(s, ProjectForbiddenNames); bad {
				t.Fatalf("accepted forbidden component in %q", got)
			}
		}
		if strings.ContainsAny(got, "\\\x00") || strings.ContainsFunc(got, textsafe.Invisible) {
			t.Fatalf("accepted %q", got)
		}
		if again, err := ValidatePath(got, ProjectForbiddenNames...); err != nil || again != got {
			t.Fatalf("not idempotent: %q -> %q, %v", got, again, err)
		}
	})
}
