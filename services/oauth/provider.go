package oauth

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/zitadel/oidc/v3/pkg/oidc"
	"github.com/zitadel/oidc/v3/pkg/op"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// storage is op.Storage over Store (clients, grants, refresh tokens),
// authRequests (the authorization step) and Keys. Token issue, refresh and
// revocation write their intent row here, right before the effect.
type storage struct{ s *Server }

var (
	_ op.Storage                        = (*storage)(nil)
	_ op.CanGetPrivateClaimsFromRequest = (*storage)(nil)
)

// opClient adapts a registration to op.Client.
type opClient struct {
	c       Client
	consent string // consent page URL without the id
	scopes  []string
}

func (c opClient) GetID() string                    { return c.c.ID }
func (c opClient) RedirectURIs() []string           { return c.c.Metadata.RedirectURIs }
func (c opClient) PostLogoutRedirectURIs() []string { return nil }
func (c opClient) ApplicationType() op.ApplicationType {
	return op.ApplicationTypeWeb // unused: authorize checks redirects itself
}
func (c opClient) AuthMethod() oidc.AuthMethod {
	return oidc.AuthMethod(c.c.Metadata.TokenEndpointAuthMethod)
}
func (c opClient) ResponseTypes() []oidc.ResponseType {
	return []oidc.ResponseType{oidc.ResponseTypeCode}
}
func (c opClient) GrantTypes() []oidc.GrantType {
	out := make([]oidc.GrantType, 0, len(c.c.Metadata.GrantTypes))
	for _, g := range c.c.Metadata.GrantTypes {
		out = append(out, oidc.GrantType(g))
	}
	return out
}
func (c opClient) LoginURL(id string) string            { return c.consent + "?id=" + url.QueryEscape(id) }
func (c opClient) AccessTokenType() op.AccessTokenType  { return op.AccessTokenTypeJWT }
func (c opClient) IDTokenLifetime() time.Duration       { return time.Minute }
func (c opClient) DevMode() bool                        { return false }
func (c opClient) IsScopeAllowed(scope string) bool     { return containsExact(c.scopes, scope) }
func (c opClient) IDTokenUserinfoClaimsAssertion() bool { return false }
func (c opClient) ClockSkew() time.Duration             { return 0 }
func (c opClient) RestrictAdditionalIdTokenScopes() func([]string) []string {
	return func(s []string) []string { return s }
}
func (c opClient) RestrictAdditionalAccessTokenScopes() func([]string) []string {
	return func(s []string) []string { return s }
}

func (st *storage) GetClientByClientID(ctx context.Context, id string) (op.Client, error) {
	c, err := st.s.store.Client(ctx, id)
	if errors.Is(err, ErrNotFound) {
		return nil, errors.New("unknown client")
	}
	if err != nil {
		return nil, oidc.ErrServerError().WithParent(err)
	}
	return opClient{c: c, consent: st.s.cfg.Issuer + PathConsent, scopes: st.s.cfg.Scopes}, nil
}

func (st *storage) AuthorizeClientIDSecret(ctx context.Context, id, secret string) error {
	c, err := st.s.store.Client(ctx, id)
	if errors.Is(err, ErrNotFound) {
		return errors.New("unknown client")
	}
	if err != nil {
		return oidc.ErrServerError().WithParent(err)
	}
	if !c.CheckSecret(secret) {
		return errors.New("wrong client secret")
	}
	return nil
}

func (st *storage) CreateAuthRequest(ctx context.Context, req *oidc.AuthRequest, _ string) (op.AuthRequest, error) {
	scopes := req.Scopes
	a := &authRequest{
		id: randomString(consentIDLen), clientID: req.ClientID, redirectURI: req.RedirectURI, state: req.State, nonce: req.Nonce,
		audience: st.s.cfg.Resource, challenge: &oidc.CodeChallenge{Challenge: req.CodeChallenge, Method: req.CodeChallengeMethod},
		created: st.s.now(), csrf: randomString(32),
	}
	// Refresh tokens are issued to clients registered for them; op asks
	// for offline_access to issue one.
	if c, err := st.s.store.Client(ctx, req.ClientID); err == nil && containsExact(c.Metadata.GrantTypes, "refresh_token") {
		scopes = append(scopes, oidc.ScopeOfflineAccess)
	}
	a.scopes = scopes
	if err := st.s.requests.add(a); err != nil {
		return nil, &oidc.Error{ErrorType: "temporarily_unavailable", Description: "too many pending authorization requests; try again later"}
	}
	return a, nil
}

func (st *storage) AuthRequestByID(_ context.Context, id string) (op.AuthRequest, error) {
	return st.s.requests.get(id)
}

func (st *storage) SaveAuthCode(_ context.Context, id, code string) error {
	return st.s.requests.saveCode(id, code)
}

// AuthRequestByCode finds the request of a code. A replayed code revokes
// every token its first exchange issued (RFC 6749 section 4.1.2).
func (st *storage) AuthRequestByCode(ctx context.Context, code string) (op.AuthRequest, error) {
	a, replayed, err := st.s.requests.byCodeValue(code)
	if errors.Is(err, errCodeReplayed) {
		st.revokeReplayed(ctx, replayed)
	}
	if err != nil {
		return nil, err
	}
	eventFrom(ctx).set(map[string]any{"client_id": a.clientID})
	return a, nil
}

func (st *storage) revokeReplayed(ctx context.Context, grantID string) {
	ev := eventFrom(ctx)
	ev.set(map[string]any{"reason": "authorization_code_replay", "grant_id": grantID, "grant_revoked": grantID != ""})
	if grantID == "" {
		return
	}
	if err := st.s.store.RevokeGrant(ctx, grantID, "authorization_code_replay"); err != nil {
		st.s.log.Error().Err(err).Msg("oauth_revoke_failed")
	}
}

// DeleteAuthRequest is called once the code's tokens exist. The request
// stays, marked redeemed, until it expires, so a replay is recognised.
func (st *storage) DeleteAuthRequest(context.Context, string) error { return nil }

// tokenRequest is what an access token needs from either request kind.
type tokenRequest interface {
	op.TokenRequest
	grantInfo() (grantID string, p identity.Principal)
}

func (a *authRequest) grantInfo() (string, identity.Principal) { return a.grantID, a.principal }

// refreshRequest is a live grant presented through one of its refresh
// tokens. It implements op.RefreshTokenRequest.
type refreshRequest struct {
	grant     Grant
	principal identity.Principal
	scopes    []string
}

func (r *refreshRequest) GetAMR() []string                        { return []string{"bearer"} }
func (r *refreshRequest) GetAudience() []string                   { return []string{r.grant.Audience} }
func (r *refreshRequest) GetAuthTime() time.Time                  { return time.Time{} }
func (r *refreshRequest) GetClientID() string                     { return r.grant.ClientID }
func (r *refreshRequest) GetScopes() []string                     { return r.scopes }
func (r *refreshRequest) GetSubject() string                      { return r.principal.ID }
func (r *refreshRequest) SetCurrentScopes(scopes []string)        { r.scopes = scopes }
func (r *refreshRequest) grantInfo() (string, identity.Principal) { return r.grant.ID, r.principal }

// accessTokenID names an access token: its grant, then random bits. The
// grant part lets revocation and the verifier find the grant.
func (st *storage) accessTokenID(grantID string) string { return grantID + "." + randomString(9) }

func grantOf(tokenID string) string {
	g, _, _ := strings.Cut(tokenID, ".")
	return g
}

// CreateAccessToken serves clients registered without refresh tokens.
func (st *storage) CreateAccessToken(ctx context.Context, req op.TokenRequest) (string, time.Time, error) {
	a, ok := req.(*authRequest)
	if !ok {
		return "", time.Time{}, oidc.ErrUnsupportedGrantType()
	}
	grantID, err := st.exchangeCode(ctx, a, "")
	if err != nil {
		return "", time.Time{}, err
	}
	return st.accessTokenID(grantID), st.s.now().Add(st.s.cfg.AccessTTL), nil
}

func (st *storage) CreateAccessAndRefreshTokens(ctx context.Context, req op.TokenRequest, current string) (string, string, time.Time, error) {
	next := "sbr_" + randomString(32)
	switch r := req.(type) {
	case *authRequest:
		grantID, err := st.exchangeCode(ctx, r, next)
		if err != nil {
			return "", "", time.Time{}, err
		}
		return st.accessTokenID(grantID), next, st.s.now().Add(st.s.cfg.AccessTTL), nil
	case *refreshRequest:
		ev := eventFrom(ctx)
		if err := ev.begin(ctx, r.principal.ID, map[string]any{"grant": "refresh_token", "client_id": r.grant.ClientID, "grant_id": r.grant.ID}); err != nil {
			return "", "", time.Time{}, oidc.ErrServerError().WithParent(err)
		}
		if _, err := st.s.store.RotateRefresh(ctx, current, next, st.s.cfg.RefreshTTL); err != nil {
			return "", "", time.Time{}, st.refreshError(ctx, err)
		}
		return st.accessTokenID(r.grant.ID), next, st.s.now().Add(st.s.cfg.AccessTTL), nil
	}
	return "", "", time.Time{}, oidc.ErrUnsupportedGrantType()
}

// exchangeCode redeems an approved request's code and creates its grant.
func (st *storage) exchangeCode(ctx context.Context, a *authRequest, refresh string) (string, error) {
	if replayed, err := st.s.requests.redeem(a.id); err != nil {
		if errors.Is(err, errCodeReplayed) {
			st.revokeReplayed(ctx, replayed)
		}
		return "", oidc.ErrInvalidGrant().WithDescription("the authorization code was already used")
	}
	grantID := "sbg_" + randomString(12)
	if err := eventFrom(ctx).begin(ctx, a.principal.ID, map[string]any{"grant": "authorization_code", "client_id": a.clientID,
		"grant_id": grantID, "scope": strings.Join(grantScopes(a.scopes), " ")}); err != nil {
		return "", oidc.ErrServerError().WithParent(err)
	}
	g := Grant{ID: grantID, ClientID: a.clientID, Principal: a.principal.ID, Scopes: grantScopes(a.scopes), Audience: a.audience}
	if err := st.s.store.CreateGrant(ctx, g, refresh, st.s.cfg.RefreshTTL); err != nil {
		return "", oidc.ErrServerError().WithParent(err)
	}
	st.s.requests.setGrant(a.id, grantID)
	a.grantID = grantID // this copy signs the access token
	return grantID, nil
}

// grantScopes drops offline_access, which only asked op for a refresh token.
func grantScopes(scopes []string) []string {
	out := make([]string, 0, len(scopes))
	for _, s := range scopes {
		if s != oidc.ScopeOfflineAccess {
			out = append(out, s)
		}
	}
	return out
}

// TokenRequestByRefreshToken finds the grant of a refresh token. A token
// already rotated away is reuse: the store revokes the whole grant.
func (st *storage) TokenRequestByRefreshToken(ctx context.Context, token string) (op.RefreshTokenRequest, error) {
	ev := eventFrom(ctx)
	g, err := st.s.store.RefreshGrant(ctx, token)
	if err != nil {
		return nil, st.refreshError(ctx, err, g)
	}
	ev.set(map[string]any{"client_id": g.ClientID, "grant_id": g.ID})
	p, ok := st.s.cfg.Principals.Principal(g.Principal)
	if !ok {
		// The static token behind the consent is gone: so is the grant.
		ev.set(map[string]any{"reason": "principal_removed"})
		if err := st.s.store.RevokeGrant(ctx, g.ID, "principal_removed"); err != nil {
			return nil, oidc.ErrServerError().WithParent(err)
		}
		return nil, oidc.ErrInvalidGrant().WithDescription("the principal of this grant no longer exists")
	}
	return &refreshRequest{grant: g, principal: p, scopes: g.Scopes}, nil
}

// refreshError maps store errors to OAuth errors and notes the reason.
func (st *storage) refreshError(ctx context.Context, err error, g ...Grant) error {
	ev := eventFrom(ctx)
	reason := ""
	switch {
	case errors.Is(err, ErrReused):
		reason = "refresh_token_reuse"
		ev.set(map[string]any{"grant_revoked": true})
		if len(g) > 0 {
			ev.set(map[string]any{"grant_id": g[0].ID, "client_id": g[0].ClientID})
		}
		st.s.log.Warn().Msg("oauth_refresh_token_reuse")
	case errors.Is(err, ErrNotFound):
		reason = "refresh_token_unknown"
	case errors.Is(err, ErrExpired):
		reason = "refresh_token_expired"
	case errors.Is(err, ErrRevoked):
		reason = "grant_revoked"
	default:
		return oidc.ErrServerError().WithParent(err)
	}
	ev.set(map[string]any{"reason": reason})
	return oidc.ErrInvalidGrant().WithDescription("the refresh token is invalid, expired, revoked or was already used")
}

func (st *storage) TerminateSession(context.Context, string, string) error { return nil }

// GetRefreshTokenInfo lets op revoke a refresh token: its "token ID" names
// the grant.
func (st *storage) GetRefreshTokenInfo(ctx context.Context, _ string, token string) (string, string, error) {
	g, err := st.s.store.RefreshTokenGrant(ctx, token)
	if err != nil {
		return "", "", op.ErrInvalidRefreshToken
	}
	return g.Principal, g.ID + ".refresh", nil
}

// RevokeToken revokes the grant behind an access token ID or refresh token
// ID (RFC 7009: both end the grant). Unknown tokens are not an error.
func (st *storage) RevokeToken(ctx context.Context, tokenOrID, _ string, clientID string) *oidc.Error {
	g, err := st.s.store.Grant(ctx, grantOf(tokenOrID))
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return oidc.ErrServerError().WithParent(err)
	}
	ev := eventFrom(ctx)
	if g.ClientID != clientID {
		ev.set(map[string]any{"reason": "other_client", "client_id": truncate(clientID, 64)})
		return oidc.ErrUnauthorizedClient().WithDescription("the token was not issued to this client")
	}
	if err := ev.begin(ctx, g.Principal, map[string]any{"client_id": g.ClientID, "grant_id": g.ID}); err != nil {
		return oidc.ErrServerError().WithParent(err)
	}
	if err := st.s.store.RevokeGrant(ctx, g.ID, "revoked_by_client"); err != nil {
		return oidc.ErrServerError().WithParent(err)
	}
	return nil
}

func (st *storage) SigningKey(context.Context) (op.SigningKey, error) { return st.s.keys.signer(), nil }

func (st *storage) SignatureAlgorithms(context.Context) ([]jose.SignatureAlgorithm, error) {
	return []jose.SignatureAlgorithm{signingAlg}, nil
}

func (st *storage) KeySet(context.Context) ([]op.Key, error) {
	var out []op.Key
	for _, k := range st.s.keys.public() {
		out = append(out, k)
	}
	return out, nil
}

// GetPrivateClaimsFromRequest adds the claims the resource server reads:
// the grant (sid), tier, admin flag and scope.
func (st *storage) GetPrivateClaimsFromRequest(_ context.Context, req op.TokenRequest, _ []string) (map[string]any, error) {
	tr, ok := req.(tokenRequest)
	if !ok {
		return nil, errors.New("oauth: unexpected token request")
	}
	grantID, p := tr.grantInfo()
	if grantID == "" {
		return nil, errors.New("oauth: access token without a grant")
	}
	claims := map[string]any{"sid": grantID, "tier": string(p.Tier), "scope": strings.Join(grantScopes(req.GetScopes()), " ")}
	if p.Admin {
		claims["admin"] = true
	}
	return claims, nil
}

// The rest of op.Storage serves endpoints this server does not mount
// (userinfo, introspection, JWT profile).
var errNotServed = errors.New("oauth: not served")

func (st *storage) SetUserinfoFromScopes(context.Context, *oidc.UserInfo, string, string, []string) error {
	return nil
}
func (st *storage) SetUserinfoFromToken(context.Context, *oidc.UserInfo, string, string, string) error {
	return errNotServed
}
func (st *storage) SetIntrospectionFromToken(context.Context, *oidc.IntrospectionResponse, string, string, string) error {
	return errNotServed
}
func (st *storage) GetPrivateClaimsFromScopes(context.Context, string, string, []string) (map[string]any, error) {
	return nil, errNotServed
}
func (st *storage) GetKeyByIDAndClientID(context.Context, string, string) (*jose.JSONWebKey, error) {
	return nil, errNotServed
}
func (st *storage) ValidateJWTProfileScopes(context.Context, string, []string) ([]string, error) {
	return nil, errNotServed
}
func (st *storage) Health(ctx context.Context) error {
	if err := st.s.store.Ping(ctx); err != nil {
		return fmt.Errorf("oauth store: %w", err)
	}
	return nil
}
