package tests

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/zitadel/oidc/v3/example/server/exampleop"
	"github.com/zitadel/oidc/v3/example/server/storage"
	"github.com/zitadel/oidc/v3/pkg/op"
)

// jwtAccessTokens makes the example OP issue JWT access tokens, as the
// identity providers operators run do (Keycloak, Auth0, Entra ID); its
// pre-made clients issue opaque ones.
type jwtAccessTokens struct{ *storage.Storage }

func (s jwtAccessTokens) GetClientByClientID(ctx context.Context, id string) (op.Client, error) {
	c, err := s.Storage.GetClientByClientID(ctx, id)
	if err != nil {
		return nil, err
	}
	return jwtClient{c}, nil
}

type jwtClient struct{ op.Client }

func (jwtClient) AccessTokenType() op.AccessTokenType { return op.AccessTokenTypeJWT }

// startExampleOP runs zitadel/oidc's example OpenID provider (from the Go
// module, unchanged but for JWT access tokens) on a loopback port.
func startExampleOP(t *testing.T, redirectURI string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	issuer := "http://" + ln.Addr().String() + "/"
	slog.SetDefault(slog.New(slog.NewTextHandler(io.Discard, nil))) // the example logs every request
	storage.RegisterClients(storage.WebClient("web", "secret", redirectURI))
	router := exampleop.SetupServer(issuer, jwtAccessTokens{storage.NewStorage(storage.NewUserStore(issuer))}, nil, false)
	srv := &httptest.Server{Listener: ln, Config: &http.Server{Handler: router}}
	srv.Start()
	t.Cleanup(srv.Close)
	return issuer
}

// externalToken signs in to the OP as username with the code flow, then
// exchanges (RFC 8693) the access token for one whose audience is audience,
// as an IdP's API audience setting would issue. The example OP's
// impersonation scope (custom_scope:impersonate:<id>) makes another subject.
func externalToken(t *testing.T, issuer, redirectURI, username, audience, scope string) (access, idToken string) {
	t.Helper()
	q := url.Values{"client_id": {"web"}, "redirect_uri": {redirectURI}, "response_type": {"code"}, "scope": {"openid"}, "state": {"s"}}
	resp, body := httpDo(t, "GET", issuer+"auth?"+q.Encode(), nil)
	login, err := url.Parse(resp.Header.Get("Location"))
	if resp.StatusCode != http.StatusFound || err != nil {
		t.Fatalf("authorize at the OP: %d %s", resp.StatusCode, body)
	}
	base, _ := url.Parse(issuer)
	login = base.ResolveReference(login)
	form := url.Values{"id": {login.Query().Get("authRequestID")}, "username": {username}, "password": {"verysecure"}}
	resp, body = httpDo(t, "POST", base.ResolveReference(&url.URL{Path: "/login/username"}).String(), strings.NewReader(form.Encode()),
		"Content-Type", "application/x-www-form-urlencoded")
	if resp.StatusCode != http.StatusFound {
		t.Fatalf("login at the OP: %d %s", resp.StatusCode, body)
	}
	callback, _ := url.Parse(resp.Header.Get("Location"))
	resp, body = httpDo(t, "GET", base.ResolveReference(callback).String(), nil)
	back, _ := url.Parse(resp.Header.Get("Location"))
	if resp.StatusCode != http.StatusFound || back == nil || back.Query().Get("code") == "" {
		t.Fatalf("OP callback: %d %s %s", resp.StatusCode, resp.Header.Get("Location"), body)
	}
	token := func(v url.Values) map[string]any {
		req, _ := http.NewRequest("POST", issuer+"oauth/token", strings.NewReader(v.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.SetBasicAuth("web", "secret")
		resp, err := noRedirect.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("OP token endpoint: %d %v %v", resp.StatusCode, out, err)
		}
		return out
	}
	first := token(url.Values{"grant_type": {"authorization_code"}, "code": {back.Query().Get("code")}, "redirect_uri": {redirectURI}})
	exchanged := token(url.Values{"grant_type": {"urn:ietf:params:oauth:grant-type:token-exchange"},
		"subject_token": {first["access_token"].(string)}, "subject_token_type": {"urn:ietf:params:oauth:token-type:access_token"},
		"requested_token_type": {"urn:ietf:params:oauth:token-type:access_token"}, "audience": {audience}, "scope": {scope}})
	return exchanged["access_token"].(string), first["id_token"].(string)
}

// TestOAuthExternalIssuer: with OAUTH_MODE=external the broker is only a
// resource server for a real OpenID provider started here. Its JWKS is
// discovered from the issuer, the audience is checked, the subject claim is
// the principal and OAUTH_TIERS_FILE its tier; a subject with no tier and
// a token for another audience are refused.
func TestOAuthExternalIssuer(t *testing.T) {
	const cb = "http://127.0.0.1:9/cb"
	issuer := startExampleOP(t, cb)
	tiers := filepath.Join(t.TempDir(), "tiers.json")
	if err := os.WriteFile(tiers, []byte(`{"id1":"pro"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	resource := "http://" + addr + "/mcp"
	b := StartHTTP(t, BrokerOpts{Token: "static-token-" + strings.Repeat("s", 24), Args: []string{"--addr", addr}, Env: map[string]string{
		"SANDBOX_BACKEND": "none", "PUBLIC_BASE_URL": "http://" + addr, "OAUTH_MODE": "external", "OAUTH_ISSUER": issuer,
		"OAUTH_TIERS_FILE": tiers, "OAUTH_DEFAULT_TIER": "none",
	}})

	resp, body := httpDo(t, "GET", b.URL+"/.well-known/oauth-protected-resource/mcp", nil)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"authorization_servers":["`+issuer+`"]`) {
		t.Fatalf("PRM: %d %s", resp.StatusCode, body)
	}
	if resp, _ := httpDo(t, "GET", b.URL+"/.well-known/oauth-authorization-server", nil); resp.StatusCode != http.StatusNotFound {
		t.Errorf("external mode serves its own AS metadata: %d", resp.StatusCode)
	}

	host, _, _ := net.SplitHostPort(strings.TrimSuffix(strings.TrimPrefix(issuer, "http://"), "/"))
	user := "test-user@" + host
	access, idToken := externalToken(t, issuer, cb, user, resource, "openid")
	if aud := jwtClaims(t, access)["aud"]; !strings.Contains(toJSON(aud), resource) {
		t.Fatalf("exchanged token audience %v", aud)
	}
	var usage struct {
		Principal string `json:"principal"`
		Tier      string `json:"tier"`
	}
	resultJSON(t, callTool(t, mcpClient(t, b, access), "get_usage", map[string]any{}), &usage)
	if usage.Principal != "id1" || usage.Tier != "pro" {
		t.Fatalf("external principal: %+v", usage)
	}

	init := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`
	refused := func(name, token string) {
		resp, body := httpDo(t, "POST", b.URL+"/mcp", strings.NewReader(init), "Content-Type", "application/json",
			"Accept", "application/json, text/event-stream", "Authorization", "Bearer "+token)
		if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(resp.Header.Get("WWW-Authenticate"), `error="invalid_token"`) {
			t.Errorf("%s: %d %q %s", name, resp.StatusCode, resp.Header.Get("WWW-Authenticate"), body)
		}
	}
	refused("the OP's ID token (audience web)", idToken)
	other, _ := externalToken(t, issuer, cb, user, "https://other.example/mcp", "openid")
	refused("a token for another audience", other)
	unmapped, _ := externalToken(t, issuer, cb, user, resource, "openid custom_scope:impersonate:id2")
	if sub := jwtClaims(t, unmapped)["sub"]; sub != "id2" {
		t.Fatalf("impersonated subject %v", sub)
	}
	refused("a subject with no tier", unmapped)
	reasons := map[string]bool{}
	for _, r := range auditEntries(t, b.Root) {
		if r.Tool == "oauth.bearer" {
			var p struct{ Reason string }
			_ = json.Unmarshal(r.Params, &p)
			reasons[p.Reason] = true
		}
	}
	if !reasons["audience"] || !reasons["no_tier"] {
		t.Errorf("refusal reasons audited: %v", reasons)
	}
}

func toJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
