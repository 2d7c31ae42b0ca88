package oauth

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

func TestMetadata(t *testing.T) {
	f := newFixture(t)
	for _, path := range []string{PathASMetadata, PathOIDCMetadata} {
		resp, body := f.do(http.MethodGet, path, nil, "")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d", path, resp.StatusCode)
		}
		var m map[string]any
		if err := json.Unmarshal(body, &m); err != nil {
			t.Fatal(err)
		}
		if m["issuer"] != f.issuer || m["registration_endpoint"] != f.issuer+PathRegister || m["token_endpoint"] != f.issuer+PathToken {
			t.Errorf("%s: %v", path, m)
		}
		if got, _ := json.Marshal(m["code_challenge_methods_supported"]); string(got) != `["S256"]` {
			t.Errorf("%s: code_challenge_methods_supported %s", path, got)
		}
		if got, _ := json.Marshal(m["token_endpoint_auth_methods_supported"]); string(got) != `["none","client_secret_post","client_secret_basic"]` {
			t.Errorf("%s: auth methods %s", path, got)
		}
	}
	resp, body := f.do(http.MethodGet, PathJWKS, nil, "")
	var set struct {
		Keys []map[string]any `json:"keys"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &set) != nil || len(set.Keys) != 1 || set.Keys[0]["alg"] != "ES256" {
		t.Fatalf("jwks: %d %s", resp.StatusCode, body)
	}
	if _, private := set.Keys[0]["d"]; private {
		t.Fatal("the JWKS publishes a private key")
	}
}

// TestEmbeddedFlow is the whole grant: registration, consent (one wrong
// token first), code, token, a working access token, refresh, and reuse of
// a rotated refresh token revoking the family.
func TestEmbeddedFlow(t *testing.T) { eachStore(t, testEmbeddedFlow) }

func testEmbeddedFlow(t *testing.T, loc func(testing.TB) string) {
	f := newFixtureOn(t, loc(t))
	ctx := context.Background()
	c := f.registerPublic()
	if c.ClientSecret != "" || len(c.RedirectURIs) != 1 {
		t.Fatalf("public registration: %+v", c)
	}
	if r := f.lastRow("oauth.register"); r.Phase != audit.PhaseOutcome || r.Outcome != audit.OutcomeSuccess {
		t.Errorf("register row %+v", r)
	}

	resp, _ := f.authorize(f.authorizeParams(c.ClientID))
	page, err := url.Parse(resp.Header.Get("Location"))
	if err != nil {
		t.Fatal(err)
	}
	resp, body := f.do(http.MethodGet, page.RequestURI(), nil, "")
	csp := resp.Header.Get("Content-Security-Policy")
	if !strings.Contains(csp, "frame-ancestors 'none'") || resp.Header.Get("X-Frame-Options") != "DENY" {
		t.Errorf("consent page headers: CSP %q, XFO %q", csp, resp.Header.Get("X-Frame-Options"))
	}
	if !strings.Contains(string(body), "Test client") || !strings.Contains(string(body), "127.0.0.1:9") {
		t.Errorf("consent page does not name the client and its redirect host:\n%s", body)
	}

	form, cookie := f.consentForm(f.authorizeParams(c.ClientID))
	wrong := url.Values{"id": {form.Get("id")}, "csrf": {form.Get("csrf")}, "token": {"not-a-token-0123456789abcdef"}, "action": {"approve"}}
	resp, _ = f.postForm(PathConsent, wrong, "Cookie", cookie.Name+"="+cookie.Value)
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("wrong bearer token: %d", resp.StatusCode)
	}
	if r := f.lastRow("oauth.consent"); r.Outcome != audit.OutcomeDenied || r.ErrorCode != "access_denied" {
		t.Errorf("wrong-token row %+v", r)
	}
	q := f.approve(form, cookie, f.bearer)
	if q.Get("state") != "st-123" || q.Get("iss") != f.issuer || q.Get("code") == "" {
		t.Fatalf("authorization response %v", q)
	}
	if r := f.lastRow("oauth.consent"); r.Principal != "alice" || r.Outcome != audit.OutcomeSuccess {
		t.Errorf("approval row %+v", r)
	}

	status, tok := f.exchange(c.ClientID, q.Get("code"))
	if status != http.StatusOK || tok.AccessToken == "" || tok.RefreshToken == "" || !strings.EqualFold(tok.TokenType, "bearer") {
		t.Fatalf("exchange: %d %+v", status, tok)
	}
	if tok.IDToken != "" {
		t.Error("an id_token was issued without the openid scope")
	}
	p, err := f.verifier.Verify(ctx, tok.AccessToken)
	if err != nil || p.ID != "alice" || p.Tier != quota.TierPro || !p.Admin {
		t.Fatalf("access token: %+v %v", p, err)
	}
	if r := f.lastRow("oauth.token"); r.Principal != "alice" || r.Outcome != audit.OutcomeSuccess {
		t.Errorf("token row %+v", r)
	}

	status, next := f.refresh(c.ClientID, tok.RefreshToken)
	if status != http.StatusOK || next.RefreshToken == "" || next.RefreshToken == tok.RefreshToken {
		t.Fatalf("refresh: %d %+v", status, next)
	}
	if _, err := f.verifier.Verify(ctx, next.AccessToken); err != nil {
		t.Fatalf("refreshed access token: %v", err)
	}

	// Reuse of the rotated token: invalid_grant, and the family is gone.
	status, reused := f.refresh(c.ClientID, tok.RefreshToken)
	if status != http.StatusBadRequest || reused.Error != "invalid_grant" {
		t.Fatalf("reuse: %d %+v", status, reused)
	}
	r := f.lastRow("oauth.token")
	if r.Outcome != audit.OutcomeDenied || r.ErrorCode != "invalid_grant" || !strings.Contains(string(r.Params), "refresh_token_reuse") {
		t.Errorf("reuse row %+v %s", r, r.Params)
	}
	if status, _ := f.refresh(c.ClientID, next.RefreshToken); status != http.StatusBadRequest {
		t.Errorf("the newest refresh token of a revoked family still works: %d", status)
	}
	var te *TokenError
	if _, err := f.verifier.Verify(ctx, next.AccessToken); !errors.As(err, &te) || te.Reason != "revoked" {
		t.Errorf("access token of a revoked family: %v", err)
	}
	f.noSecrets(tok.AccessToken, tok.RefreshToken, next.AccessToken, next.RefreshToken, q.Get("code"), verifier, f.bearer)
}

// TestConfidentialClient registers with client_secret_post, as Claude's
// hosted connector does, and revokes at the end.
func TestConfidentialClient(t *testing.T) { eachStore(t, testConfidentialClient) }

func testConfidentialClient(t *testing.T, loc func(testing.TB) string) {
	f := newFixtureOn(t, loc(t))
	c := f.register(`{"client_name":"Claude","redirect_uris":["` + redirectURI + `"],"grant_types":["authorization_code","refresh_token"],"response_types":["code"],"token_endpoint_auth_method":"client_secret_post"}`)
	if !strings.HasPrefix(c.ClientSecret, "sbs_") {
		t.Fatalf("no secret: %+v", c)
	}
	code := f.code(c.ClientID)
	base := url.Values{"grant_type": {"authorization_code"}, "code": {code}, "redirect_uri": {redirectURI}, "client_id": {c.ClientID}, "code_verifier": {verifier}}
	wrong := cloneValues(base)
	wrong.Set("client_secret", "sbs_wrong")
	if status, tr := f.tokenReq(wrong); status != http.StatusUnauthorized || tr.Error != "invalid_client" {
		t.Fatalf("wrong secret: %d %+v", status, tr)
	}
	good := cloneValues(base)
	good.Set("client_secret", c.ClientSecret)
	status, tok := f.tokenReq(good)
	if status != http.StatusOK {
		t.Fatalf("exchange: %d %+v", status, tok)
	}
	// Revocation needs the client's own credentials and ends the grant.
	rv := url.Values{"token": {tok.RefreshToken}, "token_type_hint": {"refresh_token"}, "client_id": {c.ClientID}, "client_secret": {c.ClientSecret}}
	if resp, body := f.postForm(PathRevoke, rv); resp.StatusCode != http.StatusOK {
		t.Fatalf("revoke: %d %s", resp.StatusCode, body)
	}
	if r := f.lastRow("oauth.revoke"); r.Principal != "alice" || r.Outcome != audit.OutcomeSuccess {
		t.Errorf("revoke row %+v", r)
	}
	if _, err := f.verifier.Verify(context.Background(), tok.AccessToken); err == nil {
		t.Error("access token works after its grant was revoked")
	}
	f.noSecrets(c.ClientSecret, tok.AccessToken, tok.RefreshToken)
}

func cloneValues(v url.Values) url.Values {
	out := url.Values{}
	for k, vs := range v {
		out[k] = append([]string(nil), vs...)
	}
	return out
}

// TestDeny: the operator's refusal reaches the client as access_denied.
func TestDeny(t *testing.T) { eachStore(t, testDeny) }

func testDeny(t *testing.T, loc func(testing.TB) string) {
	f := newFixtureOn(t, loc(t))
	c := f.registerPublic()
	form, cookie := f.consentForm(f.authorizeParams(c.ClientID))
	form.Set("action", "deny")
	resp, _ := f.postForm(PathConsent, form, "Cookie", cookie.Name+"="+cookie.Value)
	u, _ := url.Parse(resp.Header.Get("Location"))
	if resp.StatusCode != http.StatusFound || u.Query().Get("error") != "access_denied" || u.Query().Get("state") != "st-123" {
		t.Fatalf("deny: %d %s", resp.StatusCode, resp.Header.Get("Location"))
	}
	if r := f.lastRow("oauth.consent"); r.Outcome != audit.OutcomeDenied || r.ErrorCode != "access_denied" {
		t.Errorf("deny row %+v", r)
	}
	if got := f.counts(); got.grants != 0 || got.pending != 0 {
		t.Errorf("state after deny: %+v", got)
	}
}

// TestConsentCSRF: the form is refused without its cookie, with another
// request's CSRF value, or from another origin.
func TestConsentCSRF(t *testing.T) {
	f := newFixture(t)
	c := f.registerPublic()
	form, cookie := f.consentForm(f.authorizeParams(c.ClientID))
	form.Set("token", f.bearer)
	form.Set("action", "approve")
	for name, header := range map[string][]string{
		"no cookie":    nil,
		"wrong cookie": {"Cookie", consentCookie + "=forged"},
		"cross origin": {"Cookie", cookie.Name + "=" + cookie.Value, "Origin", "https://evil.example"},
		"cross site":   {"Cookie", cookie.Name + "=" + cookie.Value, "Sec-Fetch-Site", "cross-site"},
	} {
		resp, _ := f.postForm(PathConsent, form, header...)
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s: %d", name, resp.StatusCode)
		}
	}
	if r := f.lastRow("oauth.consent"); r.ErrorCode != "invalid_request" || !strings.Contains(string(r.Params), "csrf") {
		t.Errorf("csrf row %+v", r)
	}
	// The request is still pending and approvable from its own page.
	if q := f.approve(form, cookie, f.bearer); q.Get("code") == "" {
		t.Error("no code after the refused attempts")
	}
}
