package local

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"path/filepath"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// proxyTimeout bounds one proxied request to the node app.
const proxyTimeout = 60 * time.Second

// Preview implements projects.PreviewServer. Static templates are served
// from their build output in the workspace; the node template's app is
// started if needed and reached through its Unix socket in the workspace.
// The broker has already checked the signed link for id, and sets the
// preview's headers (its CSP among them) on its own listener.
func (p *Provider) Preview(ctx context.Context, id string) (http.Handler, error) {
	pr, err := p.open(ctx, id)
	if err != nil {
		return nil, err
	}
	if pr.static() {
		return http.HandlerFunc(pr.serveStatic), nil
	}
	if err := pr.ensureServer(ctx); err != nil {
		return nil, err
	}
	return pr.appProxy(), nil
}

// serveStatic serves the build output. A request path maps to a file below
// the output directory through the workspace's validated, no-symlink open: "/" and "dir/" take index.html, "page" also tries
// "page.html" and "page/index.html" (Next's static export).
func (pr *project) serveStatic(w http.ResponseWriter, r *http.Request) {
	status := http.StatusOK
	defer func() { pr.requests.Add(fmt.Sprintf("%s %s -> %d", r.Method, truncate(r.URL.Path, 200), status)) }()
	pr.mu.Lock()
	built := pr.built
	pr.mu.Unlock()
	if !built {
		status = http.StatusServiceUnavailable
		http.Error(w, "not built yet: call get_sandbox_output with output_type build_output first", status)
		return
	}
	ws, err := pr.workspace()
	if err != nil {
		status = http.StatusServiceUnavailable
		http.Error(w, "workspace unavailable", status)
		return
	}
	defer ws.Close()
	rel := strings.TrimPrefix(r.URL.Path, "/")
	var candidates []string
	switch {
	case rel == "":
		candidates = []string{"index.html"}
	case strings.HasSuffix(rel, "/"):
		candidates = []string{rel + "index.html"}
	default:
		candidates = []string{rel, rel + ".html", rel + "/index.html"}
	}
	for _, c := range candidates {
		// OpenFile runs the path validator (with the project prefixes) and
		// refuses symlinks; an invalid name is simply not found.
		name := pr.outDir() + "/" + c
		f, fi, err := ws.OpenFile(name)
		if err != nil {
			continue
		}
		defer f.Close()
		w.Header().Set("Content-Type", workspace.DetectMIME(name, nil))
		http.ServeContent(w, r, "", fi.ModTime(), f)
		return
	}
	status = http.StatusNotFound
	http.Error(w, "not found in the build output", status)
}

// appProxy forwards requests to the node app's socket. Only the checked
// socket inode is dialled (agent.DialSocket), so a symlink the sandbox put
// in its place cannot lead to a host socket.
func (pr *project) appProxy() http.Handler {
	sock := filepath.Join(pr.dir, SocketName)
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.Out.URL.Scheme = "http"
			r.Out.URL.Host = "app"
			r.Out.Host = "localhost"
			r.Out.Header.Del("Forwarded")
		},
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return agent.DialSocket(ctx, sock)
			},
			DisableKeepAlives:      true,
			ResponseHeaderTimeout:  proxyTimeout,
			MaxResponseHeaderBytes: 64 << 10,
		},
		ModifyResponse: pr.scrubAppHeaders,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			pr.console.Write([]byte("[broker] preview request failed: the app did not answer\n"))
			http.Error(w, "the app did not answer; see get_sandbox_output console_log", http.StatusBadGateway)
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), proxyTimeout)
		defer cancel()
		rp.ServeHTTP(w, r.WithContext(ctx))
	})
}

// scrubAppHeaders keeps the app's response from acting beyond its own
// preview: cookies (a preview origin may be shared by several sandboxes),
// Clear-Site-Data, the broker's CSP, HSTS and redirects elsewhere. Path-only
// redirects stay inside the preview.
func (pr *project) scrubAppHeaders(res *http.Response) error {
	h := res.Header
	for _, k := range []string{"Set-Cookie", "Set-Cookie2", "Clear-Site-Data", "Refresh", "Content-Security-Policy",
		"Content-Security-Policy-Report-Only", "Service-Worker-Allowed", "Strict-Transport-Security", "Alt-Svc"} {
		h.Del(k)
	}
	if loc := h.Get("Location"); loc != "" {
		u, err := url.Parse(loc)
		switch {
		case err != nil || u.Scheme != "" || u.Host != "" || strings.HasPrefix(loc, "//") || strings.ContainsRune(loc, '\\'):
			h.Del("Location")
		case strings.HasPrefix(u.Path, "/"):
			h.Set("Location", files.PreviewPrefix+pr.id+loc)
		}
	}
	return nil
}
