// Package oauth makes the broker an OAuth 2.1 protected resource (RFC 9728
// metadata, bearer-token checks) and, in embedded mode, its own
// authorization server: RFC 8414 metadata, RFC 7591 dynamic registration, a
// consent page, the authorization-code grant with PKCE S256, rotating
// refresh tokens and revocation.
//
// Grant handling (authorize, token, revoke, JWT signing) is zitadel/oidc's
// op package; this package supplies its storage, the registration endpoint
// (no Go library serves RFC 7591), the consent page and the metadata.
// Access tokens are verified with lestrrat-go/jwx, in both modes.
package oauth

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/rs/zerolog"
	"github.com/zitadel/oidc/v3/pkg/oidc"
	"github.com/zitadel/oidc/v3/pkg/op"
	"golang.org/x/time/rate"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// Paths served by the embedded authorization server.
const (
	PathASMetadata   = "/.well-known/oauth-authorization-server"
	PathOIDCMetadata = "/.well-known/openid-configuration"
	PathRegister     = "/oauth/register"
	PathAuthorize    = "/oauth/authorize"
	PathConsent      = "/oauth/consent"
	PathToken        = "/oauth/token"
	PathRevoke       = "/oauth/revoke"
	PathJWKS         = "/oauth/jwks"
)

// Scope is the one scope the embedded server grants: the whole tool surface
// the principal's tier allows.
const Scope = "sandbox"

// Principals are the broker's static bearer tokens. Approving a consent
// needs one of them; the grant acts as its principal.
type Principals interface {
	Authenticate(token string) (identity.Principal, bool)
	Principal(id string) (identity.Principal, bool)
}

// Config configures the embedded authorization server.
type Config struct {
	Issuer     string // PUBLIC_BASE_URL origin, no trailing slash
	Resource   string // the protected resource (Issuer + "/mcp"), the access tokens' audience
	Scopes     []string
	AccessTTL  time.Duration
	RefreshTTL time.Duration
	KeyMaxAge  time.Duration // signing keys rotate when this old
	Store      *Store
	Keys       *Keys
	Principals Principals
	Audit      Auditor
	Throttle   Throttle
	Log        zerolog.Logger
	// AuditFailed counts audit writes that failed (metrics); may be nil.
	AuditFailed func(tool string)
	Now         func() time.Time
}

// Server is the embedded authorization server.
type Server struct {
	cfg      Config
	store    *Store
	keys     *Keys
	log      zerolog.Logger
	provider *op.Provider
	requests *authRequests
	regLimit *rate.Limiter
	secure   bool // https issuer: Secure cookies
}

// NewServer builds the authorization server over its store and keys.
func NewServer(cfg Config) (*Server, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if len(cfg.Scopes) == 0 {
		cfg.Scopes = []string{Scope}
	}
	if cfg.Store == nil || cfg.Keys == nil || cfg.Principals == nil || cfg.Audit == nil {
		return nil, errors.New("oauth: store, keys, principals and audit are required")
	}
	s := &Server{cfg: cfg, store: cfg.Store, keys: cfg.Keys, log: cfg.Log,
		requests: newAuthRequests(cfg.Now),
		// 10 registrations a minute, bursts of 20: real clients register once.
		regLimit: rate.NewLimiter(rate.Every(6*time.Second), 20),
		secure:   strings.HasPrefix(cfg.Issuer, "https://"),
	}
	var cryptoKey [32]byte // encrypts authorization codes; per process
	if _, err := rand.Read(cryptoKey[:]); err != nil {
		return nil, err
	}
	opts := []op.Option{
		op.WithCustomEndpoints(op.NewEndpoint(PathAuthorize), op.NewEndpoint(PathToken), op.NewEndpoint("/oauth/userinfo"),
			op.NewEndpoint(PathRevoke), op.NewEndpoint("/oauth/end_session"), op.NewEndpoint(PathJWKS)),
	}
	if !s.secure {
		opts = append(opts, op.WithAllowInsecure()) // config allows http only on loopback
	}
	p, err := op.NewProvider(&op.Config{
		CryptoKey:             cryptoKey,
		CodeMethodS256:        true,
		AuthMethodPost:        true,
		GrantTypeRefreshToken: true,
		SupportedScopes:       cfg.Scopes,
	}, &storage{s: s}, op.StaticIssuer(cfg.Issuer), opts...)
	if err != nil {
		return nil, fmt.Errorf("oauth: provider: %w", err)
	}
	s.provider = p
	return s, nil
}

func (s *Server) now() time.Time { return s.cfg.Now() }

func (s *Server) auditFailed(tool string) {
	s.log.Error().Str("tool", tool).Msg("oauth_audit_failed")
	if s.cfg.AuditFailed != nil {
		s.cfg.AuditFailed(tool)
	}
}

// maxFormBytes bounds token, revocation and consent request bodies.
const maxFormBytes = 64 << 10

// Mount adds the authorization server's routes to mux.
func (s *Server) Mount(mux *http.ServeMux) {
	issuer := op.NewIssuerInterceptor(s.provider.IssuerFromRequest)
	form := func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
			h.ServeHTTP(w, r)
		})
	}
	mux.HandleFunc("GET "+PathASMetadata, s.metadata)
	mux.HandleFunc("GET "+PathOIDCMetadata, s.metadata)
	mux.HandleFunc("POST "+PathRegister, s.register)
	mux.Handle("GET "+PathAuthorize, issuer.Handler(s.audited("oauth.authorize", http.HandlerFunc(s.authorize))))
	mux.HandleFunc("GET "+PathConsent, s.consentPage)
	mux.Handle("POST "+PathConsent, form(http.HandlerFunc(s.consentSubmit)))
	mux.Handle("POST "+PathToken, form(issuer.Handler(s.audited("oauth.token", http.HandlerFunc(s.token)))))
	mux.Handle("POST "+PathRevoke, form(issuer.Handler(s.audited("oauth.revoke", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		op.Revoke(w, r, s.provider)
	})))))
	mux.HandleFunc("GET "+PathJWKS, func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, s.keys.JWKS())
	})
}

// Maintain rotates signing keys, prunes expired grants and registrations,
// and forgets finished authorization requests. The broker runs it hourly.
func (s *Server) Maintain(ctx context.Context) error {
	s.requests.sweep()
	return errors.Join(s.keys.Maintain(), s.store.Prune(ctx, s.cfg.AccessTTL, clientUnusedTTL))
}

// asMetadata is RFC 8414 authorization server metadata; the OIDC discovery
// path serves the same document.
type asMetadata struct {
	Issuer                                     string   `json:"issuer"`
	AuthorizationEndpoint                      string   `json:"authorization_endpoint"`
	TokenEndpoint                              string   `json:"token_endpoint"`
	RegistrationEndpoint                       string   `json:"registration_endpoint"`
	RevocationEndpoint                         string   `json:"revocation_endpoint"`
	JWKSURI                                    string   `json:"jwks_uri"`
	ScopesSupported                            []string `json:"scopes_supported"`
	ResponseTypesSupported                     []string `json:"response_types_supported"`
	ResponseModesSupported                     []string `json:"response_modes_supported"`
	GrantTypesSupported                        []string `json:"grant_types_supported"`
	CodeChallengeMethodsSupported              []string `json:"code_challenge_methods_supported"`
	TokenEndpointAuthMethodsSupported          []string `json:"token_endpoint_auth_methods_supported"`
	RevocationEndpointAuthMethodsSupported     []string `json:"revocation_endpoint_auth_methods_supported"`
	AuthorizationResponseIssParameterSupported bool     `json:"authorization_response_iss_parameter_supported"`
	SubjectTypesSupported                      []string `json:"subject_types_supported"`
	IDTokenSigningAlgValuesSupported           []string `json:"id_token_signing_alg_values_supported"`
}

func (s *Server) metadata(w http.ResponseWriter, r *http.Request) {
	auth := []string{AuthNone, AuthSecretPost, AuthSecretBasic}
	writeJSON(w, http.StatusOK, asMetadata{
		Issuer:                                     s.cfg.Issuer,
		AuthorizationEndpoint:                      s.cfg.Issuer + PathAuthorize,
		TokenEndpoint:                              s.cfg.Issuer + PathToken,
		RegistrationEndpoint:                       s.cfg.Issuer + PathRegister,
		RevocationEndpoint:                         s.cfg.Issuer + PathRevoke,
		JWKSURI:                                    s.cfg.Issuer + PathJWKS,
		ScopesSupported:                            s.cfg.Scopes,
		ResponseTypesSupported:                     []string{"code"},
		ResponseModesSupported:                     []string{"query"},
		GrantTypesSupported:                        []string{"authorization_code", "refresh_token"},
		CodeChallengeMethodsSupported:              []string{"S256"},
		TokenEndpointAuthMethodsSupported:          auth,
		RevocationEndpointAuthMethodsSupported:     auth,
		AuthorizationResponseIssParameterSupported: true,
		SubjectTypesSupported:                      []string{"public"},
		IDTokenSigningAlgValuesSupported:           []string{string(signingAlg)},
	})
}

// token is op.Exchange with RFC 8707 checked on the way in and the ID token
// dropped on the way out: no openid scope is offered, and an ID token is not
// an access token for anything.
func (s *Server) token(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		writeError(w, &Error{Status: http.StatusBadRequest, Code: "invalid_request", Description: "the form could not be read"})
		return
	}
	for _, res := range r.PostForm["resource"] {
		if !s.isResource(res) {
			eventFrom(r.Context()).set(map[string]any{"reason": "resource"})
			writeError(w, &Error{Status: http.StatusBadRequest, Code: "invalid_target", Description: "resource must be " + s.cfg.Resource})
			return
		}
	}
	rec := newRecorder()
	op.Exchange(rec, r, s.provider)
	if rec.status == http.StatusOK {
		var body map[string]any
		if err := json.Unmarshal(rec.body.Bytes(), &body); err == nil {
			delete(body, "id_token")
			if b, err := json.Marshal(body); err == nil {
				rec.body.Reset()
				rec.body.Write(b)
				rec.header.Del("Content-Length")
			}
		}
	}
	rec.flush(w)
}

// authorize checks the client and its exact redirect URI before anything
// else: an error about either must not be redirected (RFC 6749 section
// 4.1.2.1). The rest is op.Authorize, with validate as its validator.
func (s *Server) authorize(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	ev := eventFrom(r.Context())
	clientID, redirect := q.Get("client_id"), q.Get("redirect_uri")
	ev.set(map[string]any{"client_id": truncate(clientID, 64)})
	c, err := s.store.Client(r.Context(), clientID)
	switch {
	case errors.Is(err, ErrNotFound) || clientID == "":
		writeError(w, &Error{Status: http.StatusBadRequest, Code: "invalid_client", Description: "unknown client_id; register the client first"})
		return
	case err != nil:
		s.log.Error().Err(err).Msg("oauth_client_lookup_failed")
		writeError(w, serverError())
		return
	}
	if redirect == "" || !containsExact(c.Metadata.RedirectURIs, redirect) {
		ev.set(map[string]any{"reason": "redirect_uri_not_registered"})
		writeError(w, &Error{Status: http.StatusBadRequest, Code: "invalid_request",
			Description: "redirect_uri does not exactly match one registered for this client"})
		return
	}
	ctx := context.WithValue(r.Context(), resourceKey{}, q["resource"])
	op.Authorize(w, r.WithContext(ctx), authorizer{s.provider, s})
}

type resourceKey struct{}

// authorizer is the provider with our request validation.
type authorizer struct {
	*op.Provider
	s *Server
}

// ValidateAuthRequest implements op.AuthorizeValidator. The client and
// redirect URI were checked by authorize; errors here are redirected.
func (a authorizer) ValidateAuthRequest(ctx context.Context, req *oidc.AuthRequest, _ op.Storage, _ *op.IDTokenHintVerifier) (string, error) {
	ev := eventFrom(ctx)
	fail := func(reason string, e *oidc.Error) (string, error) {
		ev.set(map[string]any{"reason": reason})
		return "", e
	}
	if req.ResponseType != oidc.ResponseTypeCode {
		return fail("response_type", &oidc.Error{ErrorType: "unsupported_response_type", Description: "response_type must be code"})
	}
	if req.ResponseMode != "" && req.ResponseMode != oidc.ResponseModeQuery {
		return fail("response_mode", oidc.ErrInvalidRequest().WithDescription("response_mode must be query"))
	}
	if req.CodeChallenge == "" {
		return fail("pkce_missing", oidc.ErrInvalidRequest().WithDescription("code_challenge is required (PKCE with S256)"))
	}
	if req.CodeChallengeMethod != oidc.CodeChallengeMethodS256 {
		return fail("pkce_method", oidc.ErrInvalidRequest().WithDescription("code_challenge_method must be S256"))
	}
	if len(req.CodeChallenge) != 43 {
		return fail("pkce_challenge", oidc.ErrInvalidRequest().WithDescription("code_challenge must be a base64url SHA-256 (43 characters)"))
	}
	resources, _ := ctx.Value(resourceKey{}).([]string)
	for _, res := range resources {
		if !a.s.isResource(res) {
			return fail("resource", oidc.ErrInvalidTarget().WithDescription("resource must be %s", a.s.cfg.Resource))
		}
	}
	if len(resources) > 1 {
		return fail("resource", oidc.ErrInvalidTarget().WithDescription("one resource only"))
	}
	if req.RequestParam != "" {
		return fail("request_object", oidc.ErrRequestNotSupported())
	}
	var scopes []string
	for _, sc := range req.Scopes {
		if containsExact(a.s.cfg.Scopes, sc) && !containsExact(scopes, sc) {
			scopes = append(scopes, sc)
		}
	}
	if len(scopes) == 0 {
		scopes = a.s.cfg.Scopes // ChatGPT omits scope on reconnect
	}
	req.Scopes = scopes
	return "", nil
}

// isResource compares a resource indicator with ours, with or without a
// trailing slash.
func (s *Server) isResource(r string) bool {
	return strings.TrimSuffix(r, "/") == strings.TrimSuffix(s.cfg.Resource, "/")
}

func containsExact(list []string, v string) bool {
	for _, x := range list {
		if x == v {
			return true
		}
	}
	return false
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
