// Package redact removes secrets, token-shaped strings and host paths from
// anything that leaves the server: tool results, error messages, log lines
// and audit parameters.
package redact

import (
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"unicode/utf8"
)

// Marker replaces every secret and token.
const Marker = "[REDACTED]"

// PathMarker replaces host paths in error messages.
const PathMarker = "[PATH]"

// minSecretLen keeps short values (a misconfigured "x") from shredding output;
// config refuses secrets that short anyway.
const minSecretLen = 8

// tokenShapes match credentials the server never holds itself but must not
// echo either: a model may paste one, or sandbox code may print one.
var tokenShapes = []*regexp.Regexp{
	regexp.MustCompile(`github_pat_[A-Za-z0-9_]{20,}`),
	// No leading \b: results are often JSON text, where "\n" puts a word
	// character right before a token. Over-redaction is the safe failure.
	regexp.MustCompile(`gh[pousr]_[A-Za-z0-9]{20,}`),
	regexp.MustCompile(`csb_[A-Za-z0-9_-]{12,}`),
	regexp.MustCompile(`(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}`),
	regexp.MustCompile(`(?i)(aws_secret_access_key["']?\s*[:=]\s*["']?)[A-Za-z0-9/+=]{40}`),
	regexp.MustCompile(`(?i)bearer\s+[A-Za-z0-9._~+/-]{16,}=*`),
	regexp.MustCompile(`-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)`),
}

// tokenHints is a cheap prefilter: a string with none of these cannot match
// any token shape, so the regexps are skipped on most output. foldHints are
// the hints of the case-insensitive shapes, matched ignoring ASCII case.
var (
	tokenHints = []string{"github_pat_", "gh", "csb_", "AKIA", "ASIA", "ABIA", "ACCA", "PRIVATE KEY"}
	foldHints  = []string{"ecret", "earer"}
)

// maxPasses bounds String's fixed-point loop. Every token match is longer
// than Marker, so each pass that changes anything shrinks the string and the
// loop ends in practice after two passes.
const maxPasses = 8

// hostPathShape finds absolute host paths in error text. Sandbox-side paths
// (/mnt/data, /data, /tmp inside a sandbox) are left alone on purpose.
var hostPathShape = regexp.MustCompile(`(?:/(?:home|root|var|srv|opt|work|usr|etc|run|proc|sys|dev|snap|nix|Users|private))(?:/[^\s"'():;,]*)?`)

// Redactor is immutable and safe for concurrent use.
type Redactor struct {
	secrets   []string // longest first
	hasSecret bool
	paths     *strings.Replacer
	hasPaths  bool
}

// New builds a redactor for the given secret values and host path roots.
// Empty and too-short secrets are ignored.
func New(secrets []string, hostRoots []string) *Redactor {
	r := &Redactor{}
	if vs := longestFirst(secrets, minSecretLen); len(vs) > 0 {
		r.secrets, r.hasSecret = vs, true
	}
	var roots []string
	for _, p := range hostRoots {
		if p == "" || p == "/" {
			continue
		}
		roots = append(roots, filepath.Clean(p))
		if abs, err := filepath.Abs(p); err == nil {
			roots = append(roots, abs)
		}
		if real, err := filepath.EvalSymlinks(p); err == nil {
			roots = append(roots, real)
		}
	}
	if pairs := replacePairs(roots, 2, PathMarker); len(pairs) > 0 {
		r.paths, r.hasPaths = strings.NewReplacer(pairs...), true
	}
	return r
}

// replacePairs orders values longest first so that a value containing
// another is replaced whole.
func replacePairs(values []string, minLen int, marker string) []string {
	vs := longestFirst(values, minLen)
	pairs := make([]string, 0, 2*len(vs))
	for _, v := range vs {
		pairs = append(pairs, v, marker)
	}
	return pairs
}

// longestFirst returns the distinct values of at least minLen bytes, longest
// first.
func longestFirst(values []string, minLen int) []string {
	seen := map[string]bool{}
	var vs []string
	for _, v := range values {
		if len(v) >= minLen && !seen[v] {
			seen[v] = true
			vs = append(vs, v)
		}
	}
	sort.SliceStable(vs, func(i, j int) bool { return len(vs[i]) > len(vs[j]) })
	return vs
}

// String redacts configured secrets and token shapes. It repeats until
// nothing changes, because removing one match can expose another (a token
// glued to the end of an AWS secret gains a word boundary once the secret
// becomes Marker), so the result never contains a secret or token shape and
// String(String(s)) == String(s).
func (r *Redactor) String(s string) string {
	if r == nil || s == "" {
		return s
	}
	for range maxPasses {
		out := r.once(s)
		if out == s {
			return out
		}
		s = out
	}
	return s
}

func (r *Redactor) once(s string) string {
	if r.hasSecret {
		s = r.replaceSecrets(s)
	}
	if r.hasPaths {
		// Known host roots never leave the server, e.g. via a sandbox
		// printing /proc/self/mountinfo.
		s = r.paths.Replace(s)
	}
	if !containsAny(s, tokenHints) && !containsAnyFold(s, foldHints) {
		return s
	}
	for _, re := range tokenShapes {
		s = re.ReplaceAllStringFunc(s, func(m string) string {
			// Keep a matched key name (aws_secret_access_key=) for context.
			if sub := re.FindStringSubmatch(m); len(sub) > 1 {
				return sub[1] + Marker
			}
			return Marker
		})
	}
	return s
}

// replaceSecrets replaces every byte covered by an occurrence of any secret
// with Marker, one Marker per run of covered bytes. Working on the union of
// occurrences (rather than strings.Replacer's leftmost non-overlapping
// matches) means overlapping secrets, or a secret overlapping itself, leave
// no fragment behind.
func (r *Redactor) replaceSecrets(s string) string {
	var spans [][2]int
	for _, sec := range r.secrets {
		for off := 0; off < len(s); {
			i := strings.Index(s[off:], sec)
			if i < 0 {
				break
			}
			start, end := off+i, off+i+len(sec)
			if n := len(spans); n > 0 && spans[n-1][1] >= start && spans[n-1][0] <= start {
				spans[n-1][1] = max(spans[n-1][1], end)
			} else {
				spans = append(spans, [2]int{start, end})
			}
			off = start + 1
		}
	}
	if len(spans) == 0 {
		return s
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i][0] < spans[j][0] })
	var b strings.Builder
	b.Grow(len(s))
	pos := 0
	for i := 0; i < len(spans); {
		start, end := spans[i][0], spans[i][1]
		for i++; i < len(spans) && spans[i][0] <= end; i++ {
			end = max(end, spans[i][1])
		}
		b.WriteString(s[pos:start])
		b.WriteString(Marker)
		pos = end
	}
	b.WriteString(s[pos:])
	return b.String()
}

// Message redacts an error message for the client: secrets, tokens and host
// paths, then caps it at max bytes on a rune boundary. String runs again at
// the end because replacing a path or cutting the text can give a token the
// word boundary it lacked.
func (r *Redactor) Message(s string, max int) string {
	s = r.String(s)
	if r != nil && r.hasPaths {
		s = r.paths.Replace(s)
	}
	s = hostPathShape.ReplaceAllString(s, PathMarker)
	return r.String(Truncate(s, max))
}

// Truncate caps s at max bytes without splitting a rune, adding "…" when
// there is room for it. max <= 0 means no cap.
func Truncate(s string, max int) string {
	if max <= 0 || len(s) <= max {
		return s
	}
	ellipsis := "…"
	if max < len(ellipsis) {
		ellipsis = ""
	}
	cut := max - len(ellipsis)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + ellipsis
}

// Value redacts every string inside a JSON-shaped value (maps, slices,
// strings), returning a new value. Map keys are redacted too.
func (r *Redactor) Value(v any) any {
	switch t := v.(type) {
	case string:
		return r.String(t)
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, x := range t {
			out[r.String(k)] = r.Value(x)
		}
		return out
	case []any:
		out := make([]any, len(t))
		for i, x := range t {
			out[i] = r.Value(x)
		}
		return out
	default:
		return v
	}
}

// containsAnyFold is containsAny ignoring ASCII case; subs are lowercase.
func containsAnyFold(s string, subs []string) bool {
	for _, sub := range subs {
		for i := 0; i+len(sub) <= len(s); i++ {
			if s[i]|0x20 == sub[0] && strings.EqualFold(s[i:i+len(sub)], sub) {
				return true
			}
		}
	}
	return false
}

func containsAny(s string, subs []string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}
