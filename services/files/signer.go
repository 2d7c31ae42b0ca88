// Package files issues HMAC-signed URLs for workspace files and serves
// them: downloads (GET) and uploads (PUT).
//
// URL forms:
//
//	GET {BaseURL}/files/{workspace_id}/{path...}?exp=<unix>&kid=<kid>&sig=<base64url>
//	PUT {BaseURL}/files/{workspace_id}/{path...}?exp=<unix>&kid=<kid>&max=<bytes>&ow=<0|1>&sig=<base64url>
//
// string-to-sign = "v1\n" + kid + "\n" + method + "\n" + workspace_id + "\n" +
// escaped_path + "\n" + exp, followed for PUT by "\n" + max + "\n" + ow,
// where escaped_path is the workspace-relative path with each segment
// escaped by url.PathEscape, exactly as it appears in the URL, and sig is
// the unpadded base64url HMAC-SHA256 of it under the kid's key (see
// Keyring). HEAD is verified as GET. The method is signed and each method
// takes its own exact set of query parameters, so a download link never
// verifies as an upload link, nor the other way round.
//
// Verification refuses rather than cleans (security-cases §5): the raw
// escaped path must decode exactly once to a path workspace.ValidatePath
// accepts and re-escape to the very same bytes, and the query must hold
// exactly the method's parameters, once each. Only then is the filesystem
// touched, through workspace.Open / OpenFile / WriteFrom (os.Root,
// O_NOFOLLOW|O_NONBLOCK, regular files only).
package files

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
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
	// DefaultUploadTTL is the lifetime of upload links: an upload must
	// start before its link expires (once started, it runs on at the
	// handler's minimum rate).
	DefaultUploadTTL = 15 * time.Minute
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
	Keys      *Keyring
	BaseURL   string           // e.g. "https://files.example.com"; no query, no trailing slash needed
	TTL       time.Duration    // lifetime of new download URLs; 0 means DefaultTTL
	MaxTTL    time.Duration    // longest lifetime accepted; 0 means DefaultMaxTTL
	UploadTTL time.Duration    // lifetime of upload URLs; 0 means DefaultUploadTTL; at most MaxTTL
	Now       func() time.Time // nil means time.Now
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

func (s *Signer) uploadTTL() time.Duration {
	t := s.UploadTTL
	if t <= 0 {
		t = DefaultUploadTTL
	}
	return min(t, s.maxTTL())
}

// URL returns a signed download URL for path in workspace workspaceID and
// its expiry. path must pass workspace.ValidatePath and must not contain
// '%' (such names could not be told apart from escapes, so the verifier
// refuses them); errors for bad input are *brokererr.Error.
func (s *Signer) URL(workspaceID, path string) (string, time.Time, error) {
	if s == nil || s.Keys == nil {
		return "", time.Time{}, errors.New("files: signer has no keys")
	}
	if s.ttl() > s.maxTTL() {
		return "", time.Time{}, fmt.Errorf("files: TTL %v exceeds MaxTTL %v", s.ttl(), s.maxTTL())
	}
	return s.sign(http.MethodGet, workspaceID, path, s.ttl(), nil)
}

// UploadURL returns a signed upload URL (PUT) for path in workspace
// workspaceID, and its expiry. The link accepts a body of at most maxBytes
// bytes (at least 1) and replaces an existing file only if overwrite is
// set; path is checked as for URL.
func (s *Signer) UploadURL(workspaceID, path string, maxBytes int64, overwrite bool) (string, time.Time, error) {
	if s == nil || s.Keys == nil {
		return "", time.Time{}, errors.New("files: signer has no keys")
	}
	if maxBytes < 1 {
		return "", time.Time{}, brokererr.New(brokererr.InvalidInput, "max_bytes must be at least 1")
	}
	ow := "0"
	if overwrite {
		ow = "1"
	}
	return s.sign(http.MethodPut, workspaceID, path, s.uploadTTL(), []param{{"max", strconv.FormatInt(maxBytes, 10)}, {"ow", ow}})
}

// param is a signed query parameter beyond exp, kid and sig.
type param struct{ key, value string }

// sign builds a link for method to path in workspaceID, valid for ttl,
// whose query holds exp, kid, extra (in that order, all signed) and sig;
// s has keys (the callers check).
func (s *Signer) sign(method, workspaceID, path string, ttl time.Duration, extra []param) (string, time.Time, error) {
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
	base, err := s.base()
	if err != nil {
		return "", time.Time{}, err
	}
	exp := s.now().Add(ttl).Unix()
	expStr := strconv.FormatInt(exp, 10)
	kid := s.Keys.ActiveKID()
	key, _ := s.Keys.key(kid)
	fields := []string{workspaceID, esc, expStr}
	var q strings.Builder
	q.WriteString("?exp=" + expStr + "&kid=" + kid)
	for _, p := range extra {
		fields = append(fields, p.value)
		q.WriteString("&" + p.key + "=" + p.value)
	}
	sig := base64.RawURLEncoding.EncodeToString(mac(key, kid, method, fields...))
	return base + PathPrefix + workspaceID + "/" + esc + q.String() + "&sig=" + sig, time.Unix(exp, 0), nil
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

// mac computes the signature over the canonical string-to-sign: "v1",
// kid, method and fields, each on a line of its own (none can hold a
// newline: kids, workspace IDs, exp and the extra values are checked
// tokens, and escaped paths have no control characters).
func mac(key []byte, kid, method string, fields ...string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("v1\n" + kid + "\n" + method))
	for _, f := range fields {
		m.Write([]byte("\n" + f))
	}
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

// Upload is what a verified upload URL grants: writing Path in
// WorkspaceID, at most MaxBytes bytes, replacing an existing file only if
// Overwrite.
type Upload struct {
	Target
	MaxBytes  int64
	Overwrite bool
}

// Verify checks a download request's raw escaped path
// (r.URL.EscapedPath(), starting with PathPrefix) and raw query
// (r.URL.RawQuery), in this order: prefix, workspace id, path canonical
// form, strict query, expiry window, kid, HMAC (constant time). The method
// is the caller's to check (GET or HEAD). Any error wraps ErrDenied.
func (s *Signer) Verify(escapedPath, rawQuery string) (Target, error) {
	if s == nil || s.Keys == nil {
		return Target{}, deny("no keys")
	}
	id, escRel, rel, err := parseFilePath(escapedPath)
	if err != nil {
		return Target{}, err
	}
	q, err := s.verifyQuery(rawQuery, s.maxTTL(), http.MethodGet, []string{id, escRel}, nil)
	if err != nil {
		return Target{}, err
	}
	return Target{WorkspaceID: id, Path: rel, KID: q.kid, Expires: q.exp}, nil
}

// VerifyUpload is Verify for upload (PUT) links: the query must hold
// exactly exp, kid, max, ow and sig, with max a canonical positive decimal
// and ow "0" or "1", and the expiry lie within the upload TTL.
func (s *Signer) VerifyUpload(escapedPath, rawQuery string) (Upload, error) {
	if s == nil || s.Keys == nil {
		return Upload{}, deny("no keys")
	}
	id, escRel, rel, err := parseFilePath(escapedPath)
	if err != nil {
		return Upload{}, err
	}
	q, err := s.verifyQuery(rawQuery, s.uploadTTL(), http.MethodPut, []string{id, escRel}, []string{"max", "ow"})
	if err != nil {
		return Upload{}, err
	}
	// Both were signed: a bad value is a broker bug or a forged key.
	max, err := parseDecimal(q.extra[0])
	if err != nil || max < 1 {
		return Upload{}, deny("max syntax")
	}
	ow := q.extra[1]
	if ow != "0" && ow != "1" {
		return Upload{}, deny("ow syntax")
	}
	return Upload{Target: Target{WorkspaceID: id, Path: rel, KID: q.kid, Expires: q.exp}, MaxBytes: max, Overwrite: ow == "1"}, nil
}

// parseFilePath splits a /files/ path into its workspace id and its path,
// escaped and decoded; only canonical forms pass.
func parseFilePath(escapedPath string) (id, escRel, rel string, err error) {
	rest, ok := strings.CutPrefix(escapedPath, PathPrefix)
	if !ok {
		return "", "", "", deny("prefix")
	}
	id, escRel, ok = strings.Cut(rest, "/")
	if !ok || !ValidWorkspaceID(id) {
		return "", "", "", deny("workspace id")
	}
	rel, err = UnescapePath(escRel)
	if err != nil || strings.ContainsRune(rel, '%') {
		return "", "", "", deny("path")
	}
	return id, escRel, rel, nil
}

// signedQuery is a verified query.
type signedQuery struct {
	kid   string
	exp   time.Time
	extra []string // the values of the extra parameters, in their order
}

// verifyQuery checks a link's raw query: exactly exp, kid, sig and extra,
// once each; an expiry between now and now+maxTTL+ClockSkew; a known kid;
// and, in constant time, the HMAC over method, fields, exp and the extra
// values. s has keys (the callers check).
func (s *Signer) verifyQuery(rawQuery string, maxTTL time.Duration, method string, fields, extra []string) (signedQuery, error) {
	vals, err := parseQuery(rawQuery, extra...)
	if err != nil {
		return signedQuery{}, err
	}
	expStr, kid, sig := vals["exp"], vals["kid"], vals["sig"]
	exp, err := parseDecimal(expStr)
	if err != nil {
		return signedQuery{}, deny("exp syntax")
	}
	now := s.now().Unix()
	if exp < now {
		return signedQuery{}, deny("expired")
	}
	if exp > now+int64((maxTTL+ClockSkew)/time.Second) {
		return signedQuery{}, deny("expiry too far")
	}
	key, ok := s.Keys.key(kid)
	if !ok {
		return signedQuery{}, deny("unknown kid")
	}
	if len(sig) != sigLen {
		return signedQuery{}, deny("signature length")
	}
	got, err := base64.RawURLEncoding.Strict().DecodeString(sig)
	if err != nil || len(got) != sha256.Size {
		return signedQuery{}, deny("signature encoding")
	}
	signed := append(append([]string{}, fields...), expStr)
	q := signedQuery{kid: kid, exp: time.Unix(exp, 0)}
	for _, k := range extra {
		signed = append(signed, vals[k])
		q.extra = append(q.extra, vals[k])
	}
	if !hmac.Equal(got, mac(key, kid, method, signed...)) {
		return signedQuery{}, deny("signature mismatch")
	}
	return q, nil
}

// parseQuery accepts exactly "exp", "kid", "sig" and extra, once each, in
// any order, with raw values (no percent escapes or '+'; the allowed
// characters never need escaping).
func parseQuery(q string, extra ...string) (map[string]string, error) {
	if q == "" {
		return nil, deny("no query")
	}
	want := map[string]bool{"exp": true, "kid": true, "sig": true}
	for _, k := range extra {
		want[k] = true
	}
	parts := strings.Split(q, "&")
	if len(parts) != len(want) {
		return nil, deny("query parameter count")
	}
	vals := make(map[string]string, len(want))
	for _, p := range parts {
		k, v, ok := strings.Cut(p, "=")
		if _, seen := vals[k]; !ok || v == "" || seen {
			return nil, deny("query syntax")
		}
		if !want[k] {
			return nil, deny("unknown query parameter")
		}
		if k == "kid" && !validKID(v) {
			return nil, deny("kid syntax")
		}
		vals[k] = v
	}
	return vals, nil
}

// parseDecimal accepts a canonical non-negative decimal integer of at most
// 18 digits.
func parseDecimal(s string) (int64, error) {
	if len(s) == 0 || len(s) > 18 || (s[0] == '0' && len(s) > 1) {
		return 0, errors.New("not a canonical decimal")
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, errors.New("not a canonical decimal")
		}
	}
	return strconv.ParseInt(s, 10, 64)
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
	sig := base64.RawURLEncoding.EncodeToString(mac(key, kid, http.MethodGet, id, previewPath, expStr))
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
	q, err := s.verifyQuery(rawQuery, s.maxTTL(), http.MethodGet, []string{id, previewPath}, nil)
	if err != nil {
		return time.Time{}, err
	}
	return q.exp, nil
}
