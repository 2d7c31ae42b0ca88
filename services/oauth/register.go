package oauth

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/config"
)

// Limits of one registration (RFC 7591). Real clients send a few hundred
// bytes and one or two redirect URIs.
const (
	MaxRegistrationBytes = 16 << 10
	maxRedirectURIs      = 10
	maxURILen            = 2000
	maxClientNameRunes   = 100
	maxScopeLen          = 1000
)

// Token endpoint authentication methods a client may register.
const (
	AuthNone        = "none"
	AuthSecretPost  = "client_secret_post"
	AuthSecretBasic = "client_secret_basic"
)

// Registration is the client metadata we keep and echo back. Metadata we do
// not understand is ignored, as RFC 7591 section 2 requires.
type Registration struct {
	RedirectURIs            []string `json:"redirect_uris"`
	ClientName              string   `json:"client_name,omitempty"`
	GrantTypes              []string `json:"grant_types"`
	ResponseTypes           []string `json:"response_types"`
	TokenEndpointAuthMethod string   `json:"token_endpoint_auth_method"`
	Scope                   string   `json:"scope,omitempty"`
}

// Error is an OAuth error response (RFC 6749 section 5.2, RFC 7591 section 3.2.2).
type Error struct {
	Status      int    `json:"-"`
	Code        string `json:"error"`
	Description string `json:"error_description,omitempty"`
}

func (e *Error) Error() string { return e.Code + ": " + e.Description }

func metadataError(desc string) *Error {
	return &Error{Status: http.StatusBadRequest, Code: "invalid_client_metadata", Description: desc}
}

func redirectError(desc string) *Error {
	return &Error{Status: http.StatusBadRequest, Code: "invalid_redirect_uri", Description: desc}
}

// ParseRegistration validates a registration request body. scopes are the
// scopes this server grants; requested ones outside it are dropped and an
// empty result defaults to all of them (some clients send none).
func ParseRegistration(body []byte, scopes []string) (Registration, *Error) {
	if len(body) > MaxRegistrationBytes {
		return Registration{}, metadataError("the registration is larger than 16 KiB")
	}
	if !utf8.Valid(body) {
		return Registration{}, metadataError("the registration is not valid UTF-8")
	}
	var raw struct {
		RedirectURIs            []string `json:"redirect_uris"`
		ClientName              *string  `json:"client_name"`
		GrantTypes              []string `json:"grant_types"`
		ResponseTypes           []string `json:"response_types"`
		TokenEndpointAuthMethod *string  `json:"token_endpoint_auth_method"`
		Scope                   *string  `json:"scope"`
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&raw); err != nil {
		return Registration{}, metadataError("the registration is not a JSON object of client metadata")
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return Registration{}, metadataError("the registration has data after the JSON object")
	}
	if bytes.HasPrefix(bytes.TrimSpace(body), []byte("null")) {
		return Registration{}, metadataError("the registration is not a JSON object of client metadata")
	}
	r := Registration{
		GrantTypes:              []string{"authorization_code"},
		ResponseTypes:           []string{"code"},
		TokenEndpointAuthMethod: AuthSecretBasic, // RFC 7591 section 2 default
	}
	if len(raw.RedirectURIs) == 0 {
		return Registration{}, redirectError("redirect_uris is required")
	}
	if len(raw.RedirectURIs) > maxRedirectURIs {
		return Registration{}, redirectError("at most 10 redirect_uris are allowed")
	}
	if raw.TokenEndpointAuthMethod != nil {
		switch m := *raw.TokenEndpointAuthMethod; m {
		case AuthNone, AuthSecretPost, AuthSecretBasic:
			r.TokenEndpointAuthMethod = m
		default:
			return Registration{}, metadataError("token_endpoint_auth_method must be none, client_secret_post or client_secret_basic")
		}
	}
	for _, u := range raw.RedirectURIs {
		if err := checkRedirectURI(u, r.TokenEndpointAuthMethod == AuthNone); err != nil {
			return Registration{}, err
		}
		if !slices.Contains(r.RedirectURIs, u) {
			r.RedirectURIs = append(r.RedirectURIs, u)
		}
	}
	if raw.GrantTypes != nil {
		r.GrantTypes = nil
		for _, g := range raw.GrantTypes {
			if g != "authorization_code" && g != "refresh_token" {
				return Registration{}, metadataError("grant_types may only hold authorization_code and refresh_token")
			}
			if !slices.Contains(r.GrantTypes, g) {
				r.GrantTypes = append(r.GrantTypes, g)
			}
		}
		if !slices.Contains(r.GrantTypes, "authorization_code") {
			return Registration{}, metadataError("grant_types must include authorization_code")
		}
	}
	if raw.ResponseTypes != nil {
		for _, t := range raw.ResponseTypes {
			if t != "code" {
				return Registration{}, metadataError("response_types may only hold code")
			}
		}
	}
	if raw.ClientName != nil {
		name := strings.TrimSpace(*raw.ClientName)
		if utf8.RuneCountInString(name) > maxClientNameRunes {
			return Registration{}, metadataError("client_name is longer than 100 characters")
		}
		for _, c := range name {
			if !unicode.IsPrint(c) || isBidiControl(c) {
				return Registration{}, metadataError("client_name holds a control or formatting character")
			}
		}
		r.ClientName = name
	}
	var requested []string
	if raw.Scope != nil {
		if len(*raw.Scope) > maxScopeLen {
			return Registration{}, metadataError("scope is longer than 1000 characters")
		}
		for _, s := range strings.Fields(*raw.Scope) {
			if slices.Contains(scopes, s) && !slices.Contains(requested, s) {
				requested = append(requested, s)
			}
		}
	}
	if len(requested) == 0 {
		requested = scopes
	}
	r.Scope = strings.Join(requested, " ")
	return r, nil
}

// isBidiControl reports characters that can make a name display as
// something else (Trojan Source style); unicode.IsPrint admits them.
func isBidiControl(c rune) bool {
	return unicode.Is(unicode.Bidi_Control, c) || c == '\u200b' || c == '\u200c' || c == '\u200d' || c == '\u2060' || c == '\ufeff'
}

// unsafeSchemes can never be redirect targets: they run code or read local
// data in the browser instead of handing the code to an application.
var unsafeSchemes = map[string]bool{"javascript": true, "data": true, "vbscript": true, "file": true, "about": true,
	"blob": true, "filesystem": true, "view-source": true, "ws": true, "wss": true, "ftp": true}

// checkRedirectURI allows https anywhere, http on loopback only, and, for
// public (PKCE-only) clients, an application's private-use scheme (RFC 8252
// section 7.1, e.g. cursor://). No fragment, no user info, no wildcard.
func checkRedirectURI(raw string, public bool) *Error {
	if raw == "" || len(raw) > maxURILen || !utf8.ValidString(raw) {
		return redirectError("each redirect URI must be 1 to 2000 characters")
	}
	for _, c := range raw {
		if c <= ' ' || c == 0x7f || c > unicode.MaxASCII {
			return redirectError("a redirect URI holds a space, control or non-ASCII character")
		}
	}
	u, err := url.Parse(raw)
	if err != nil || !u.IsAbs() {
		return redirectError("each redirect URI must be an absolute URI")
	}
	if u.Fragment != "" || strings.Contains(raw, "#") {
		return redirectError("a redirect URI must not have a fragment")
	}
	if u.User != nil {
		return redirectError("a redirect URI must not hold user info")
	}
	if strings.Contains(raw, "*") {
		return redirectError("a redirect URI must not hold a wildcard")
	}
	switch scheme := strings.ToLower(u.Scheme); {
	case scheme == "https":
		if u.Hostname() == "" {
			return redirectError("an https redirect URI needs a host")
		}
	case scheme == "http":
		if !config.IsLoopbackHost(u.Hostname()) {
			return redirectError("http redirect URIs are allowed only on loopback (127.0.0.1, [::1], localhost); use https")
		}
	case unsafeSchemes[scheme]:
		return redirectError("the redirect URI scheme is not allowed")
	default:
		if !public {
			return redirectError("a private-use redirect scheme needs token_endpoint_auth_method none (a native app with PKCE)")
		}
	}
	return nil
}

// registrationResponse is the RFC 7591 section 3.2.1 reply.
type registrationResponse struct {
	ClientID              string `json:"client_id"`
	ClientIDIssuedAt      int64  `json:"client_id_issued_at"`
	ClientSecret          string `json:"client_secret,omitempty"`
	ClientSecretExpiresAt *int64 `json:"client_secret_expires_at,omitempty"`
	Registration
}

// register serves POST /oauth/register.
func (s *Server) register(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	ev := s.newEvent("oauth.register")
	fail := func(e *Error) {
		ev.reject(ctx, e.Code, nil)
		writeError(w, e)
	}
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		fail(metadataError("the registration must be sent as application/json"))
		return
	}
	if !s.regLimit.Allow() {
		w.Header().Set("Retry-After", "60")
		fail(&Error{Status: http.StatusTooManyRequests, Code: "temporarily_unavailable", Description: "too many registrations; try again in a minute"})
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxRegistrationBytes+1))
	if err != nil {
		fail(metadataError("the registration could not be read"))
		return
	}
	reg, perr := ParseRegistration(body, s.cfg.Scopes)
	if perr != nil {
		fail(perr)
		return
	}
	now := s.now()
	c := Client{ID: "sbc_" + randomString(16), Metadata: reg, CreatedAt: now}
	resp := registrationResponse{ClientID: c.ID, ClientIDIssuedAt: now.Unix(), Registration: reg}
	if reg.TokenEndpointAuthMethod != AuthNone {
		resp.ClientSecret = "sbs_" + randomString(32)
		c.SecretHash = hashToken(resp.ClientSecret)
		never := int64(0)
		resp.ClientSecretExpiresAt = &never
	}
	if err := ev.begin(ctx, "", map[string]any{"client_id": c.ID, "client_name": reg.ClientName,
		"redirect_hosts": redirectHosts(reg.RedirectURIs), "auth_method": reg.TokenEndpointAuthMethod, "grant_types": reg.GrantTypes}); err != nil {
		writeError(w, serverError())
		return
	}
	if err := s.store.CreateClient(ctx, c, maxUnusedClients); err != nil {
		if errors.Is(err, errTooManyClients) {
			ev.end(ctx, audit.OutcomeRateLimited, "temporarily_unavailable", nil)
			w.Header().Set("Retry-After", "3600")
			writeError(w, &Error{Status: http.StatusServiceUnavailable, Code: "temporarily_unavailable", Description: "too many unused registrations; try again later"})
			return
		}
		ev.end(ctx, audit.OutcomeFailure, "server_error", nil)
		s.log.Error().Err(err).Msg("oauth_register_failed")
		writeError(w, serverError())
		return
	}
	ev.end(ctx, audit.OutcomeSuccess, "", nil)
	s.log.Info().Str("client_id", c.ID).Str("auth_method", reg.TokenEndpointAuthMethod).Msg("oauth_client_registered")
	writeJSON(w, http.StatusCreated, resp)
}

// maxUnusedClients caps registrations that never got a token; they expire
// after clientUnusedTTL.
const (
	maxUnusedClients = 500
	clientUnusedTTL  = 24 * time.Hour
)

// redirectHosts names where a client's redirects go, for audit rows and the
// consent page (schemes other than http(s) are shown as "scheme:").
func redirectHosts(uris []string) []string {
	var out []string
	for _, raw := range uris {
		u, err := url.Parse(raw)
		if err != nil {
			continue
		}
		h := u.Host
		if s := strings.ToLower(u.Scheme); s != "https" && s != "http" {
			h = s + ":" + u.Host
		}
		if !slices.Contains(out, h) {
			out = append(out, h)
		}
	}
	return out
}

func randomString(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic("crypto/rand: " + err.Error()) // never fails on Linux
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

func serverError() *Error {
	return &Error{Status: http.StatusInternalServerError, Code: "server_error", Description: "the server could not complete the request"}
}

func writeError(w http.ResponseWriter, e *Error) {
	writeJSON(w, e.Status, e)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
