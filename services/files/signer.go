// Package files issues HMAC-signed download URLs for workspace files and
// serves them.
//
// URL form:
//
//	GET {BaseURL}/files/{workspace_id}/{path...}?exp=<unix>&kid=<kid>&sig=<base64url>
//
// string-to-sign = "v1\n" + kid + "\nGET\n" + workspace_id + "\n" +
// escaped_path + "\n" + exp, where escaped_path is the workspace-relative
// path with each segment escaped by url.PathEscape, exactly as it appears
// in the URL, and sig is the unpadded base64url HMAC-SHA256 of it under the
// kid's key (see Keyring). HEAD is verified as GET.
//
// Verification refuses rather than cleans (security-cases §5): the raw
// escaped path must decode exactly once to a path workspace.ValidatePath
// accepts and re-escape to the very same bytes, and the query must hold
// exactly exp, kid and sig, once each. Only then is the filesystem touched,
// through workspace.Open / OpenFile (os.Root, O_NOFOLLOW|O_NONBLOCK,
// regular files only).
package files

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Defaults for Signer.
const (
	DefaultTTL    = time.Hour
	DefaultMaxTTL = 24 * time.Hour
	// ClockSkew is tolerated above now+MaxTTL, for URLs signed by another
	// broker instance whose clock runs ahead.
	ClockSkew = 30 * time.Second
)

// PathPrefix is the URL path prefix the Handler serves.
const PathPrefix = "/files/"

// sigLen is the length of an unpadded base64url HMAC-SHA256.
var sigLen = base64.RawURLEncoding.EncodedLen(sha256.Size)

// Signer issues and verifies signed URLs.
type Signer struct {
	Keys    *Keyring
	BaseURL string           // e.g. "https://files.example.com"; no query, no trailing slash needed
	TTL     time.Duration    // lifetime of new URLs; 0 means DefaultTTL
	MaxTTL  time.Duration    // longest lifetime accepted; 0 means DefaultMaxTTL
	Now     func() time.Time // nil means time.Now
}

func (s *Signer) now() time.Time {
	if s.Now != nil {
		return s.Now()
	}
	return time.Now()
}

func (s *Signer) ttl() time.Duration {
	if s.TTL > 0 {
		return s.TTL
	}
	return DefaultTTL
}

func (s *Signer) maxTTL() time.Duration {
	if s.MaxTTL > 0 {
		return s.MaxTTL
	}
	return DefaultMaxTTL
}

// URL returns a signed download URL for path in workspace workspaceID and
// its expiry. path must pass workspace.ValidatePath and must not contain
// '%' (such names could not be told apart from escapes, so the verifier
// refuses them); errors for bad input are *brokererr.Error.
func (s *Signer) URL(workspaceID, path string) (string, time.Time, error) {
	if s == nil || s.Keys == nil {
		return "", time.Time{}, errors.New("files: signer has no keys")
	}
	if !ValidWorkspaceID(workspaceID) {
		return "", time.Time{}, brokererr.New(brokererr.InvalidInput, "invalid workspace id")
	}
	rel, err := workspace.ValidatePath(path)
	if err != nil {
		return "", time.Time{}, err
	}
	esc, err := escapePath(rel)
	if err != nil {
		return "", time.Time{}, err
	}
	if s.ttl() > s.maxTTL() {
		return "", time.Time{}, fmt.Errorf("files: TTL %v exceeds MaxTTL %v", s.ttl(), s.maxTTL())
	}
	base, err := s.base()
	if err != nil {
		return "", time.Time{}, err
	}
	exp := s.now().Add(s.ttl()).Unix()
	expStr := strconv.FormatInt(exp, 10)
	kid := s.Keys.ActiveKID()
	key, _ := s.Keys.key(kid)
	sig := base64.RawURLEncoding.EncodeToString(mac(key, kid, workspaceID, esc, expStr))
	u := base + PathPrefix + workspaceID + "/" + esc + "?exp=" + expStr + "&kid=" + kid + "&sig=" + sig
	return u, time.Unix(exp, 0), nil
}

// base checks BaseURL and returns it without a trailing slash. With no
// BaseURL (stdio without PUBLIC_BASE_URL) there is nowhere to link to: the
// error says so, and callers that can do without a link leave it out.
func (s *Signer) base() (string, error) {
	if s.BaseURL == "" {
		return "", brokererr.New(brokererr.NotConfigured, "this broker has no public URL for links; set PUBLIC_BASE_URL or serve over HTTP")
	}
	b := strings.TrimRight(s.BaseURL, "/")
	u, err := url.Parse(b)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" ||
		u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return "", fmt.Errorf("files: BaseURL %q must be an absolute http(s) URL without query or credentials", s.BaseURL)
	}
	return b, nil
}

// mac computes the signature over the canonical string-to-sign.
func mac(key []byte, kid, workspaceID, escapedPath, exp string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("v1\n" + kid + "\nGET\n" + workspaceID + "\n" + escapedPath + "\n" + exp))
	return m.Sum(nil)
}

// NewWorkspaceID returns a workspace (or project) ID: 128 random bits as
// 32 lowercase hex digits, unrelated to any name a caller chose.
func NewWorkspaceID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b[:])
}

// ValidWorkspaceID reports whether id is 32 lowercase hex digits.
func ValidWorkspaceID(id string) bool {
	if len(id) != 32 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// escapePath is EscapePath for signed URLs, which refuse names with '%'.
func escapePath(rel string) (string, error) {
	if strings.ContainsRune(rel, '%') {
		return "", brokererr.New(brokererr.InvalidInput, "file names containing %% cannot be downloaded by URL")
	}
	return EscapePath(rel), nil
}

// EscapePath escapes each segment of a validated workspace path with
// url.PathEscape: the path form of signed URLs and of sandbox:// resource
// URIs.
func EscapePath(rel string) string {
	segs := strings.Split(rel, "/")
	for i, s := range segs {
		segs[i] = url.PathEscape(s)
	}
	return strings.Join(segs, "/")
}

// UnescapePath is EscapePath's strict inverse: esc is decoded exactly once
// and accepted only if the result passes workspace.ValidatePath and
// escapes back to the very same bytes, so "%2e%2e", "%2F", "//", lower-case
// or needless escapes are refused, never cleaned. Errors are
// *brokererr.Error.
func UnescapePath(esc string) (string, error) {
	rel, err := url.PathUnescape(esc)
	if err != nil {
		return "", brokererr.New(brokererr.InvalidInput, "path has an invalid percent escape")
	}
	if _, err := workspace.ValidatePath(rel); err != nil {
		return "", err
	}
	if EscapePath(rel) != esc {
		return "", brokererr.New(brokererr.PathTraversal, "path is not in canonical escaped form")
	}
	return rel, nil
}

// ErrDenied is wrapped by every Verify error; the text after it is a fixed
// reason for logs, never sent to the client.
var ErrDenied = errors.New("signed URL denied")

func deny(reason string) error { return fmt.Errorf("%w: %s", ErrDenied, reason) }

// Target is what a verified URL grants.
type Target struct {
	WorkspaceID string
	Path        string // decoded, validated workspace-relative path
	KID         string
	Expires     time.Time
}

// Verify checks a request's raw escaped path (r.URL.EscapedPath(), starting
// with PathPrefix) and raw query (r.URL.RawQuery), in this order: prefix,
// workspace id, path canonical form, strict query, expiry window, kid,
// HMAC (constant time). The method is the caller's to check (GET or HEAD).
// Any error wraps ErrDenied.
func (s *Signer) Verify(escapedPath, rawQuery string) (Target, error) {
	if s == nil || s.Keys == nil {
		return Target{}, deny("no keys")
	}
	rest, ok := strings.CutPrefix(escapedPath, PathPrefix)
	if !ok {
		return Target{}, deny("prefix")
	}
	id, escRel, ok := strings.Cut(rest, "/")
	if !ok || !ValidWorkspaceID(id) {
		return Target{}, deny("workspace id")
	}
	rel, err := UnescapePath(escRel)
	if err != nil || strings.ContainsRune(rel, '%') {
		return Target{}, deny("path")
	}
	expStr, kid, sig, err := parseQuery(rawQuery)
	if err != nil {
		return Target{}, err
	}
	exp, err := parseExp(expStr)
	if err != nil {
		return Target{}, err
	}
	now := s.now().Unix()
	if exp < now {
		return Target{}, deny("expired")
	}
	if exp > now+int64((s.maxTTL()+ClockSkew)/time.Second) {
		return Target{}, deny("expiry too far")
	}
	key, ok := s.Keys.key(kid)
	if !ok {
		return Target{}, deny("unknown kid")
	}
	if len(sig) != sigLen {
		return Target{}, deny("signature length")
	}
	got, err := base64.RawURLEncoding.Strict().DecodeString(sig)
	if err != nil || len(got) != sha256.Size {
		return Target{}, deny("signature encoding")
	}
	if !hmac.Equal(got, mac(key, kid, id, escRel, expStr)) {
		return Target{}, deny("signature mismatch")
	}
	return Target{WorkspaceID: id, Path: rel, KID: kid, Expires: time.Unix(exp, 0)}, nil
}

// parseQuery accepts exactly "exp", "kid" and "sig", once each, in any
// order, with raw values (no percent escapes or '+'; the allowed
// characters never need escaping).
func parseQuery(q string) (exp, kid, sig string, err error) {
	if q == "" {
		return "", "", "", deny("no query")
	}
	parts := strings.Split(q, "&")
	if len(parts) != 3 {
		return "", "", "", deny("query parameter count")
	}
	seen := map[string]bool{}
	for _, p := range parts {
		k, v, ok := strings.Cut(p, "=")
		if !ok || v == "" || seen[k] {
			return "", "", "", deny("query syntax")
		}
		seen[k] = true
		switch k {
		case "exp":
			exp = v
		case "kid":
			if !validKID(v) {
				return "", "", "", deny("kid syntax")
			}
			kid = v
		case "sig":
			sig = v
		default:
			return "", "", "", deny("unknown query parameter")
		}
	}
	return exp, kid, sig, nil
}

// parseExp accepts a canonical non-negative decimal integer.
func parseExp(s string) (int64, error) {
	if len(s) == 0 || len(s) > 18 || (s[0] == '0' && len(s) > 1) {
		return 0, deny("exp syntax")
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, deny("exp syntax")
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, deny("exp syntax")
	}
	return n, nil
}

// PreviewPrefix is the URL path prefix of project previews.
const PreviewPrefix = "/preview/"

// previewPath stands in for the file path in a preview link's MAC; file
// paths can never contain NUL, so the two kinds of link cannot collide.
const previewPath = "\x00preview"

// PreviewURL signs a link to project sandbox id's preview:
// {BaseURL}/preview/{id}/?exp=…&kid=…&sig=….
func (s *Signer) PreviewURL(id string) (string, time.Time, error) {
	if s == nil || s.Keys == nil {
		return "", time.Time{}, errors.New("files: signer has no keys")
	}
	if !ValidWorkspaceID(id) {
		return "", time.Time{}, brokererr.New(brokererr.InvalidInput, "invalid sandbox id")
	}
	base, err := s.base()
	if err != nil {
		return "", time.Time{}, err
	}
	exp := s.now().Add(s.ttl()).Unix()
	expStr := strconv.FormatInt(exp, 10)
	kid := s.Keys.ActiveKID()
	key, _ := s.Keys.key(kid)
	sig := base64.RawURLEncoding.EncodeToString(mac(key, kid, id, previewPath, expStr))
	return base + PreviewPrefix + id + "/?exp=" + expStr + "&kid=" + kid + "&sig=" + sig, time.Unix(exp, 0), nil
}

// VerifyPreview checks a preview link's raw query (or the same string kept
// in the preview cookie) for sandbox id, with the checks Verify applies.
func (s *Signer) VerifyPreview(id, rawQuery string) (time.Time, error) {
	if s == nil || s.Keys == nil {
		return time.Time{}, deny("no keys")
	}
	if !ValidWorkspaceID(id) {
		return time.Time{}, deny("sandbox id")
	}
	expStr, kid, sig, err := parseQuery(rawQuery)
	if err != nil {
		return time.Time{}, err
	}
	exp, err := parseExp(expStr)
	if err != nil {
		return time.Time{}, err
	}
	now := s.now().Unix()
	if exp < now {
		return time.Time{}, deny("expired")
	}
	if exp > now+int64((s.maxTTL()+ClockSkew)/time.Second) {
		return time.Time{}, deny("expiry too far")
	}
	key, ok := s.Keys.key(kid)
	if !ok {
		return time.Time{}, deny("unknown kid")
	}
	got, err := base64.RawURLEncoding.Strict().DecodeString(sig)
	if len(sig) != sigLen || err != nil || len(got) != sha256.Size {
		return time.Time{}, deny("signature encoding")
	}
	if !hmac.Equal(got, mac(key, kid, id, previewPath, expStr)) {
		return time.Time{}, deny("signature mismatch")
	}
	return time.Unix(exp, 0), nil
}
