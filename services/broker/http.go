package broker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/mark3labs/mcp-go/server"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/connguard"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/mcpsessions"
)

// HTTPHandler is the whole HTTP surface but previews, which have a
// listener and origin of their own (preview.go):
//
//	/mcp, /mcp/events  Streamable HTTP (POST, GET stream, DELETE)
//	/files/            signed downloads
//	/healthz           liveness, no auth
//	/readyz            readiness with per-component status, no auth
//	/metrics           Prometheus, bearer auth
//	/, /console/       the web console (services/console)
func (b *Broker) HTTPHandler() http.Handler {
	mcpHTTP := server.NewStreamableHTTPServer(b.mcp,
		server.WithSessionIdManagerResolver(sessionManagers{b.mcpSessions}),
		server.WithSessionIdleTTL(mcpsessions.IdleTTL),
		server.WithHeartbeatInterval(25*time.Second),
		server.WithStreamableHTTPLogger(logging.Slog(logging.Component(b.log, "mcp_http"))),
		server.WithHTTPContextFunc(func(ctx context.Context, r *http.Request) context.Context {
			// The user agent is the client's to choose: the audit log
			// cleans and caps it.
			ctx = middleware.WithSource(ctx, audit.Source{Transport: "http", ClientAddr: r.RemoteAddr, UserAgent: r.UserAgent()})
			// The auth layer already put the principal on r's context.
			if p, ok := identity.FromContext(r.Context()); ok {
				return identity.WithPrincipal(ctx, p)
			}
			return ctx
		}),
	)
	mcpHandler := b.bindSessions(b.limitBody(mcpHTTP))

	mux := http.NewServeMux()
	var self http.Handler
	b.mountConsole(mux, func() http.Handler { return self })
	mux.Handle("/mcp", b.authenticate(mcpHandler))
	mux.Handle("GET /mcp/events", b.authenticate(mcpHandler))
	mux.Handle("GET /metrics", b.authenticate(promhttp.HandlerFor(b.metrics.Registry, promhttp.HandlerOpts{})))
	b.mountOAuth(mux)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		h := b.Health(r.Context())
		code := http.StatusOK
		if h.Status != "ok" {
			code = http.StatusServiceUnavailable
		}
		writeJSON(w, code, h)
	})
	// Signed downloads bypass the mux, which would clean their raw paths;
	// everything else must already be canonical (the mux never redirects).
	self = b.boundBody(b.checkHostOrigin(securityHeaders(b.requireCanonicalPath(b.filesHandler().Intercept(mux)))))
	return self
}

// requireCanonicalPath refuses, with 403, a request whose path is not
// canonical as sent or once unescaped ("//x", "/./x", "/x/..", "/%2e%2e/x",
// "/a%2F..%2Fb"), before anything routes it: http.ServeMux would answer
// 307 with the cleaned path, so a client could reach /files/ or /preview/
// through a spelling their handlers never see.
func (b *Broker) requireCanonicalPath(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !canonicalPath(r.URL.EscapedPath()) {
			b.refusalLog("path_rejected", b.log.Warn).Str("method", r.Method).Msg("path_rejected")
			closeConn(w)
			writeJSON(w, http.StatusForbidden, map[string]string{"error": "PERMISSION_DENIED", "message": "the request path is not canonical"})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// canonicalPath reports whether the escaped path and its unescaped form are
// both absolute and unchanged by path.Clean (a trailing slash aside).
func canonicalPath(escaped string) bool {
	decoded, err := url.PathUnescape(escaped)
	if err != nil {
		return false
	}
	for _, p := range []string{escaped, decoded} {
		if !strings.HasPrefix(p, "/") {
			return false
		}
		c := path.Clean(p)
		if strings.HasSuffix(p, "/") && c != "/" {
			c += "/"
		}
		if c != p {
			return false
		}
	}
	return true
}

// ServeHTTP serves on ln until ctx ends, then shuts down gracefully.
// Connections are capped (connguard): those not authenticated yet per
// client address, and all of them to MCP_MAX_CONNS or half the fd limit.
func (b *Broker) ServeHTTP(ctx context.Context, ln net.Listener) error {
	maxConns := b.maxConns()
	if b.signer.BaseURL == "" {
		// Links point at the address actually bound (port 0 included).
		b.signer.BaseURL = "http://" + ln.Addr().String()
	}
	b.log.Info().Str("addr", ln.Addr().String()).Msg("http_listening")
	err := b.serve(ctx, ln, b.HTTPHandler(), connguard.Limits{MaxConns: maxConns, MaxUntrustedPerAddr: min(b.cfg.UnauthPerAddr, maxConns)}, "http")
	b.log.Info().Msg("http_stopped")
	return err
}

// maxConns is MCP_MAX_CONNS, lowered to half the fd limit if need be.
func (b *Broker) maxConns() int {
	maxConns := connguard.FitToFileLimit(b.cfg.MaxConns)
	if maxConns < b.cfg.MaxConns {
		b.log.Warn().Int("max_conns", maxConns).Int("configured", b.cfg.MaxConns).Msg("http_max_conns_lowered_for_fd_limit")
	}
	return maxConns
}

// serve runs one listener behind a connection guard until ctx ends, then
// shuts it down gracefully. name prefixes its log events.
func (b *Broker) serve(ctx context.Context, ln net.Listener, h http.Handler, limits connguard.Limits, name string) error {
	guard := connguard.New(ln, limits)
	guard.OnClose = func(reason string) {
		b.refusalLog(name+"_conn_closed", b.log.Warn).Str("reason", reason).Msg(name + "_conn_closed")
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		BaseContext:       func(net.Listener) context.Context { return ctx },
		ConnContext:       guard.ConnContext,
		ConnState:         guard.ConnState,
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(guard) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := srv.Shutdown(sctx)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// authenticate requires a bearer token that maps to a principal, puts the
// principal on the request context and marks the connection trusted.
func (b *Broker) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := bearerToken(r.Header.Get("Authorization"))
		p, valid, tokenErr := b.principalFor(r, token)
		if !ok || !valid {
			b.unauthorized(w, r, ok, tokenErr)
			return
		}
		connguard.Trust(r.Context())
		next.ServeHTTP(w, r.WithContext(identity.WithPrincipal(r.Context(), p)))
	})
}

func bearerToken(h string) (string, bool) {
	scheme, token, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimSpace(token)
	return token, token != ""
}

// limitBody caps POST bodies and refuses invalid UTF-8 with a JSON-RPC
// error, before the MCP layer parses anything.
func (b *Broker) limitBody(next http.Handler) http.Handler {
	max := int64(b.cfg.MaxRequestBytes)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, max+1))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			closeConn(w)
			writeRPCError(w, http.StatusRequestTimeout, -32600, fmt.Sprintf("request body not received within %d s", b.cfg.BodyTimeoutS))
			return
		}
		if err != nil {
			closeConn(w)
			writeRPCError(w, http.StatusBadRequest, -32700, "could not read the request body")
			return
		}
		if int64(len(body)) > max {
			closeConn(w)
			writeRPCError(w, http.StatusRequestEntityTooLarge, -32600, fmt.Sprintf("request body exceeds %d bytes", max))
			return
		}
		if !utf8.Valid(body) {
			writeRPCError(w, http.StatusBadRequest, -32700, "request body is not valid UTF-8")
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		next.ServeHTTP(w, r)
	})
}

// checkHostOrigin defends against DNS rebinding: the Host header must name
// this server and a browser Origin, when sent, must be allowed. A preview's
// origin never is, whatever MCP_ALLOWED_ORIGINS says.
func (b *Broker) checkHostOrigin(next http.Handler) http.Handler {
	hosts := b.cfg.BrokerHosts()
	origins := map[string]bool{}
	for _, o := range b.cfg.AllowedOrigins {
		origins[strings.TrimRight(strings.ToLower(o), "/")] = true
	}
	if b.cfg.PublicBaseURL != "" {
		if u, err := url.Parse(b.cfg.PublicBaseURL); err == nil {
			origins[strings.ToLower(u.Scheme+"://"+u.Host)] = true
		}
	}
	hostOK := func(hostport string) bool {
		h := hostport
		if hh, _, err := net.SplitHostPort(hostport); err == nil {
			h = hh
		}
		return hosts[strings.ToLower(strings.Trim(h, "[]"))]
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !hostOK(r.Host) {
			b.refusalLog("host_rejected", b.log.Warn).Msg("host_rejected")
			closeConn(w)
			writeJSON(w, http.StatusForbidden, map[string]string{"error": "PERMISSION_DENIED", "message": "Host header is not allowed"})
			return
		}
		if o := r.Header.Get("Origin"); o != "" {
			u, err := url.Parse(o)
			if err != nil || b.isPreviewOrigin(u) || (!origins[strings.ToLower(strings.TrimRight(o, "/"))] && !hostOK(u.Host)) {
				b.refusalLog("origin_rejected", b.log.Warn).Msg("origin_rejected")
				closeConn(w)
				writeJSON(w, http.StatusForbidden, map[string]string{"error": "PERMISSION_DENIED", "message": "Origin is not allowed"})
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeRPCError(w http.ResponseWriter, status, code int, msg string) {
	writeJSON(w, status, map[string]any{"jsonrpc": "2.0", "id": nil, "error": map[string]any{"code": code, "message": msg}})
}
