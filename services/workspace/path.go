package workspace

import (
	"path"
	"path/filepath"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
)

// Limits on the paths every tool accepts.
const (
	MaxPathBytes = 1024 // whole path, in bytes
	MaxPathDepth = 32   // number of components
	MaxNameBytes = 255  // one component (NAME_MAX)
)

// ProjectForbiddenNames are the names project tools pass to ValidatePath.
var ProjectForbiddenNames = []string{".env", ".git", "node_modules", ".codesandbox"}

// ValidatePath is the path validator for every tool. p must be a
// slash-separated relative path that is already canonical: it is refused,
// never cleaned, if it is empty, absolute, longer than MaxPathBytes, deeper
// than MaxPathDepth, or contains "." or ".." components, empty components
// ("a//b", "a/"), backslashes, NUL or other control characters, invisible
// characters (bidi controls, zero-width characters, U+FEFF, line and
// paragraph separators: textsafe.Invisible), invalid UTF-8, or anything
// filepath.IsLocal rejects.
// The returned path equals p.
//
// forbiddenPrefixes are names that may not appear as ANY component of the
// path, compared case-insensitively: a component is refused when it equals
// a name or starts with the name followed by "." ("x/.env", ".ENV",
// ".env.local" and "a/.git/config" are refused for ".env" and ".git";
// ".envrc" and ".github" are not). Forbidding them anywhere, not only as the
// first component, also covers nested repositories and packages.
//
// Errors are *brokererr.Error with code PathTraversal (escape attempts,
// non-canonical or forbidden paths) or InvalidInput (empty, too long, bad
// characters).
func ValidatePath(p string, forbiddenPrefixes ...string) (string, error) {
	if p == "" {
		return "", brokererr.New(brokererr.InvalidInput, "path is empty")
	}
	if len(p) > MaxPathBytes {
		return "", brokererr.New(brokererr.InvalidInput, "path is longer than %d bytes", MaxPathBytes)
	}
	if !utf8.ValidString(p) {
		return "", brokererr.New(brokererr.InvalidInput, "path is not valid UTF-8")
	}
	for _, r := range p {
		if unicode.IsControl(r) {
			return "", brokererr.New(brokererr.InvalidInput, "path contains a control character")
		}
		if textsafe.Invisible(r) {
			return "", brokererr.New(brokererr.InvalidInput, "path contains an invisible or line-separator character (%U)", r)
		}
	}
	if strings.ContainsRune(p, '\\') {
		return "", brokererr.New(brokererr.PathTraversal, "path must not contain backslashes")
	}
	if p[0] == '/' {
		return "", brokererr.New(brokererr.PathTraversal, "path must be relative")
	}
	segs := strings.Split(p, "/")
	if len(segs) > MaxPathDepth {
		return "", brokererr.New(brokererr.InvalidInput, "path is deeper than %d components", MaxPathDepth)
	}
	for _, s := range segs {
		switch s {
		case "":
			return "", brokererr.New(brokererr.PathTraversal, "path must not contain empty components")
		case ".", "..":
			return "", brokererr.New(brokererr.PathTraversal, "path must not contain . or .. components")
		}
		if len(s) > MaxNameBytes {
			return "", brokererr.New(brokererr.InvalidInput, "path component is longer than %d bytes", MaxNameBytes)
		}
		if name, bad := forbiddenComponent(s, forbiddenPrefixes); bad {
			return "", brokererr.New(brokererr.PathTraversal, "paths containing %s are not allowed", name)
		}
	}
	if !filepath.IsLocal(p) {
		return "", brokererr.New(brokererr.PathTraversal, "path is not local")
	}
	if path.Clean(p) != p { // unreachable given the checks above; belt and braces
		return "", brokererr.New(brokererr.PathTraversal, "path is not canonical")
	}
	return p, nil
}

// forbiddenComponent reports whether component s matches one of names.
func forbiddenComponent(s string, names []string) (string, bool) {
	if len(names) == 0 {
		return "", false
	}
	ls := strings.ToLower(s)
	for _, n := range names {
		ln := strings.ToLower(n)
		if ln == "" {
			continue
		}
		if ls == ln || strings.HasPrefix(ls, ln+".") {
			return n, true
		}
	}
	return "", false
}
