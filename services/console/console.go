// Package console is the broker's web console at /: a connect page for
// self-hosters, a playground, the audit desk for the security team and an
// operator view. It is server-rendered html/template with two vendored
// scripts (htmx and its SSE extension) and one of its own, all embedded,
// so it works offline and needs no build step.
//
// The console acts as the logged-in principal and never around the tool
// chain: every action is an MCP tool call, made in-process through an
// mcp-go client, so it is validated, rate-limited against that
// principal's quotas, audited and redacted like any client's call. Views
// only the console has (audit desk, operator view) are tools too, on a
// server of their own that no transport exposes.
package console

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"path"
	"strings"
	"time"

	"github.com/mark3labs/mcp-go/server"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Auditor is the audit log as the console writes its login rows.
type Auditor interface {
	Append(ctx context.Context, r audit.Record) (int64, error)
}

// Status is what the connect page shows about the broker; it never holds
// a token.
type Status struct {
	Version     string
	Health      string            // "ok" or "degraded"
	Components  map[string]string // component → "ok" | "error"
	Details     map[string]string
	Pool        map[string]int
	Backend     string // "docker", "process" or "" (none)
	Projects    string // "codesandbox", "local" or "" (none)
	GitHubRepos int    // allow-listed repositories (names are not public)
	MCPURL      string
	// TokenFile is where a generated token is kept, relative to
	// SANDBOX_ROOT ("" when tokens come from the configuration).
	TokenFile string
	OAuth     string // "embedded", "external" or "off"
}

// Deps are the console's collaborators, supplied by the broker.
type Deps struct {
	// Tools is the broker's MCP server: the playground's calls.
	Tools *server.MCPServer
	// Console serves the console's own tools (tools.ConsoleToolset).
	Console *server.MCPServer
	// Authenticate maps a bearer token (static, or an OAuth access token)
	// to its principal, as the /mcp endpoint does.
	Authenticate func(r *http.Request, token string) (identity.Principal, bool)
	Status       func(ctx context.Context) Status
	Audit        Auditor
	Log          zerolog.Logger
	// Secure marks cookies Secure (the broker is served over https).
	Secure bool
	// FrameSources are the origins project previews load from (CSP
	// frame-src), e.g. "http://*.localhost:8081".
	FrameSources func() []string
	// OAuth, when set, offers signing in through the broker's own
	// authorization server.
	OAuth *OAuthLogin
	// MaxUploadBytes bounds an upload's request body.
	MaxUploadBytes int64
	// Context ends when the broker shuts down; runs the console started
	// end with it.
	Context context.Context
	Now     func() time.Time
}

// Console serves the web console.
type Console struct {
	d        Deps
	pages    map[string]*template.Template
	frags    *template.Template
	sessions *sessionStore
	logins   *loginGuard
	runs     *runRegistry
	tools    caller
	admin    caller
	static   http.Handler
	assets   map[string]string // file name → name with content hash, for caching
}

// New builds the console.
func New(d Deps) (*Console, error) {
	if d.Now == nil {
		d.Now = time.Now
	}
	if d.MaxUploadBytes <= 0 {
		d.MaxUploadBytes = 16 << 20
	}
	if d.FrameSources == nil {
		d.FrameSources = func() []string { return nil }
	}
	c := &Console{d: d, sessions: newSessionStore(d.Now), logins: newLoginGuard(), runs: newRunRegistry(d.Now),
		tools: caller{srv: d.Tools}, admin: caller{srv: d.Console}}
	if err := c.parseTemplates(); err != nil {
		return nil, err
	}
	sub, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, err
	}
	c.static = http.StripPrefix(staticPrefix, http.FileServerFS(sub))
	return c, nil
}

// staticPrefix is where the embedded scripts and styles are served.
const staticPrefix = "/console/static/"

// Handler serves / and everything under /console/. The broker's own
// defences (canonical paths, Host and Origin checks, body deadline) are
// around it; it adds the console's headers, sessions and CSRF checks.
func (c *Console) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", c.landing)
	mux.Handle("GET "+staticPrefix, c.staticFiles())
	mux.HandleFunc("GET /console/login", c.loginPage)
	mux.HandleFunc("POST /console/login", c.loginSubmit)
	mux.HandleFunc("GET /console/login/oauth", c.oauthStart)
	mux.HandleFunc("GET /console/oauth/callback", c.oauthCallback)
	mux.Handle("POST /console/logout", c.authed(c.logout))

	mux.Handle("GET /console/{$}", c.authed(c.home))
	mux.Handle("GET /console/playground", c.authed(c.playground))
	mux.Handle("POST /console/run", c.authed(c.runCode))
	mux.Handle("GET /console/runs/{id}/events", c.authed(c.runEvents))
	mux.Handle("GET /console/sessions", c.authed(c.mySessions))
	mux.Handle("POST /console/sessions/close", c.authed(c.closeSession))
	mux.Handle("GET /console/files", c.authed(c.listFiles))
	mux.Handle("POST /console/files", c.authed(c.upload))
	mux.Handle("GET /console/jobs", c.authed(c.listJobs))
	mux.Handle("POST /console/jobs", c.authed(c.startJob))
	mux.Handle("GET /console/jobs/{id}/events", c.authed(c.jobEvents))
	mux.Handle("POST /console/jobs/{id}/stdin", c.authed(c.jobStdin))
	mux.Handle("POST /console/jobs/{id}/cancel", c.authed(c.jobCancel))
	mux.Handle("GET /console/projects", c.authed(c.listProjects))
	mux.Handle("POST /console/projects", c.authed(c.createProject))
	mux.Handle("POST /console/projects/{id}/build", c.authed(c.buildProject))

	mux.Handle("GET /console/audit", c.authed(c.auditDesk))
	mux.Handle("GET /console/audit/rows", c.authed(c.auditRows))
	mux.Handle("GET /console/audit/rows/{seq}", c.authed(c.auditRecord))
	mux.Handle("GET /console/audit/state", c.authed(c.auditState))
	mux.Handle("POST /console/audit/verify", c.authed(c.auditVerify))
	mux.Handle("GET /console/audit/export", c.authed(c.auditExport))
	mux.Handle("GET /console/audit/tail", c.authed(c.auditTail))

	mux.Handle("GET /console/operator", c.authed(c.operator))
	mux.Handle("POST /console/operator/close-session", c.authed(c.operatorCloseSession))
	mux.Handle("POST /console/operator/cancel-execution", c.authed(c.operatorCancel))
	mux.HandleFunc("/console/", func(w http.ResponseWriter, r *http.Request) {
		c.errorPage(w, r, http.StatusNotFound, "There is no such page.")
	})
	return c.headers(crossOrigin(mux))
}

// crossOrigin refuses cross-origin unsafe requests (Sec-Fetch-Site, then
// Origin against Host): the standard library's CSRF defence, under the
// per-session token every form and htmx request carries as well.
func crossOrigin(next http.Handler) http.Handler {
	p := http.NewCrossOriginProtection()
	p.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusForbidden)
		_, _ = w.Write([]byte("cross-origin request refused\n"))
	}))
	return p.Handler(next)
}

// headers sets the console's security headers on every response: a CSP
// with no inline script or style, no framing, and no other origin to
// talk to; frames only for project previews, which have origins of their
// own.
func (c *Console) headers(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", c.csp())
		h.Set("X-Frame-Options", "DENY")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		h.Set("Cross-Origin-Resource-Policy", "same-origin")
		h.Set("Permissions-Policy", "camera=(), microphone=(), geolocation=(), payment=(), usb=()")
		// Not no-referrer: with it browsers send "Origin: null" on
		// same-origin form posts, which the Origin check must refuse.
		h.Set("Referrer-Policy", "same-origin")
		// Every tool call the console makes for this request is audited as
		// coming from the console, with the person's address and browser.
		src := audit.Source{Transport: "console", ClientAddr: r.RemoteAddr, UserAgent: r.UserAgent()}
		next.ServeHTTP(w, r.WithContext(middleware.WithSource(r.Context(), src)))
	})
}

func (c *Console) csp() string {
	frames := "'none'"
	if src := c.d.FrameSources(); len(src) > 0 {
		frames = strings.Join(src, " ")
	}
	return "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; " +
		"form-action 'self'; frame-src " + frames + "; frame-ancestors 'none'; base-uri 'none'"
}

// staticFiles serves the embedded assets. Their URLs carry a content hash
// (?v=…), so they may be cached; everything else is no-store.
func (c *Console) staticFiles() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name := strings.TrimPrefix(r.URL.Path, staticPrefix)
		if st, err := fs.Stat(staticFS, "static/"+name); err != nil || st.IsDir() || path.Ext(name) == ".md" {
			http.NotFound(w, r)
			return
		}
		if r.URL.Query().Get("v") != "" {
			w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
		}
		c.static.ServeHTTP(w, r)
	})
}

// assetURL is the URL of an embedded asset with its content hash.
func (c *Console) assetURL(name string) (string, error) {
	if u, ok := c.assets[name]; ok {
		return u, nil
	}
	return "", fmt.Errorf("console: no asset %q", name)
}

func (c *Console) hashAssets() error {
	c.assets = map[string]string{}
	return fs.WalkDir(staticFS, "static", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := staticFS.ReadFile(p)
		if err != nil {
			return err
		}
		sum := sha256.Sum256(b)
		rel := strings.TrimPrefix(p, "static/")
		c.assets[rel] = staticPrefix + rel + "?v=" + hex.EncodeToString(sum[:6])
		return nil
	})
}
