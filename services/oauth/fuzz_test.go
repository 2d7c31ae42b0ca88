package oauth

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/config"
)

// FuzzParseRegistration: any body either fails with a registration error
// code or yields metadata that obeys every rule the parser promises.
func FuzzParseRegistration(f *testing.F) {
	for _, seed := range []string{
		`{"client_name":"Claude","redirect_uris":["https://claude.ai/api/mcp/auth_callback"],"grant_types":["authorization_code","refresh_token"],"response_types":["code"],"token_endpoint_auth_method":"client_secret_post"}`,
		`{"redirect_uris":["http://127.0.0.1:33418/cb","http://localhost/cb"],"token_endpoint_auth_method":"none","scope":"sandbox other"}`,
		`{"redirect_uris":["cursor://anysphere.cursor-mcp/oauth/callback"],"token_endpoint_auth_method":"none"}`,
		`{"redirect_uris":["https://chatgpt.com/connector_platform_oauth_redirect"],"scope":""}`,
		`{"redirect_uris":["javascript:alert(1)"]}`, `{"redirect_uris":"https://a"}`, `[]`, `null`, `{}`, ``, `{"a":1}{}`,
	} {
		f.Add([]byte(seed))
	}
	scopes := []string{Scope}
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := ParseRegistration(body, scopes)
		if err != nil {
			if err.Code != "invalid_client_metadata" && err.Code != "invalid_redirect_uri" {
				t.Fatalf("error code %q", err.Code)
			}
			return
		}
		if len(r.RedirectURIs) == 0 || len(r.RedirectURIs) > maxRedirectURIs {
			t.Fatalf("%d redirect URIs", len(r.RedirectURIs))
		}
		for _, u := range r.RedirectURIs {
			if e := checkRedirectURI(u, r.TokenEndpointAuthMethod == AuthNone); e != nil {
				t.Fatalf("accepted redirect %q fails its own check: %v", u, e)
			}
			if pu, err := url.Parse(u); err != nil || strings.EqualFold(pu.Scheme, "http") && !config.IsLoopbackHost(pu.Hostname()) {
				t.Fatalf("non-loopback http redirect %q", u)
			}
		}
		if !containsExact(r.GrantTypes, "authorization_code") {
			t.Fatalf("grant types %v", r.GrantTypes)
		}
		for _, g := range r.GrantTypes {
			if g != "authorization_code" && g != "refresh_token" {
				t.Fatalf("grant type %q", g)
			}
		}
		switch r.TokenEndpointAuthMethod {
		case AuthNone, AuthSecretPost, AuthSecretBasic:
		default:
			t.Fatalf("auth method %q", r.TokenEndpointAuthMethod)
		}
		if r.Scope != Scope {
			t.Fatalf("scope %q", r.Scope)
		}
		if !utf8.ValidString(r.ClientName) || utf8.RuneCountInString(r.ClientName) > maxClientNameRunes {
			t.Fatalf("client name %q", r.ClientName)
		}
	})
}

// FuzzVerify: no input makes the verifier panic or accept anything but the
// genuine token it was seeded with.
func FuzzVerify(f *testing.F) {
	dir := f.TempDir()
	ctx := context.Background()
	store, err := OpenStore(ctx, filepath.Join(dir, "state.db"), nil)
	if err != nil {
		f.Fatal(err)
	}
	defer store.Close()
	keys, err := OpenKeys(filepath.Join(dir, "keys"), time.Hour, time.Hour, nil)
	if err != nil {
		f.Fatal(err)
	}
	v := NewEmbeddedVerifier("http://127.0.0.1:1", "http://127.0.0.1:1/mcp", keys, store)
	for _, seed := range []string{
		"", "a.b.c", "eyJhbGciOiJub25lIn0.e30.", "eyJhbGciOiJIUzI1NiJ9.e30.sig", strings.Repeat(".", 3),
		"eyJhbGciOiJFUzI1NiIsImtpZCI6IngifQ.eyJzdWIiOiJhIn0.AAAA",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		p, err := v.Verify(ctx, raw)
		if err == nil {
			t.Fatalf("accepted %q as %+v", raw, p)
		}
	})
}

// TestKeysRotate: rotation keeps old tokens verifiable until the retain
// period is over, files are private and survive a reload.
func TestKeysRotate(t *testing.T) {
	dir := t.TempDir()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	k, err := OpenKeys(dir, 24*time.Hour, time.Hour, clock)
	if err != nil {
		t.Fatal(err)
	}
	first := k.signer().id
	now = now.Add(25 * time.Hour)
	if err := k.Maintain(); err != nil {
		t.Fatal(err)
	}
	if k.signer().id == first || len(k.public()) != 2 {
		t.Fatalf("no rotation: signer %s, %d keys", k.signer().id, len(k.public()))
	}
	again, err := OpenKeys(dir, 24*time.Hour, time.Hour, clock)
	if err != nil || again.signer().id != k.signer().id || len(again.public()) != 2 {
		t.Fatalf("reload: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if fi, _ := e.Info(); fi.Mode().Perm() != 0o600 {
			t.Errorf("%s mode %v", e.Name(), fi.Mode().Perm())
		}
	}
	now = now.Add(2 * time.Hour) // the replaced key's tokens have expired
	if err := k.Maintain(); err != nil {
		t.Fatal(err)
	}
	if len(k.public()) != 1 || k.public()[0].ID() == first {
		t.Fatalf("the replaced key was not dropped: %d keys", len(k.public()))
	}
	if set, _ := k.set(); set.Len() != 1 {
		t.Fatalf("verifier key set has %d keys", set.Len())
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Fatalf("%d key files left", len(entries))
	}
}
