package oauth

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/lestrrat-go/jwx/v3/jwa"
	"github.com/lestrrat-go/jwx/v3/jws"

	"github.com/sandbox-broker/sandbox-broker/audit"
)

// TestBadInput is the list: each bad input gets its precise OAuth
// error, an audit row, and no state change (beyond the revocation a replay
// or reuse is answered with, which the spec requires).
func TestBadInput(t *testing.T) {
	t.Run("wrong redirect URI", func(t *testing.T) {
		f := newFixture(t)
		c := f.registerPublic()
		before := f.counts()
		for _, uri := range []string{"http://127.0.0.1:9/other", redirectURI + "/", redirectURI + "?x=1", "https://evil.example/callback", ""} {
			q := f.authorizeParams(c.ClientID)
			q.Set("redirect_uri", uri)
			resp, body := f.authorize(q)
			if resp.StatusCode != http.StatusBadRequest || resp.Header.Get("Location") != "" || oauthCode(body) != "invalid_request" {
				t.Errorf("%q: %d %q %s", uri, resp.StatusCode, resp.Header.Get("Location"), body)
			}
		}
		r := f.lastRow("oauth.authorize")
		if r.Outcome != audit.OutcomeDenied || r.ErrorCode != "invalid_request" || !strings.Contains(string(r.Params), "redirect_uri_not_registered") {
			t.Errorf("row %+v %s", r, r.Params)
		}
		if after := f.counts(); after != before {
			t.Errorf("state changed: %+v → %+v", before, after)
		}
	})

	t.Run("missing or plain PKCE", func(t *testing.T) {
		f := newFixture(t)
		c := f.registerPublic()
		before := f.counts()
		for name, edit := range map[string]func(url.Values){
			"missing":        func(q url.Values) { q.Del("code_challenge"); q.Del("code_challenge_method") },
			"plain":          func(q url.Values) { q.Set("code_challenge_method", "plain"); q.Set("code_challenge", verifier) },
			"method omitted": func(q url.Values) { q.Del("code_challenge_method") },
		} {
			q := f.authorizeParams(c.ClientID)
			edit(q)
			resp, body := f.authorize(q)
			u, _ := url.Parse(resp.Header.Get("Location"))
			if resp.StatusCode != http.StatusFound || u == nil || !strings.HasPrefix(u.String(), redirectURI) ||
				u.Query().Get("error") != "invalid_request" || u.Query().Get("state") != "st-123" {
				t.Errorf("%s: %d %q %s", name, resp.StatusCode, resp.Header.Get("Location"), body)
			}
			r := f.lastRow("oauth.authorize")
			if r.ErrorCode != "invalid_request" || !strings.Contains(string(r.Params), "pkce") {
				t.Errorf("%s: row %+v %s", name, r, r.Params)
			}
		}
		if after := f.counts(); after != before {
			t.Errorf("state changed: %+v → %+v", before, after)
		}
	})

	t.Run("replayed authorization code", func(t *testing.T) {
		f := newFixture(t)
		c := f.registerPublic()
		code := f.code(c.ClientID)
		status, first := f.exchange(c.ClientID, code)
		if status != http.StatusOK {
			t.Fatalf("first exchange: %d", status)
		}
		before := f.counts()
		status, second := f.exchange(c.ClientID, code)
		if status != http.StatusBadRequest || second.Error != "invalid_grant" || second.AccessToken != "" {
			t.Fatalf("replay: %d %+v", status, second)
		}
		r := f.lastRow("oauth.token")
		if r.Outcome != audit.OutcomeDenied || r.ErrorCode != "invalid_grant" || !strings.Contains(string(r.Params), "authorization_code_replay") {
			t.Errorf("row %+v %s", r, r.Params)
		}
		after := f.counts()
		if after.grants != before.grants || after.clients != before.clients || after.liveGrants != before.liveGrants-1 {
			t.Errorf("state: %+v → %+v (want only the first exchange's grant revoked)", before, after)
		}
		if _, err := f.verifier.Verify(context.Background(), first.AccessToken); err == nil {
			t.Error("tokens of a replayed code still work")
		}
	})

	t.Run("reused refresh token", func(t *testing.T) {
		f := newFixture(t)
		c := f.registerPublic()
		_, tok := f.exchange(c.ClientID, f.code(c.ClientID))
		if status, _ := f.refresh(c.ClientID, tok.RefreshToken); status != http.StatusOK {
			t.Fatal("first refresh failed")
		}
		before := f.counts()
		status, tr := f.refresh(c.ClientID, tok.RefreshToken)
		if status != http.StatusBadRequest || tr.Error != "invalid_grant" || tr.AccessToken != "" {
			t.Fatalf("reuse: %d %+v", status, tr)
		}
		if r := f.lastRow("oauth.token"); r.ErrorCode != "invalid_grant" || !strings.Contains(string(r.Params), "refresh_token_reuse") {
			t.Errorf("row %+v %s", r, r.Params)
		}
		after := f.counts()
		if after.grants != before.grants || after.liveGrants != before.liveGrants-1 || after.refresh >= before.refresh {
			t.Errorf("state: %+v → %+v (want the family revoked, nothing new)", before, after)
		}
	})

	t.Run("oversized registration", func(t *testing.T) {
		f := newFixture(t)
		before := f.counts()
		big := `{"redirect_uris":["` + redirectURI + `"],"client_name":"x","software_statement":"` + strings.Repeat("a", MaxRegistrationBytes) + `"}`
		resp, body := f.do(http.MethodPost, PathRegister, strings.NewReader(big), "application/json")
		if resp.StatusCode != http.StatusBadRequest || oauthCode(body) != "invalid_client_metadata" {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if r := f.lastRow("oauth.register"); r.Outcome != audit.OutcomeDenied || r.ErrorCode != "invalid_client_metadata" {
			t.Errorf("row %+v", r)
		}
		if after := f.counts(); after != before {
			t.Errorf("state changed: %+v → %+v", before, after)
		}
	})

	t.Run("bad registrations", func(t *testing.T) {
		f := newFixture(t)
		for body, want := range map[string]string{
			`{"redirect_uris":["http://evil.example/cb"]}`:                                  "invalid_redirect_uri",
			`{"redirect_uris":["https://a.example/cb#frag"]}`:                               "invalid_redirect_uri",
			`{"redirect_uris":["javascript:alert(1)"],"token_endpoint_auth_method":"none"}`: "invalid_redirect_uri",
			`{"redirect_uris":[]}`: "invalid_redirect_uri",
			`{"redirect_uris":["https://a.example/cb"],"grant_types":["implicit"]}`:                     "invalid_client_metadata",
			`{"redirect_uris":["https://a.example/cb"],"grant_types":["password"]}`:                     "invalid_client_metadata",
			`{"redirect_uris":["https://a.example/cb"],"response_types":["token"]}`:                     "invalid_client_metadata",
			`{"redirect_uris":["https://a.example/cb"],"token_endpoint_auth_method":"private_key_jwt"}`: "invalid_client_metadata",
			`{"redirect_uris":["https://a.example/cb"],"client_name":"a\u202eb"}`:                       "invalid_client_metadata",
			`[]`:   "invalid_client_metadata",
			`null`: "invalid_client_metadata",
			`{"redirect_uris":["https://a.example/cb"]} {}`: "invalid_client_metadata",
		} {
			resp, got := f.do(http.MethodPost, PathRegister, strings.NewReader(body), "application/json")
			if resp.StatusCode != http.StatusBadRequest || oauthCode(got) != want {
				t.Errorf("%s: %d %s, want %s", body, resp.StatusCode, got, want)
			}
		}
		if got := f.counts(); got.clients != 0 {
			t.Errorf("%d clients stored from bad registrations", got.clients)
		}
	})

	t.Run("tokens the resource must refuse", func(t *testing.T) {
		f := newFixture(t)
		c := f.registerPublic()
		_, tok := f.exchange(c.ClientID, f.code(c.ClientID))
		claims := claimsOf(t, tok.AccessToken)
		now := time.Now().Unix()
		signer := f.s.keys.signer()
		pubDER, _ := x509.MarshalPKIXPublicKey(&signer.priv.PublicKey)
		pubPEM := pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER})
		jwksJSON, _ := json.Marshal(f.s.keys.JWKS())
		cases := map[string]struct {
			token  string
			reason string
		}{
			"another audience":              {mintES256(t, f, with(claims, "aud", []string{"https://other.example/mcp"})), "audience"},
			"expired":                       {mintES256(t, f, with(with(claims, "exp", now-3600), "iat", now-7200)), "expired"},
			"alg none":                      {unsigned(t, claims), "algorithm"},
			"HS256 with the public key PEM": {mintHS256(t, claims, signer.id, pubPEM), "algorithm"},
			"HS256 with the JWKS":           {mintHS256(t, claims, signer.id, jwksJSON), "algorithm"},
			"another issuer":                {mintES256(t, f, with(claims, "iss", "https://evil.example")), "issuer"},
			"no exp":                        {mintES256(t, f, without(claims, "exp")), "missing_claim"},
			"tampered payload":              {tamper(tok.AccessToken, with(claims, "sub", "bob")), "signature"},
			"ID-token shape (no grant)":     {mintES256(t, f, without(claims, "sid")), "grant"},
			"unknown grant":                 {mintES256(t, f, with(claims, "sid", "sbg_unknown")), "revoked"},
			"oversized":                     {strings.Repeat("a", MaxTokenBytes) + ".b.c", "malformed"},
		}
		before := f.counts()
		for name, tc := range cases {
			_, err := f.verifier.Verify(context.Background(), tc.token)
			var te *TokenError
			if !errors.As(err, &te) || te.Reason != tc.reason {
				t.Errorf("%s: %v, want reason %s", name, err, tc.reason)
			}
		}
		if after := f.counts(); after != before {
			t.Errorf("state changed: %+v → %+v", before, after)
		}
		// The genuine token still verifies: the cases above were refused
		// for what they changed, not for something the fixture broke.
		if _, err := f.verifier.Verify(context.Background(), tok.AccessToken); err != nil {
			t.Fatalf("genuine token: %v", err)
		}
	})
}

func oauthCode(body []byte) string {
	var e struct {
		Error string `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	return e.Error
}

func claimsOf(t *testing.T, token string) map[string]any {
	t.Helper()
	parts := strings.Split(token, ".")
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func with(m map[string]any, k string, v any) map[string]any {
	out := map[string]any{}
	for kk, vv := range m {
		out[kk] = vv
	}
	out[k] = v
	return out
}

func without(m map[string]any, k string) map[string]any {
	out := with(m, k, nil)
	delete(out, k)
	return out
}

// mintES256 signs claims with the server's real key: only the claims differ
// from a genuine token.
func mintES256(t *testing.T, f *fixture, claims map[string]any) string {
	t.Helper()
	k := f.s.keys.signer()
	payload, _ := json.Marshal(claims)
	hdr := jws.NewHeaders()
	_ = hdr.Set(jws.KeyIDKey, k.id)
	out, err := jws.Sign(payload, jws.WithKey(jwa.ES256(), k.priv, jws.WithProtectedHeaders(hdr)))
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// mintHS256 is the algorithm-confusion attack: HMAC keyed with public key
// material the attacker can read.
func mintHS256(t *testing.T, claims map[string]any, kid string, secret []byte) string {
	t.Helper()
	payload, _ := json.Marshal(claims)
	hdr := jws.NewHeaders()
	_ = hdr.Set(jws.KeyIDKey, kid)
	out, err := jws.Sign(payload, jws.WithKey(jwa.HS256(), secret, jws.WithProtectedHeaders(hdr)))
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func unsigned(t *testing.T, claims map[string]any) string {
	t.Helper()
	payload, _ := json.Marshal(claims)
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"none","typ":"JWT"}`)) + "." + enc(payload) + "."
}

// tamper swaps a genuine token's payload and keeps its signature.
func tamper(token string, claims map[string]any) string {
	parts := strings.Split(token, ".")
	payload, _ := json.Marshal(claims)
	return parts[0] + "." + base64.RawURLEncoding.EncodeToString(payload) + "." + parts[2]
}
