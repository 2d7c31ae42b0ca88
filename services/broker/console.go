package broker

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"math"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"time"

	"github.com/mark3labs/mcp-go/server"
	"golang.org/x/oauth2"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/console"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/oauth"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// mountConsole serves the web console at / and /console/ (off with
// CONSOLE=off). self is the whole HTTP handler, which the console's OAuth
// sign-in calls in-process for its token requests.
func (b *Broker) mountConsole(mux *http.ServeMux, self func() http.Handler) {
	if b.cfg.Console == "off" {
		return
	}
	c, err := console.New(console.Deps{
		Tools:          b.mcp,
		Console:        b.consoleServer(),
		Authenticate:   b.consoleAuthenticate,
		Status:         b.consoleStatus,
		Audit:          b.auditor(),
		Log:            b.log.With().Str("component", "console").Logger(),
		Secure:         strings.HasPrefix(b.cfg.PublicBaseURL, "https://"),
		FrameSources:   b.previewFrameSources,
		OAuth:          b.consoleOAuth(self),
		MaxUploadBytes: int64(b.cfg.MaxRequestBytes),
		Context:        b.loopContext(),
	})
	if err != nil { // templates are embedded: only a broken build gets here
		b.log.Error().Err(err).Msg("console_unavailable")
		return
	}
	h := c.Handler()
	mux.Handle("GET /{$}", h)
	mux.Handle("/console/", h)
}

// consoleServer is an MCP server for the console's own tools (audit
// desk, operator view), behind the same middleware chain as every tool
// but reachable from no transport.
func (b *Broker) consoleServer() *server.MCPServer {
	ts := tools.ConsoleToolset(&tools.Console{
		Audit: &tools.AuditDesk{
			Path:           b.cfg.AuditPath(),
			CheckpointPath: filepath.Join(b.cfg.Root, "audit.checkpoints"),
			Verifier:       b.auditKeys.Verifier,
			Verify: func(ctx context.Context) (audit.VerifyReport, error) {
				return audit.Verify(ctx, audit.VerifyOptions{Path: b.cfg.AuditPath(),
					CheckpointPath: filepath.Join(b.cfg.Root, "audit.checkpoints"), Keys: b.auditKeys})
			},
		},
		Sessions: b.sandboxes, Jobs: b.jobs, Projects: b.projects,
		Usage: b.quota, Limits: b.limits,
		Principals: func() []identity.Principal {
			if b.tokens == nil {
				return nil
			}
			return b.tokens.Principals()
		},
		Decisions: b.decisions.list,
	}).Tools(false)
	specs := map[string]middleware.ArgSpec{}
	opts := []server.ServerOption{server.WithToolCapabilities(false), server.WithRecovery()}
	for _, t := range ts {
		specs[t.Tool.Name] = t.Args
	}
	for _, mw := range b.toolChain(specs) {
		opts = append(opts, server.WithToolHandlerMiddleware(mw))
	}
	s := server.NewMCPServer("sandbox-broker-console", b.version, opts...)
	for _, t := range ts {
		s.AddTool(t.Tool, t.Handler)
	}
	return s
}

func (b *Broker) consoleAuthenticate(r *http.Request, token string) (identity.Principal, bool) {
	if token == "" {
		return identity.Principal{}, false
	}
	p, ok, _ := b.principalFor(r, token)
	return p, ok
}

// consoleStatus is what the public connect page shows: what /readyz
// shows, the MCP URL, and no repository names or tokens.
func (b *Broker) consoleStatus(ctx context.Context) console.Status {
	h := b.Health(ctx)
	st := console.Status{Version: h.Version, Health: h.Status, Components: h.Components, Details: h.Details, Pool: h.Pool,
		MCPURL: b.mcpURL(), OAuth: b.cfg.EffectiveOAuthMode()}
	if b.backend != nil {
		st.Backend = b.backend.Name()
	}
	if b.projects != nil {
		st.Projects = b.projects.Provider().Name()
	}
	if b.github != nil {
		st.GitHubRepos = len(b.github.RepoIDs())
	}
	if b.cfg.APIToken.Reveal() == "" && b.cfg.TokensFile == "" {
		st.TokenFile = identity.TokenFileName
	}
	return st
}

// mcpURL is where clients reach /mcp: PUBLIC_BASE_URL, else the listener.
func (b *Broker) mcpURL() string {
	base := b.cfg.PublicBaseURL
	if base == "" {
		base = b.signer.BaseURL
	}
	if base == "" {
		base = "http://" + b.cfg.Addr
	}
	return strings.TrimSuffix(base, "/") + "/mcp"
}

// previewFrameSources are the origins the console may frame: previews of
// local projects (their own listener and origins), or CodeSandbox's.
func (b *Broker) previewFrameSources() []string {
	if s := b.preview.Load(); s != nil {
		return []string{s.origin("*")} // a CSP source: every sandbox's origin on a wildcard site
	}
	if b.projects != nil && b.projects.Provider().Name() == "codesandbox" {
		return []string{"https://*.csb.app"}
	}
	return nil
}

// consoleOAuth is the console's OAuth sign-in through the embedded
// authorization server (nil without one): a public client with PKCE,
// registered on demand, whose token requests go to this broker's own
// handler in-process.
func (b *Broker) consoleOAuth(self func() http.Handler) *console.OAuthLogin {
	if b.oauth == nil || b.oauth.server == nil {
		return nil
	}
	issuer := strings.TrimSuffix(b.cfg.PublicBaseURL, "/")
	redirect := issuer + "/console/oauth/callback"
	sum := sha256.Sum256([]byte(redirect))
	id := "console-" + hex.EncodeToString(sum[:8])
	store := b.oauth.store
	return &console.OAuthLogin{
		Config: oauth2.Config{ClientID: id, RedirectURL: redirect, Scopes: []string{oauth.Scope},
			Endpoint: oauth2.Endpoint{AuthURL: issuer + oauth.PathAuthorize, TokenURL: issuer + oauth.PathToken, AuthStyle: oauth2.AuthStyleInParams}},
		Resource: b.cfg.OAuthResource(),
		HTTP:     &http.Client{Transport: inProcess{self}, Timeout: 15 * time.Second},
		Ensure: func(ctx context.Context) error {
			if _, err := store.Client(ctx, id); err == nil {
				return nil
			}
			// Not counted against the cap on unused dynamic registrations.
			return store.CreateClient(ctx, oauth.Client{ID: id, CreatedAt: time.Now(), Metadata: oauth.Registration{
				RedirectURIs: []string{redirect}, ClientName: "sandbox-broker web console",
				GrantTypes: []string{"authorization_code", "refresh_token"}, ResponseTypes: []string{"code"},
				TokenEndpointAuthMethod: oauth.AuthNone, Scope: oauth.Scope}}, math.MaxInt32)
		},
	}
}

// inProcess sends a request through the broker's own handler, with all
// its defences, without leaving the process (the public URL may not be
// reachable from the broker itself, behind a proxy).
type inProcess struct{ h func() http.Handler }

func (t inProcess) RoundTrip(r *http.Request) (*http.Response, error) {
	in := r.Clone(r.Context())
	in.RequestURI, in.Host, in.RemoteAddr = r.URL.RequestURI(), r.URL.Host, "127.0.0.1:0"
	rec := httptest.NewRecorder()
	t.h().ServeHTTP(rec, in)
	return rec.Result(), nil
}

// loopContext ends when the broker closes.
func (b *Broker) loopContext() context.Context {
	if b.loopCtx == nil {
		b.loop(func(ctx context.Context) { <-ctx.Done() })
	}
	return b.loopCtx
}
