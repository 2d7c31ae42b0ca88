package broker

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/connguard"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
)

// Previews of local projects run the project's own scripts, so they are
// served on a listener and origin of their own (PREVIEW_ADDR,
// PREVIEW_BASE_URL): by default one origin per sandbox,
// http://{sandbox_id}.localhost:{port}. That origin can be given
// allow-same-origin (Vite's crossorigin script and style tags need a real
// origin) without reaching the broker's: its cookies, /mcp, /files.

// previewCookie carries a verified preview link's exp/kid/sig, scoped to
// one sandbox's path on its preview host, so the page's own asset requests
// are authorised too.
const previewCookie = "sbx_preview"

// previewCSP is the Content-Security-Policy of every response from the
// preview listener: the page keeps its origin, so its scripts and
// crossorigin assets work, but stays sandboxed (no top navigation out of a
// frame, popups inherit the sandbox, no plugins).
const previewCSP = "sandbox allow-scripts allow-same-origin allow-forms allow-popups allow-modals allow-downloads"

// previewSite is where previews are served, from PREVIEW_BASE_URL or its
// default.
type previewSite struct {
	scheme   string // "http" or "https"
	host     string // lower-case; with wildcard, the name under the ID label
	wildcard bool   // one origin per sandbox: {id}.{host}
	port     string // as in the URL; "" for the scheme's default
}

func parsePreviewSite(base string) (*previewSite, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return nil, fmt.Errorf("preview base URL is not an http(s) origin")
	}
	host := strings.ToLower(u.Hostname())
	return &previewSite{scheme: u.Scheme, host: strings.TrimPrefix(host, config.PreviewWildcard),
		wildcard: strings.HasPrefix(host, config.PreviewWildcard), port: u.Port()}, nil
}

// origin is sandbox id's preview origin.
func (s *previewSite) origin(id string) string {
	h := s.host
	if s.wildcard {
		h = id + "." + h
	}
	if strings.Contains(h, ":") { // an IPv6 literal
		h = "[" + h + "]"
	}
	if s.port != "" {
		h += ":" + s.port
	}
	return s.scheme + "://" + h
}

// hostFor checks a Host header against the site: it returns the sandbox ID
// its first label names (wildcard sites) or "" (a single preview origin),
// and ok=false for any other host. Ports are not compared (a reverse proxy
// may listen on another).
func (s *previewSite) hostFor(hostport string) (id string, ok bool) {
	h := hostport
	if hh, _, err := net.SplitHostPort(hostport); err == nil {
		h = hh
	}
	h = strings.ToLower(strings.Trim(h, "[]"))
	if !s.wildcard {
		return "", h == s.host
	}
	id, rest, found := strings.Cut(h, ".")
	return id, found && rest == s.host && files.ValidWorkspaceID(id)
}

// cookie is the preview cookie: host-only, path-scoped and HttpOnly.
// Where browsers allow Secure cookies (https, and names under localhost,
// which they treat as secure) it is SameSite=None and Partitioned (CHIPS):
// a preview the web console frames is a third party there, and its own
// requests carry the cookie only under the top-level site that opened it,
// so no other site that frames or links the preview gets it. Elsewhere it
// is Strict, which is enough for a preview opened in a tab of its own.
func (s *previewSite) cookie(proof, scope string, exp time.Time, tls bool) *http.Cookie {
	c := &http.Cookie{Name: previewCookie, Value: proof, Path: scope, Expires: exp,
		MaxAge: int(time.Until(exp).Seconds()), HttpOnly: true, Secure: tls || s.scheme == "https", SameSite: http.SameSiteStrictMode}
	if c.Secure || s.host == "localhost" || strings.HasSuffix(s.host, ".localhost") {
		c.Secure, c.SameSite, c.Partitioned = true, http.SameSiteNoneMode, true
	}
	return c
}

// isPreviewOrigin reports whether a browser Origin is a preview's.
func (b *Broker) isPreviewOrigin(u *url.URL) bool {
	s := b.preview.Load()
	if s == nil || u == nil {
		return false
	}
	_, ok := s.hostFor(u.Host)
	return ok
}

// ListenPreviews binds the preview listener when this broker serves
// previews itself (the local project provider) and returns what serves it
// until ctx ends; serve is nil when there is nothing to serve (another
// provider, PREVIEW_ADDR=off, or no address a browser could use). It is
// called before the MCP transport starts, on stdio as on HTTP, so preview
// links work from the first call.
func (b *Broker) ListenPreviews() (serve func(context.Context) error, err error) {
	ps, ok := b.projectPreviews()
	if !ok {
		return nil, nil
	}
	addr, ok := b.cfg.PreviewListenAddr()
	if !ok {
		b.previewOff = "previews are turned off on this broker (PREVIEW_ADDR=off)"
		b.log.Info().Msg("previews_off")
		return nil, nil
	}
	if _, err := b.cfg.PreviewBaseFor(0); err != nil {
		b.previewOff = err.Error()
		b.log.Warn().Str("cause", b.previewOff).Msg("previews_off")
		return nil, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("PREVIEW_ADDR: %w (set PREVIEW_ADDR to a free address, or off)", err)
	}
	base, err := b.cfg.PreviewBaseFor(ln.Addr().(*net.TCPAddr).Port)
	if err == nil {
		var site *previewSite
		if site, err = parsePreviewSite(base); err == nil {
			b.preview.Store(site)
		}
	}
	if err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("PREVIEW_BASE_URL: %w", err)
	}
	b.log.Info().Str("addr", ln.Addr().String()).Str("base_url", base).Msg("preview_listening")
	if ip := ln.Addr().(*net.TCPAddr).IP; b.cfg.PreviewBaseURL == "" && !ip.IsLoopback() {
		// Fine behind a port published on the host's loopback (Compose);
		// browsers on other machines need PREVIEW_BASE_URL.
		b.log.Warn().Msg("preview_links_point_at_localhost")
	}
	// A quarter of the MCP listener's connections: previews are a side show.
	maxConns := max(16, b.maxConns()/4)
	limits := connguard.Limits{MaxConns: maxConns, MaxUntrustedPerAddr: min(b.cfg.UnauthPerAddr, maxConns)}
	return func(ctx context.Context) error {
		err := b.serve(ctx, ln, b.previewSiteHandler(ps), limits, "preview")
		b.log.Info().Msg("preview_stopped")
		return err
	}, nil
}

// previewSiteHandler is everything the preview listener serves: previews
// under /preview/{id}/ and nothing else (no /mcp, no /files), behind the
// same path, body and header defences as the MCP listener plus its own
// Host and Origin checks.
func (b *Broker) previewSiteHandler(ps projects.PreviewServer) http.Handler {
	preview := b.previewHandler(ps)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, files.PreviewPrefix) {
			http.NotFound(w, r)
			return
		}
		preview.ServeHTTP(w, r)
	})
	return b.boundBody(previewHeaders(securityHeaders(b.checkPreviewHost(b.requireCanonicalPath(h)))))
}

// previewHeaders puts the preview CSP on every response of the preview
// listener, its own error pages included.
func previewHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", previewCSP)
		next.ServeHTTP(w, r)
	})
}

// checkPreviewHost is the preview listener's DNS-rebinding defence: the
// Host must be the preview site's (a sandbox's own name on a wildcard
// site), and a browser Origin, when sent, must be the request's own: one
// preview cannot drive another's app, nor can any other page.
func (b *Broker) checkPreviewHost(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		site := b.preview.Load()
		if _, ok := site.hostFor(r.Host); !ok {
			b.refusalLog("preview_host_rejected", b.log.Warn).Msg("preview_host_rejected")
			closeConn(w)
			http.Error(w, "Host header is not allowed", http.StatusForbidden)
			return
		}
		if o := r.Header.Get("Origin"); o != "" {
			u, err := url.Parse(o)
			if err != nil || u.Scheme != site.scheme || !strings.EqualFold(u.Host, r.Host) {
				b.refusalLog("preview_origin_rejected", b.log.Warn).Msg("preview_origin_rejected")
				closeConn(w)
				http.Error(w, "Origin is not allowed", http.StatusForbidden)
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// previewHandler serves /preview/{sandbox_id}/…: a signed link (or the
// cookie it sets) is required, on a wildcard site the host must be that
// sandbox's, and the provider's handler gets the path below the prefix.
func (b *Broker) previewHandler(ps projects.PreviewServer) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		site := b.preview.Load()
		rest := strings.TrimPrefix(r.URL.Path, files.PreviewPrefix)
		id, sub, ok := strings.Cut(rest, "/")
		if hostID, _ := site.hostFor(r.Host); !ok || !files.ValidWorkspaceID(id) || (site.wildcard && hostID != id) {
			http.NotFound(w, r)
			return
		}
		scope := files.PreviewPrefix + id + "/"
		proof := r.URL.RawQuery
		fromQuery := strings.Contains(proof, "sig=")
		if !fromQuery {
			if c, err := r.Cookie(previewCookie); err == nil {
				proof = c.Value
			} else {
				proof = ""
			}
		}
		exp, err := b.signer.VerifyPreview(id, proof)
		if err != nil || !b.projects.Exists(r.Context(), id) {
			b.refusalLog("preview_denied", b.log.Info).Str("sandbox_id", id).Bool("signed_query", fromQuery).Msg("preview_denied")
			http.Error(w, "preview link invalid or expired: ask for a new preview_url", http.StatusForbidden)
			return
		}
		connguard.Trust(r.Context())
		if fromQuery {
			http.SetCookie(w, site.cookie(proof, scope, exp, r.TLS != nil))
		}
		h, err := ps.Preview(r.Context(), id)
		if err != nil {
			http.Error(w, "preview unavailable: "+b.redactor.Message(err.Error(), 200), http.StatusServiceUnavailable)
			return
		}
		r2 := r.Clone(r.Context())
		r2.URL.Path = "/" + sub
		r2.URL.RawPath = ""
		r2.URL.RawQuery = stripProof(r.URL.RawQuery)
		r2.Header.Del("Cookie")
		r2.Header.Del("Authorization")
		h.ServeHTTP(w, r2)
	})
}

// previewLink signs a link to sandbox id's preview on its preview origin.
func (b *Broker) previewLink(id string) (string, error) {
	site := b.preview.Load()
	if site == nil {
		if b.previewOff != "" {
			return "", brokererr.New(brokererr.NotConfigured, "%s", b.previewOff)
		}
		return "", brokererr.New(brokererr.Unavailable, "this broker serves no previews yet: its preview listener is not up")
	}
	s := *b.signer
	s.BaseURL = site.origin(id)
	u, _, err := s.PreviewURL(id)
	return u, err
}

// stripProof removes the link's exp/kid/sig from the query passed on.
func stripProof(q string) string {
	var keep []string
	for _, kv := range strings.Split(q, "&") {
		k, _, _ := strings.Cut(kv, "=")
		if kv != "" && k != "exp" && k != "kid" && k != "sig" {
			keep = append(keep, kv)
		}
	}
	return strings.Join(keep, "&")
}

// projectPreviews returns the provider's preview server when the broker
// serves previews itself (the local provider).
func (b *Broker) projectPreviews() (projects.PreviewServer, bool) {
	if b.projects == nil {
		return nil, false
	}
	ps, ok := b.projects.Provider().(projects.PreviewServer)
	return ps, ok
}
