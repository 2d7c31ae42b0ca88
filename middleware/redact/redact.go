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
	regexp.MustCompile(`\bgh[pousr]_[A-Za-z0-9]{20,}`),
	regexp.MustCompile(`\bcsb_[A-Za-z0-9_-]{12,}`),
	regexp.MustCompile(`\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b`),
	regexp.MustCompile(`(?i)(aws_secret_access_key["']?\s*[:=]\s*["']?)[A-Za-z0-9/+=]{40}`),
	regexp.MustCompile(`(?i)\bbearer\s+[A-Za-z0-9._~+/-]{16,}=*`),
	regexp.MustCompile(`-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)`),
}

// tokenHints is a cheap prefilter: a string with none of these cannot match
// any token shape, so the regexps are skipped on most output.
var tokenHints = []string{"github_pat_", "gh", "csb_", "AKIA", "ASIA", "ABIA", "ACCA", "ecret", "ECRET", "earer", "EARER", "PRIVATE KEY"}

// hostPathShape finds absolute host paths in error text. Sandbox-side paths
// (/mnt/data, /data, /tmp inside a sandbox) are left alone on purpose.
var hostPathShape = regexp.MustCompile(`(?:/(?:home|root|var|srv|opt|work|usr|etc|run|proc|sys|dev|snap|nix|Users|private))(?:/[^\s"'():;,]*)?`)

// Redactor is immutable and safe for concurrent use.
type Redactor struct {
	secrets   *strings.Replacer
	hasSecret bool
	paths     *strings.Replacer
	hasPaths  bool
}

// New builds a redactor for the given secret values and host path roots.
// Empty and too-short secrets are ignored.
func New(secrets []string, hostRoots []string) *Redactor {
	r := &Redactor{}
	if pairs := replacePairs(secrets, minSecretLen, Marker); len(pairs) > 0 {
		r.secrets, r.hasSecret = strings.NewReplacer(pairs...), true
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

// replacePairs orders values longest first so that a secret containing
// another is replaced whole.
func replacePairs(values []string, minLen int, marker string) []string {
	seen := map[string]bool{}
	var vs []string
	for _, v := range values {
		if len(v) >= minLen && !seen[v] {
			seen[v] = true
			vs = append(vs, v)
		}
	}
	sort.Slice(vs, func(i, j int) bool { return len(vs[i]) > len(vs[j]) })
	pairs := make([]string, 0, 2*len(vs))
	for _, v := range vs {
		pairs = append(pairs, v, marker)
	}
	return pairs
}

// String redacts configured secrets and token shapes.
func (r *Redactor) String(s string) string {
	if r == nil || s == "" {
		return s
	}
	if r.hasSecret {
		s = r.secrets.Replace(s)
	}
	if !containsAny(s, tokenHints) {
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

// Message redacts an error message for the client: secrets, tokens and host
// paths, then caps it at max bytes on a rune boundary.
func (r *Redactor) Message(s string, max int) string {
	s = r.String(s)
	if r != nil && r.hasPaths {
		s = r.paths.Replace(s)
	}
	s = hostPathShape.ReplaceAllString(s, PathMarker)
	return Truncate(s, max)
}

// Truncate caps s at max bytes without splitting a rune, adding "…".
func Truncate(s string, max int) string {
	if max <= 0 || len(s) <= max {
		return s
	}
	cut := max - len("…")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
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

func containsAny(s string, subs []string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}
