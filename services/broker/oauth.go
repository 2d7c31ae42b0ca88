package broker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mark3labs/mcp-go/server"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/oauth"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// brokerOAuth is the broker as an OAuth protected resource and, in
// embedded mode, its own authorization server.
type brokerOAuth struct {
	verifier *oauth.Verifier
	server   *oauth.Server // nil in external mode
	store    *oauth.Store  // nil in external mode
	prm      server.ProtectedResourceMetadataConfig
	// challenge is the WWW-Authenticate value of a 401 without a token.
	challenge string
	throttle  *middleware.RejectionThrottle
}

// openOAuth sets OAuth up per OAUTH_MODE; it does nothing when off.
func (b *Broker) openOAuth(ctx context.Context, cfg config.Config) error {
	mode := cfg.EffectiveOAuthMode()
	if mode == "off" {
		return nil
	}
	log := logging.Component(b.log, "oauth")
	slog.SetDefault(logging.Slog(log)) // zitadel/oidc logs through slog's default
	resource := cfg.OAuthResource()
	o := &brokerOAuth{throttle: middleware.NewRejectionThrottle(5, 50)}
	switch mode {
	case "embedded":
		issuer := strings.TrimSuffix(cfg.PublicBaseURL, "/")
		accessTTL := time.Duration(cfg.OAuthAccessTTLS) * time.Second
		store, err := oauth.OpenStore(ctx, cfg.StatePath(), nil)
		if err != nil {
			return err
		}
		o.store = store
		keys, err := oauth.OpenKeys(filepath.Join(cfg.Root, "oauth-keys"), time.Duration(cfg.OAuthKeyMaxAgeS)*time.Second, accessTTL, nil)
		if err != nil {
			store.Close()
			return err
		}
		o.server, err = oauth.NewServer(oauth.Config{
			Issuer: issuer, Resource: resource, AccessTTL: accessTTL, RefreshTTL: time.Duration(cfg.OAuthRefreshTTLS) * time.Second,
			Store: store, Keys: keys, Principals: b.tokens, Audit: b.auditor(), Throttle: o.throttle, Log: log,
		})
		if err != nil {
			store.Close()
			return err
		}
		o.verifier = oauth.NewEmbeddedVerifier(issuer, resource, keys, store)
		o.prm = server.ProtectedResourceMetadataConfig{AuthorizationServers: []string{issuer}, ScopesSupported: []string{oauth.Scope}}
		b.checks = append(b.checks, check{"oauth_store", store.Ping})
		b.lead(time.Hour, func(ctx context.Context) {
			if err := o.server.Maintain(ctx); err != nil {
				log.Error().Err(err).Msg("oauth_maintain_failed")
			}
		})
	case "external":
		tiers, err := loadTiers(cfg.OAuthTiersFile)
		if err != nil {
			return err
		}
		audience := cfg.OAuthAudience
		if audience == "" {
			audience = resource
		}
		defaultTier := quota.Tier("")
		if cfg.OAuthDefaultTier != "none" {
			defaultTier = quota.Tier(cfg.OAuthDefaultTier)
		}
		o.verifier = oauth.NewExternalVerifier(oauth.ExternalConfig{
			Issuer: cfg.OAuthIssuer, Audience: audience, Scope: cfg.OAuthScope,
			Claims: oauth.ClaimMapping{PrincipalClaim: cfg.OAuthPrincipalClaim, TierClaim: cfg.OAuthTierClaim, Tiers: tiers, DefaultTier: defaultTier},
		})
		o.prm = server.ProtectedResourceMetadataConfig{AuthorizationServers: []string{cfg.OAuthIssuer}}
		if cfg.OAuthScope != "" {
			o.prm.ScopesSupported = []string{cfg.OAuthScope}
		}
	}
	o.prm.Resource = resource
	o.prm.BearerMethodsSupported = []string{"header"}
	o.prm.ResourceName = "sandbox-broker"
	o.challenge = fmt.Sprintf(`Bearer resource_metadata="%s%s"`, strings.TrimSuffix(cfg.PublicBaseURL, "/"), server.ProtectedResourceMetadataPath(resource))
	if len(o.prm.ScopesSupported) > 0 {
		o.challenge += fmt.Sprintf(`, scope="%s"`, strings.Join(o.prm.ScopesSupported, " "))
	}
	b.oauth = o
	log.Info().Str("mode", mode).Str("resource", resource).Msg("oauth_ready")
	return nil
}

// loadTiers reads OAUTH_TIERS_FILE: {"principal": "free" | "pro", …}.
func loadTiers(path string) (map[string]quota.Tier, error) {
	if path == "" {
		return nil, nil
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("OAUTH_TIERS_FILE: %w", err)
	}
	var m map[string]string
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("OAUTH_TIERS_FILE: not a JSON object of principal to tier: %w", err)
	}
	out := make(map[string]quota.Tier, len(m))
	for p, t := range m {
		tier, err := quota.ParseTier(t)
		if !identity.ValidPrincipal(p) || err != nil {
			return nil, fmt.Errorf("OAUTH_TIERS_FILE: entry %q: principal must be a valid name and tier free or pro", p)
		}
		out[p] = tier
	}
	return out, nil
}

// mountOAuth serves the protected-resource metadata (root and /mcp forms)
// and, in embedded mode, the authorization server.
func (b *Broker) mountOAuth(mux *http.ServeMux) {
	if b.oauth == nil {
		return
	}
	prm := server.NewProtectedResourceMetadataHandler(b.oauth.prm)
	mux.Handle(server.WellKnownProtectedResourcePath, prm)
	mux.Handle(server.ProtectedResourceMetadataPath(b.oauth.prm.Resource), prm)
	if b.oauth.server != nil {
		b.oauth.server.Mount(mux)
	}
}

// principalFor maps a bearer token to its principal: a static token first,
// then an OAuth access token. tokenErr says why an OAuth token failed.
func (b *Broker) principalFor(r *http.Request, token string) (p identity.Principal, ok bool, tokenErr *oauth.TokenError) {
	if p, ok := b.tokens.Authenticate(token); ok || b.oauth == nil || token == "" {
		return p, ok, nil
	}
	p, err := b.oauth.verifier.Verify(r.Context(), token)
	if err == nil {
		return p, true, nil
	}
	if !errors.As(err, &tokenErr) {
		tokenErr = &oauth.TokenError{Reason: "invalid"}
	}
	b.auditBearerRefusal(r, tokenErr)
	return identity.Principal{}, false, tokenErr
}

// auditBearerRefusal writes the (throttled) row of a refused OAuth token.
func (b *Broker) auditBearerRefusal(r *http.Request, e *oauth.TokenError) {
	if oauth.AuditRefusal(r.Context(), b.auditor(), b.oauth.throttle, e, r.URL.Path) {
		b.log.Error().Msg("oauth_audit_failed")
	}
}

// challenge is the WWW-Authenticate header of a refused request (RFC 6750
// section 3, RFC 9728 section 5.1) and its status.
func (b *Broker) challenge(tokenPresent bool, e *oauth.TokenError) (string, int) {
	if b.oauth == nil {
		c := `Bearer realm="sandbox-broker"`
		if tokenPresent {
			c += `, error="invalid_token"`
		}
		return c, http.StatusUnauthorized
	}
	c := b.oauth.challenge
	switch {
	case e != nil && e.Scope != "":
		return c + `, error="insufficient_scope"`, http.StatusForbidden
	case tokenPresent:
		return c + `, error="invalid_token"`, http.StatusUnauthorized
	}
	return c, http.StatusUnauthorized
}

// closeOAuth releases the OAuth store and the JWKS refresher.
func (b *Broker) closeOAuth() error {
	if b.oauth == nil {
		return nil
	}
	b.oauth.verifier.Close()
	if b.oauth.store == nil {
		return nil
	}
	return b.oauth.store.Close()
}
