package oauth

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/lestrrat-go/httprc/v3"
	"github.com/lestrrat-go/jwx/v3/jwk"
	"github.com/lestrrat-go/jwx/v3/jws"
	"github.com/lestrrat-go/jwx/v3/jwt"
	"github.com/zitadel/oidc/v3/pkg/client"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// MaxTokenBytes bounds a bearer token before any parsing.
const MaxTokenBytes = 8 << 10

// clockSkew is the leeway for exp, nbf and iat.
const clockSkew = 30 * time.Second

// asymmetricAlgs are the only JWS algorithms an external issuer's token may
// use: never "none" and never an HMAC, whose key a public JWKS would give away.
var asymmetricAlgs = map[string]bool{"RS256": true, "RS384": true, "RS512": true, "PS256": true, "PS384": true,
	"PS512": true, "ES256": true, "ES384": true, "ES512": true, "EdDSA": true}

// TokenError is why a bearer token was refused. Reason is a short word for
// logs and audit rows; it never holds the token.
type TokenError struct {
	Reason string
	// Scope is set when the token lacks a required scope (403, RFC 6750
	// insufficient_scope); otherwise the answer is 401 invalid_token.
	Scope string
}

func (e *TokenError) Error() string { return "invalid bearer token: " + e.Reason }

func refuse(reason string) *TokenError { return &TokenError{Reason: reason} }

// Verifier checks OAuth access tokens presented to the resource.
type Verifier struct {
	issuer    string
	audience  string
	algs      map[string]bool
	keys      func(ctx context.Context) (jwk.Set, error)
	grants    func(ctx context.Context, id string) error // embedded: the grant is live
	claims    ClaimMapping
	scope     string
	now       func() time.Time
	embedded  bool
	discovery *discovery
}

// ClaimMapping turns an external token's claims into a principal.
type ClaimMapping struct {
	PrincipalClaim string                // default "sub"
	TierClaim      string                // optional: a claim holding "free" or "pro"
	Tiers          map[string]quota.Tier // principal → tier, from OAUTH_TIERS_FILE
	DefaultTier    quota.Tier            // "" refuses principals with no tier
}

// NewEmbeddedVerifier checks tokens the embedded server issued: ES256 by
// its keys, for resource, from a grant that is still live.
func NewEmbeddedVerifier(issuer, resource string, keys *Keys, store *Store) *Verifier {
	return &Verifier{issuer: issuer, audience: resource, algs: map[string]bool{string(signingAlg): true},
		keys: func(context.Context) (jwk.Set, error) { return keys.set() },
		grants: func(ctx context.Context, id string) error {
			_, err := store.ActiveGrant(ctx, id)
			return err
		},
		claims: ClaimMapping{PrincipalClaim: "sub", TierClaim: "tier"}, scope: Scope, now: time.Now, embedded: true}
}

// ExternalConfig configures a verifier for an operator's identity provider.
type ExternalConfig struct {
	Issuer   string // exactly as the IdP's discovery document says
	Audience string
	Scope    string // required scope, if any
	Claims   ClaimMapping
	// HTTP fetches discovery and JWKS; nil uses a client with a timeout.
	HTTP *http.Client
}

// NewExternalVerifier checks tokens from an external issuer. Its JWKS is
// found through the issuer's discovery document on first use, then cached
// and refreshed in the background until Close.
func NewExternalVerifier(cfg ExternalConfig) *Verifier {
	if cfg.Claims.PrincipalClaim == "" {
		cfg.Claims.PrincipalClaim = "sub"
	}
	if cfg.HTTP == nil {
		cfg.HTTP = &http.Client{Timeout: 10 * time.Second}
	}
	d := &discovery{issuer: cfg.Issuer, http: cfg.HTTP}
	d.ctx, d.cancel = context.WithCancel(context.Background())
	return &Verifier{issuer: cfg.Issuer, audience: cfg.Audience, algs: asymmetricAlgs, keys: d.keys,
		claims: cfg.Claims, scope: cfg.Scope, now: time.Now, discovery: d}
}

// Close stops the background JWKS refresh of an external verifier.
func (v *Verifier) Close() {
	if v.discovery != nil {
		v.discovery.cancel()
	}
}

// Verify checks raw and returns its principal.
func (v *Verifier) Verify(ctx context.Context, raw string) (identity.Principal, error) {
	if len(raw) > MaxTokenBytes || strings.Count(raw, ".") != 2 {
		return identity.Principal{}, refuse("malformed")
	}
	msg, err := jws.ParseString(raw)
	if err != nil || len(msg.Signatures()) != 1 {
		return identity.Principal{}, refuse("malformed")
	}
	alg, ok := msg.Signatures()[0].ProtectedHeaders().Algorithm()
	if !ok || !v.algs[alg.String()] {
		return identity.Principal{}, refuse("algorithm")
	}
	set, err := v.keys(ctx)
	if err != nil {
		return identity.Principal{}, refuse("issuer_unavailable")
	}
	tok, err := jwt.ParseString(raw,
		jwt.WithKeySet(set, jws.WithInferAlgorithmFromKey(true)),
		jwt.WithValidate(true),
		jwt.WithIssuer(v.issuer),
		jwt.WithRequiredClaim("exp"),
		jwt.WithAcceptableSkew(clockSkew),
		jwt.WithClock(jwt.ClockFunc(v.now)),
		jwt.WithValidator(jwt.ValidatorFunc(v.checkAudience)),
	)
	if err != nil {
		return identity.Principal{}, refuse(classify(err))
	}
	return v.principal(ctx, tok)
}

// checkAudience accepts our audience with or without a trailing slash (RFC
// 8707 resource identifiers are compared as URIs).
func (v *Verifier) checkAudience(_ context.Context, tok jwt.Token) error {
	want := strings.TrimSuffix(v.audience, "/")
	aud, _ := tok.Audience()
	for _, a := range aud {
		if strings.TrimSuffix(a, "/") == want {
			return nil
		}
	}
	return jwt.InvalidAudienceError()
}

func classify(err error) string {
	switch {
	case errors.Is(err, jwt.TokenExpiredError()):
		return "expired"
	case errors.Is(err, jwt.TokenNotYetValidError()), errors.Is(err, jwt.InvalidIssuedAtError()):
		return "not_yet_valid"
	case errors.Is(err, jwt.InvalidIssuerError()):
		return "issuer"
	case errors.Is(err, jwt.InvalidAudienceError()):
		return "audience"
	case errors.Is(err, jwt.MissingRequiredClaimError()):
		return "missing_claim"
	case errors.Is(err, jwt.ValidateError()):
		return "claims"
	}
	return "signature"
}

func (v *Verifier) principal(ctx context.Context, tok jwt.Token) (identity.Principal, error) {
	id, ok := stringClaim(tok, v.claims.PrincipalClaim)
	if !ok || !identity.ValidPrincipal(id) {
		return identity.Principal{}, refuse("principal_claim")
	}
	if v.scope != "" {
		scope, _ := stringClaim(tok, "scope")
		if !containsExact(strings.Fields(scope), v.scope) {
			return identity.Principal{}, &TokenError{Reason: "scope", Scope: v.scope}
		}
	}
	p := identity.Principal{ID: id}
	if v.embedded {
		sid, ok := stringClaim(tok, "sid")
		if !ok {
			return identity.Principal{}, refuse("grant")
		}
		if err := v.grants(ctx, sid); err != nil {
			if errors.Is(err, ErrRevoked) || errors.Is(err, ErrNotFound) {
				return identity.Principal{}, refuse("revoked")
			}
			return identity.Principal{}, refuse("grant_unavailable")
		}
		var admin bool
		if tok.Has("admin") {
			if err := tok.Get("admin", &admin); err != nil {
				return identity.Principal{}, refuse("claims")
			}
		}
		p.Admin = admin
	}
	tier, err := v.tier(tok, id)
	if err != nil {
		return identity.Principal{}, err
	}
	p.Tier = tier
	return p, nil
}

// tier reads the tier claim, then the tiers file, then the default.
func (v *Verifier) tier(tok jwt.Token, id string) (quota.Tier, error) {
	if v.claims.TierClaim != "" {
		if s, ok := stringClaim(tok, v.claims.TierClaim); ok {
			t, err := quota.ParseTier(s)
			if err != nil {
				return "", refuse("tier_claim")
			}
			return t, nil
		}
		if v.embedded {
			return "", refuse("tier_claim")
		}
	}
	if t, ok := v.claims.Tiers[id]; ok {
		return t, nil
	}
	if v.claims.DefaultTier == "" {
		return "", refuse("no_tier")
	}
	return v.claims.DefaultTier, nil
}

func stringClaim(tok jwt.Token, name string) (string, bool) {
	if name == "" || !tok.Has(name) {
		return "", false
	}
	var s string
	if err := tok.Get(name, &s); err != nil || s == "" {
		return "", false
	}
	return s, true
}

// discovery finds and caches an external issuer's JWKS.
type discovery struct {
	ctx    context.Context // the JWKS cache's lifetime
	cancel context.CancelFunc
	issuer string
	http   *http.Client

	mu       sync.Mutex
	cache    *jwk.Cache
	lastTry  time.Time
	lastErr  error
	resolved jwk.Set
}

// retryAfter spaces discovery attempts while the issuer is unreachable.
const retryAfter = 30 * time.Second

func (d *discovery) keys(ctx context.Context) (jwk.Set, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.resolved != nil {
		return d.resolved, nil
	}
	if !d.lastTry.IsZero() && time.Since(d.lastTry) < retryAfter {
		return nil, d.lastErr
	}
	d.lastTry = time.Now()
	d.lastErr = d.resolve(ctx)
	return d.resolved, d.lastErr
}

func (d *discovery) resolve(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	meta, err := client.Discover(ctx, d.issuer, d.http)
	if err != nil {
		return fmt.Errorf("oauth: discover %s: %w", d.issuer, err)
	}
	if err := checkFetchURL(meta.JwksURI, d.issuer); err != nil {
		return err
	}
	if d.cache == nil {
		if d.cache, err = jwk.NewCache(d.ctx, httprc.NewClient()); err != nil {
			return err
		}
	}
	if err := d.cache.Register(ctx, meta.JwksURI, jwk.WithHTTPClient(d.http),
		jwk.WithMinInterval(5*time.Minute), jwk.WithMaxInterval(time.Hour)); err != nil {
		return fmt.Errorf("oauth: fetch %s JWKS: %w", d.issuer, err)
	}
	set, err := d.cache.CachedSet(meta.JwksURI)
	if err != nil {
		return err
	}
	d.resolved = set
	return nil
}

// checkFetchURL allows https, or http on loopback when the issuer itself
// is a loopback http URL (tests and local IdPs).
func checkFetchURL(raw, issuer string) error {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return fmt.Errorf("oauth: the issuer's jwks_uri is not an absolute URL")
	}
	if u.Scheme == "https" {
		return nil
	}
	iu, _ := url.Parse(issuer)
	if u.Scheme == "http" && config.IsLoopbackHost(u.Hostname()) && iu != nil && iu.Scheme == "http" && config.IsLoopbackHost(iu.Hostname()) {
		return nil
	}
	return fmt.Errorf("oauth: the issuer's jwks_uri must be https")
}
