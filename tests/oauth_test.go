package tests

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/lestrrat-go/jwx/v3/jwa"
	"github.com/lestrrat-go/jwx/v3/jws"
	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/client/transport"

	"github.com/sandbox-broker/sandbox-broker/audit"
)

// freeAddr reserves a loopback port for a broker whose PUBLIC_BASE_URL
// must be known before it starts (the OAuth issuer and resource).
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// writeTokensFile writes MCP_TOKENS_FILE for principal → token (tier pro).
func writeTokensFile(t testing.TB, tokens map[string]string) string {
	t.Helper()
	var entries []map[string]string
	for p, tok := range tokens {
		sum := sha256.Sum256([]byte(tok))
		entries = append(entries, map[string]string{"principal": p, "tier": "pro", "token_sha256": hex.EncodeToString(sum[:])})
	}
	raw, _ := json.Marshal(entries)
	path := filepath.Join(t.TempDir(), "tokens.json")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// startOAuthBroker starts a broker with the embedded authorization server
// on a fixed loopback port.
func startOAuthBroker(t testing.TB, operatorToken string, extra map[string]string) *Broker {
	t.Helper()
	addr := freeAddr(t)
	env := map[string]string{
		"MCP_TOKENS_FILE": writeTokensFile(t, map[string]string{"operator": operatorToken, "other": operatorToken + "-other"}),
		"PUBLIC_BASE_URL": "http://" + addr,
		"OAUTH_MODE":      "embedded",
	}
	for k, v := range extra {
		env[k] = v
	}
	return StartHTTP(t, BrokerOpts{Env: env, Args: []string{"--addr", addr}})
}

// noRedirect is an HTTP client that shows redirects instead of following.
var noRedirect = &http.Client{Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

func httpDo(t testing.TB, method, u string, body io.Reader, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := noRedirect.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

var formField = regexp.MustCompile(`name="(id|csrf)" value="([^"]+)"`)

// embeddedGrant runs the whole embedded flow over HTTP as a client and an
// operator would: register, authorize, consent with operatorToken, token.
func embeddedGrant(t testing.TB, b *Broker, operatorToken string) (access, refresh string) {
	t.Helper()
	const cb = "http://127.0.0.1:9/cb"
	resp, body := httpDo(t, "POST", b.URL+"/oauth/register",
		strings.NewReader(`{"client_name":"Go test","redirect_uris":["`+cb+`"],"grant_types":["authorization_code","refresh_token"],"token_endpoint_auth_method":"none"}`),
		"Content-Type", "application/json")
	var reg struct {
		ClientID string `json:"client_id"`
	}
	if resp.StatusCode != http.StatusCreated || json.Unmarshal(body, &reg) != nil {
		t.Fatalf("register: %d %s", resp.StatusCode, body)
	}
	verifier := strings.Repeat("v", 50)
	sum := sha256.Sum256([]byte(verifier))
	q := url.Values{"client_id": {reg.ClientID}, "redirect_uri": {cb}, "response_type": {"code"}, "state": {"s"},
		"code_challenge": {base64.RawURLEncoding.EncodeToString(sum[:])}, "code_challenge_method": {"S256"}, "resource": {b.URL + "/mcp"}}
	resp, body = httpDo(t, "GET", b.URL+"/oauth/authorize?"+q.Encode(), nil)
	if resp.StatusCode != http.StatusFound {
		t.Fatalf("authorize: %d %s", resp.StatusCode, body)
	}
	resp, body = httpDo(t, "GET", resp.Header.Get("Location"), nil)
	form := url.Values{"token": {operatorToken}, "action": {"approve"}}
	for _, m := range formField.FindAllStringSubmatch(string(body), -1) {
		form.Set(m[1], m[2])
	}
	var cookie string
	for _, c := range resp.Cookies() {
		cookie = c.Name + "=" + c.Value
	}
	resp, body = httpDo(t, "POST", b.URL+"/oauth/consent", strings.NewReader(form.Encode()),
		"Content-Type", "application/x-www-form-urlencoded", "Cookie", cookie)
	loc, _ := url.Parse(resp.Header.Get("Location"))
	if resp.StatusCode != http.StatusSeeOther || loc == nil || loc.Query().Get("code") == "" {
		t.Fatalf("consent: %d %s %s", resp.StatusCode, resp.Header.Get("Location"), body)
	}
	tq := url.Values{"grant_type": {"authorization_code"}, "code": {loc.Query().Get("code")}, "redirect_uri": {cb},
		"client_id": {reg.ClientID}, "code_verifier": {verifier}, "resource": {b.URL + "/mcp"}}
	resp, body = httpDo(t, "POST", b.URL+"/oauth/token", strings.NewReader(tq.Encode()), "Content-Type", "application/x-www-form-urlencoded")
	var tok struct {
		AccessToken  string `json:"access_token"`
		RefreshToken string `json:"refresh_token"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &tok) != nil || tok.AccessToken == "" {
		t.Fatalf("token: %d %s", resp.StatusCode, body)
	}
	return tok.AccessToken, tok.RefreshToken
}

func mcpClient(t testing.TB, b *Broker, token string) *client.Client {
	t.Helper()
	c, err := client.NewStreamableHttpClient(b.URL+"/mcp", transport.WithHTTPHeaders(map[string]string{"Authorization": "Bearer " + token}))
	if err != nil {
		t.Fatal(err)
	}
	initClient(t, c)
	return c
}

// auditEntries reads the broker's audit log.
func auditEntries(t testing.TB, root string) []audit.Entry {
	t.Helper()
	var buf bytes.Buffer
	if err := audit.Export(context.Background(), filepath.Join(root, "audit.db"), "jsonl", &buf); err != nil {
		t.Fatal(err)
	}
	var out []audit.Entry
	dec := json.NewDecoder(&buf)
	for dec.More() {
		var e audit.Entry
		if err := dec.Decode(&e); err != nil {
			t.Fatal(err)
		}
		out = append(out, e)
	}
	return out
}

// TestOAuthResourceServer: the broker as a protected resource. Metadata at
// both well-known paths, the 401 challenge, forged tokens refused and
// audited, static tokens still working, an OAuth principal with its own
// quota and MCP sessions bound to it.
func TestOAuthResourceServer(t *testing.T) {
	operator := "operator-token-" + strings.Repeat("x", 24)
	b := startOAuthBroker(t, operator, map[string]string{"SANDBOX_BACKEND": "none"})
	resource := b.URL + "/mcp"

	for _, path := range []string{"/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"} {
		resp, body := httpDo(t, "GET", b.URL+path, nil)
		var prm struct {
			Resource             string   `json:"resource"`
			AuthorizationServers []string `json:"authorization_servers"`
			ScopesSupported      []string `json:"scopes_supported"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &prm) != nil || prm.Resource != resource ||
			len(prm.AuthorizationServers) != 1 || prm.AuthorizationServers[0] != b.URL {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, body)
		}
	}
	resp, body := httpDo(t, "GET", b.URL+"/.well-known/oauth-authorization-server", nil)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"registration_endpoint":"`+b.URL+`/oauth/register"`) {
		t.Fatalf("AS metadata: %d %s", resp.StatusCode, body)
	}

	init := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}`
	post := func(token string) (*http.Response, []byte) {
		h := []string{"Content-Type", "application/json", "Accept", "application/json, text/event-stream"}
		if token != "" {
			h = append(h, "Authorization", "Bearer "+token)
		}
		return httpDo(t, "POST", resource, strings.NewReader(init), h...)
	}
	wantChallenge := `Bearer resource_metadata="` + b.URL + `/.well-known/oauth-protected-resource/mcp", scope="sandbox"`
	resp, _ = post("")
	if resp.StatusCode != http.StatusUnauthorized || resp.Header.Get("WWW-Authenticate") != wantChallenge {
		t.Fatalf("no token: %d %q", resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
	}

	access, _ := embeddedGrant(t, b, operator)
	claims := jwtClaims(t, access)
	key := brokerSigningKey(t, b.Root)
	now := time.Now().Unix()
	forged := map[string]string{
		"another audience": signES256(t, key, withClaim(claims, "aud", []string{"https://other.example/mcp"})),
		"expired":          signES256(t, key, withClaim(withClaim(claims, "exp", now-60), "iat", now-3600)),
		"alg none":         noneToken(claims),
		"HS256 confusion":  signHS256(t, claims, []byte(pemPublic(t, key))),
	}
	before := countTool(auditEntries(t, b.Root), "oauth.bearer")
	for name, tok := range forged {
		resp, _ := post(tok)
		if resp.StatusCode != http.StatusUnauthorized || resp.Header.Get("WWW-Authenticate") != wantChallenge+`, error="invalid_token"` {
			t.Errorf("%s: %d %q", name, resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
		}
	}
	rows := auditEntries(t, b.Root)
	if got := countTool(rows, "oauth.bearer") - before; got != len(forged) {
		t.Errorf("%d oauth.bearer audit rows for %d forged tokens", got, len(forged))
	}
	for _, r := range rows {
		if r.Tool == "oauth.bearer" && (r.ErrorCode != "invalid_token" || r.Outcome != audit.OutcomeDenied) {
			t.Errorf("bearer row %+v", r)
		}
	}

	// The OAuth token acts as the operator's principal; the static token
	// of another principal cannot use its MCP session.
	c := mcpClient(t, b, access)
	var usage struct {
		Principal string `json:"principal"`
		Tier      string `json:"tier"`
	}
	resultJSON(t, callTool(t, c, "get_usage", map[string]any{}), &usage)
	if usage.Principal != "operator" || usage.Tier != "pro" {
		t.Fatalf("get_usage through OAuth: %+v", usage)
	}
	session := c.GetSessionId()
	resp, body = httpDo(t, "POST", resource, strings.NewReader(`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`),
		"Content-Type", "application/json", "Accept", "application/json, text/event-stream",
		"Authorization", "Bearer "+operator+"-other", "Mcp-Session-Id", session)
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("another principal used the OAuth session: %d %s", resp.StatusCode, body)
	}
	// Static tokens keep working beside OAuth.
	resultJSON(t, callTool(t, mcpClient(t, b, operator), "get_usage", map[string]any{}), &usage)
	if usage.Principal != "operator" {
		t.Errorf("static token: %+v", usage)
	}
	for _, r := range auditEntries(t, b.Root) {
		raw, _ := json.Marshal(r)
		if strings.Contains(string(raw), access) || strings.Contains(string(raw), operator) {
			t.Fatalf("audit row %d holds a token", r.Seq)
		}
	}
}

func countTool(rows []audit.Entry, tool string) int {
	n := 0
	for _, r := range rows {
		if r.Tool == tool {
			n++
		}
	}
	return n
}

func jwtClaims(t testing.TB, tok string) map[string]any {
	t.Helper()
	raw, err := base64.RawURLEncoding.DecodeString(strings.Split(tok, ".")[1])
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func withClaim(m map[string]any, k string, v any) map[string]any {
	out := map[string]any{}
	for kk, vv := range m {
		out[kk] = vv
	}
	out[k] = v
	return out
}

type signingKey struct {
	id   string
	priv *ecdsa.PrivateKey
}

// brokerSigningKey reads the broker's own key (the test owns SANDBOX_ROOT),
// so forged tokens differ from genuine ones only in what each case changes.
func brokerSigningKey(t testing.TB, root string) signingKey {
	t.Helper()
	matches, _ := filepath.Glob(filepath.Join(root, "oauth-keys", "*.pem"))
	if len(matches) != 1 {
		t.Fatalf("%d signing keys", len(matches))
	}
	raw, _ := os.ReadFile(matches[0])
	block, _ := pem.Decode(raw)
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.TrimSuffix(filepath.Base(matches[0]), ".pem")
	return signingKey{id: name[strings.IndexByte(name, '-')+1:], priv: k.(*ecdsa.PrivateKey)}
}

func pemPublic(t testing.TB, k signingKey) string {
	der, err := x509.MarshalPKIXPublicKey(&k.priv.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}))
}

func signES256(t testing.TB, k signingKey, claims map[string]any) string {
	t.Helper()
	payload, _ := json.Marshal(claims)
	h := jws.NewHeaders()
	_ = h.Set(jws.KeyIDKey, k.id)
	out, err := jws.Sign(payload, jws.WithKey(jwa.ES256(), k.priv, jws.WithProtectedHeaders(h)))
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func signHS256(t testing.TB, claims map[string]any, secret []byte) string {
	t.Helper()
	payload, _ := json.Marshal(claims)
	out, err := jws.Sign(payload, jws.WithKey(jwa.HS256(), secret))
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func noneToken(claims map[string]any) string {
	payload, _ := json.Marshal(claims)
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"none"}`)) + "." + enc(payload) + "."
}

// TestTypeScriptOAuth is the done-when test: the official TypeScript SDK
// client goes from a bare URL through discovery, dynamic registration,
// PKCE, the consent form (submitted as shown, with a bearer token) and the
// token exchange to a successful run_code, then refreshes.
func TestTypeScriptOAuth(t *testing.T) {
	requireDocker(t)
	node, npm := requireNode(t)
	dir, err := filepath.Abs("ts")
	if err != nil {
		t.Fatal(err)
	}
	ensureNodeModules(t, npm, dir)
	operator := "ts-operator-" + strings.Repeat("k", 28)
	b := startOAuthBroker(t, operator, nil)
	runNode(t, node, dir, []string{"--test", "--test-reporter=spec", "oauth-flow.mjs"},
		"BROKER_URL="+b.URL, "BROKER_OPERATOR_TOKEN="+operator)

	rows := auditEntries(t, b.Root)
	for _, tool := range []string{"oauth.register", "oauth.consent", "oauth.token", "run_code"} {
		found := false
		for _, r := range rows {
			if r.Tool == tool && r.Outcome == audit.OutcomeSuccess && (tool == "oauth.register" || r.Principal == "operator" || r.Phase == audit.PhaseOutcome) {
				found = true
			}
		}
		if !found {
			t.Errorf("no successful %s audit row", tool)
		}
	}
	refreshes := 0
	for _, r := range rows {
		if r.Tool == "oauth.token" && r.Phase == audit.PhaseIntent && strings.Contains(string(r.Params), `"grant":"refresh_token"`) {
			refreshes++
			if r.Principal != "operator" {
				t.Errorf("refresh row principal %q", r.Principal)
			}
		}
	}
	if refreshes == 0 {
		t.Error("the client never refreshed")
	}
}

func requireNode(t testing.TB) (string, string) {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatalf("node is required (install Node.js >= 20): %v", err)
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Fatalf("npm is required: %v", err)
	}
	return node, npm
}

func runNode(t testing.TB, node, dir string, args []string, env ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, args...)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "NO_COLOR=1"), env...)
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil || ctx.Err() != nil {
		t.Fatalf("node %s failed (%v):\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("node %s:\n%s", strings.Join(args, " "), summary(string(out)))
}
