package oauth

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// fixture is a real embedded authorization server on a loopback listener,
// with a real audit log and state.db in a temp root.
type fixture struct {
	t        *testing.T
	root     string
	srv      *httptest.Server
	s        *Server
	verifier *Verifier
	issuer   string
	bearer   string // alice's static bearer token
	http     *http.Client
}

const aliceToken = "alice-static-token-0123456789abcdef"

func newFixture(t *testing.T) *fixture {
	t.Helper()
	return newFixtureOn(t, "")
}

// newFixtureOn is newFixture with the OAuth state in the store at loc
// ("" for state.db in the fixture's root).
func newFixtureOn(t *testing.T, loc string) *fixture {
	t.Helper()
	ctx := context.Background()
	root := t.TempDir()
	if loc == "" {
		loc = filepath.Join(root, "state.db")
	}
	akeys, err := audit.LoadKeys(audit.KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	alog, err := audit.Open(ctx, audit.Options{Path: filepath.Join(root, "audit.db"), CheckpointPath: filepath.Join(root, "audit.checkpoints"),
		Keys: akeys, CheckpointInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { alog.Close() })
	store, err := OpenStore(ctx, loc, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	keys, err := OpenKeys(filepath.Join(root, "keys"), 30*24*time.Hour, 15*time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := identity.NewRegistry([]identity.TokenEntry{
		{Principal: "alice", Tier: "pro", TokenSHA256: identity.HashToken(aliceToken), Admin: true},
		{Principal: "bob", Tier: "free", TokenSHA256: identity.HashToken("bob-static-token-0123456789abcdef")},
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(nil)
	issuer := "http://" + srv.Listener.Addr().String()
	s, err := NewServer(Config{Issuer: issuer, Resource: issuer + "/mcp", AccessTTL: 15 * time.Minute, RefreshTTL: 24 * time.Hour,
		Store: store, Keys: keys, Principals: reg, Audit: alog, Log: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	s.Mount(mux)
	srv.Config.Handler = mux
	srv.Start()
	t.Cleanup(srv.Close)
	return &fixture{t: t, root: root, srv: srv, s: s, issuer: issuer, bearer: aliceToken,
		verifier: NewEmbeddedVerifier(issuer, issuer+"/mcp", keys, store),
		http:     &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

func (f *fixture) do(method, path string, body io.Reader, contentType string, header ...string) (*http.Response, []byte) {
	f.t.Helper()
	req, err := http.NewRequest(method, f.issuer+path, body)
	if err != nil {
		f.t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := f.http.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		f.t.Fatal(err)
	}
	return resp, b
}

func (f *fixture) postForm(path string, v url.Values, header ...string) (*http.Response, []byte) {
	return f.do(http.MethodPost, path, strings.NewReader(v.Encode()), "application/x-www-form-urlencoded", header...)
}

type registered struct {
	ClientID     string   `json:"client_id"`
	ClientSecret string   `json:"client_secret"`
	RedirectURIs []string `json:"redirect_uris"`
}

const redirectURI = "http://127.0.0.1:9/callback"

func (f *fixture) register(meta string) registered {
	f.t.Helper()
	resp, body := f.do(http.MethodPost, PathRegister, strings.NewReader(meta), "application/json")
	if resp.StatusCode != http.StatusCreated {
		f.t.Fatalf("register: %d %s", resp.StatusCode, body)
	}
	var r registered
	if err := json.Unmarshal(body, &r); err != nil {
		f.t.Fatal(err)
	}
	return r
}

func (f *fixture) registerPublic() registered {
	return f.register(`{"client_name":"Test client","redirect_uris":["` + redirectURI + `"],"grant_types":["authorization_code","refresh_token"],"token_endpoint_auth_method":"none"}`)
}

func pkce(verifier string) string {
	h := sha256.Sum256([]byte(verifier))
	return base64.RawURLEncoding.EncodeToString(h[:])
}

const verifier = "a-code-verifier-that-is-long-enough-0123456789-abcdef"

func (f *fixture) authorizeParams(clientID string) url.Values {
	return url.Values{"client_id": {clientID}, "redirect_uri": {redirectURI}, "response_type": {"code"}, "state": {"st-123"},
		"code_challenge": {pkce(verifier)}, "code_challenge_method": {"S256"}, "resource": {f.issuer + "/mcp"}, "scope": {Scope}}
}

func (f *fixture) authorize(q url.Values) (*http.Response, []byte) {
	return f.do(http.MethodGet, PathAuthorize+"?"+q.Encode(), nil, "")
}

var hiddenInput = regexp.MustCompile(`name="(id|csrf)" value="([^"]+)"`)

// consentForm follows /authorize to the consent page and returns the
// form's fields and the CSRF cookie, as a browser would hold them.
func (f *fixture) consentForm(q url.Values) (url.Values, *http.Cookie) {
	f.t.Helper()
	resp, body := f.authorize(q)
	if resp.StatusCode != http.StatusFound {
		f.t.Fatalf("authorize: %d %s", resp.StatusCode, body)
	}
	loc := resp.Header.Get("Location")
	u, err := url.Parse(loc)
	if err != nil || u.Path != PathConsent {
		f.t.Fatalf("authorize redirected to %q", loc)
	}
	resp, body = f.do(http.MethodGet, u.RequestURI(), nil, "")
	if resp.StatusCode != http.StatusOK {
		f.t.Fatalf("consent page: %d %s", resp.StatusCode, body)
	}
	form := url.Values{}
	for _, m := range hiddenInput.FindAllStringSubmatch(string(body), -1) {
		form.Set(m[1], m[2])
	}
	var cookie *http.Cookie
	for _, c := range resp.Cookies() {
		if c.Name == consentCookie {
			cookie = c
		}
	}
	if form.Get("id") == "" || form.Get("csrf") == "" || cookie == nil {
		f.t.Fatalf("consent page lacks the form fields or cookie: %s", body)
	}
	return form, cookie
}

// approve submits the consent form with a bearer token and returns the
// authorization response's query.
func (f *fixture) approve(form url.Values, cookie *http.Cookie, token string) url.Values {
	f.t.Helper()
	form.Set("token", token)
	form.Set("action", "approve")
	resp, body := f.postForm(PathConsent, form, "Cookie", cookie.Name+"="+cookie.Value)
	if resp.StatusCode != http.StatusSeeOther {
		f.t.Fatalf("approve: %d %s", resp.StatusCode, body)
	}
	u, err := url.Parse(resp.Header.Get("Location"))
	if err != nil || !strings.HasPrefix(u.String(), redirectURI) {
		f.t.Fatalf("approve redirected to %q", resp.Header.Get("Location"))
	}
	return u.Query()
}

// code runs authorize and consent for client and returns a fresh code.
func (f *fixture) code(clientID string) string {
	form, cookie := f.consentForm(f.authorizeParams(clientID))
	q := f.approve(form, cookie, f.bearer)
	if q.Get("code") == "" {
		f.t.Fatalf("no code in %v", q)
	}
	return q.Get("code")
}

type tokenResponse struct {
	AccessToken  string `json:"access_token"`
	RefreshToken string `json:"refresh_token"`
	TokenType    string `json:"token_type"`
	ExpiresIn    int    `json:"expires_in"`
	IDToken      string `json:"id_token"`
	Scope        string `json:"scope"`
	Error        string `json:"error"`
}

func (f *fixture) tokenReq(v url.Values, header ...string) (int, tokenResponse) {
	f.t.Helper()
	resp, body := f.postForm(PathToken, v, header...)
	var tr tokenResponse
	if err := json.Unmarshal(body, &tr); err != nil {
		f.t.Fatalf("token response %d is not JSON: %s", resp.StatusCode, body)
	}
	return resp.StatusCode, tr
}

func (f *fixture) exchange(clientID, code string) (int, tokenResponse) {
	return f.tokenReq(url.Values{"grant_type": {"authorization_code"}, "code": {code}, "redirect_uri": {redirectURI},
		"client_id": {clientID}, "code_verifier": {verifier}, "resource": {f.issuer + "/mcp"}})
}

func (f *fixture) refresh(clientID, rt string) (int, tokenResponse) {
	return f.tokenReq(url.Values{"grant_type": {"refresh_token"}, "refresh_token": {rt}, "client_id": {clientID},
		"resource": {f.issuer + "/mcp"}})
}

// auditRows reads the audit log.
func (f *fixture) auditRows() []audit.Entry {
	f.t.Helper()
	var buf bytes.Buffer
	if err := audit.Export(context.Background(), filepath.Join(f.root, "audit.db"), "jsonl", &buf); err != nil {
		f.t.Fatal(err)
	}
	var out []audit.Entry
	dec := json.NewDecoder(&buf)
	for dec.More() {
		var e audit.Entry
		if err := dec.Decode(&e); err != nil {
			f.t.Fatal(err)
		}
		out = append(out, e)
	}
	return out
}

// lastRow returns the newest row of tool, failing when there is none.
func (f *fixture) lastRow(tool string) audit.Entry {
	f.t.Helper()
	rows := f.auditRows()
	for i := len(rows) - 1; i >= 0; i-- {
		if rows[i].Tool == tool {
			return rows[i]
		}
	}
	f.t.Fatalf("no audit row for %s", tool)
	return audit.Entry{}
}

// counts is the persistent and pending OAuth state, for "no state change".
type counts struct{ clients, grants, refresh, liveGrants, pending int }

func (f *fixture) counts() counts {
	f.t.Helper()
	var c counts
	db := f.s.store.db
	for q, dst := range map[string]*int{
		"SELECT count(*) FROM oauth_clients":                     &c.clients,
		"SELECT count(*) FROM oauth_grants":                      &c.grants,
		"SELECT count(*) FROM oauth_refresh_tokens":              &c.refresh,
		"SELECT count(*) FROM oauth_grants WHERE revoked_at = 0": &c.liveGrants,
	} {
		if err := db.QueryRow(q).Scan(dst); err != nil {
			f.t.Fatal(err)
		}
	}
	f.s.requests.mu.Lock()
	c.pending = len(f.s.requests.byID)
	f.s.requests.mu.Unlock()
	return c
}

// noSecrets fails if a row holds any of the given secrets.
func (f *fixture) noSecrets(secrets ...string) {
	f.t.Helper()
	for _, r := range f.auditRows() {
		raw, _ := json.Marshal(r)
		for _, s := range secrets {
			if s != "" && strings.Contains(string(raw), s) {
				f.t.Fatalf("audit row %d (%s) holds a secret", r.Seq, r.Tool)
			}
		}
	}
}
