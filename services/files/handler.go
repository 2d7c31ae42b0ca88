package files

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"path"
	"path/filepath"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Handler serves signed download URLs from <Root>/workspaces/<workspace_id>.
//
// Mounting: do NOT register it on an http.ServeMux. ServeMux cleans the
// escaped path before matching and answers 307 (Go 1.22+; 301 before) for
// any path containing "//", "/./" or "/../", so the handler would never see
// such requests and a client would be redirected to a cleaned URL instead
// of refused (tested in TestServeMuxRedirects). Either give the file origin
// its own http.Server with Handler set to h (the recommended setup: a
// separate origin from the MCP endpoint, security-cases §5.6), or put
// h.Intercept(mux) in front of the broker's mux so that requests whose raw
// path starts with "/files/" reach h untouched. If the broker is served
// under a path prefix, strip it in front (the handler expects the escaped
// path to start with PathPrefix).
type Handler struct {
	Signer *Signer
	Root   string // SANDBOX_ROOT; workspaces live in <Root>/workspaces/<id>
	// Log, if set, receives one event per request: "files.served",
	// "files.denied" (403) or "files.not_found" (404). The signature and
	// the raw query are never logged; sig_hash is a short SHA-256 prefix.
	Log func(event string, kv ...any)
	// MaxFileBytes caps the size of a served file (404 above it); 0 means
	// workspace.DefaultLimits().MaxFileBytes, negative means no cap.
	MaxFileBytes int64
}

// Intercept returns a handler that passes every request whose raw escaped
// path starts with PathPrefix (or is exactly "/files") to h before any path
// cleaning, and everything else to next.
func (h *Handler) Intercept(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := r.URL.EscapedPath()
		if strings.HasPrefix(p, PathPrefix) || p == strings.TrimSuffix(PathPrefix, "/") {
			h.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (h *Handler) log(event string, kv ...any) {
	if h.Log != nil {
		h.Log(event, kv...)
	}
}

// ServeHTTP verifies the URL and, only if it verifies, serves the file.
// 403 for anything wrong with the request or its signature, 404 for a
// correctly signed URL whose target is missing or not a regular file.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Content-Security-Policy", "sandbox")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("Cache-Control", "private, no-store")

	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		h.forbidden(w, r, "method")
		return
	}
	if h.Signer == nil {
		h.forbidden(w, r, "no signer")
		return
	}
	t, err := h.Signer.Verify(r.URL.EscapedPath(), r.URL.RawQuery)
	if err != nil {
		h.forbidden(w, r, strings.TrimPrefix(strings.TrimPrefix(err.Error(), ErrDenied.Error()), ": "))
		return
	}

	// The signature is good: now, and only now, the filesystem.
	ws, err := workspace.Open(filepath.Join(h.Root, "workspaces", t.WorkspaceID), workspace.Limits{}, workspace.WithOwner(-1, -1))
	if err != nil {
		h.notFound(w, r, t, "workspace")
		return
	}
	defer ws.Close()
	f, fi, err := ws.OpenFile(t.Path)
	if err != nil {
		h.notFound(w, r, t, "file")
		return
	}
	defer f.Close()
	limit := h.MaxFileBytes
	if limit == 0 {
		limit = workspace.DefaultLimits().MaxFileBytes
	}
	if limit > 0 && fi.Size() > limit {
		h.notFound(w, r, t, "file too large")
		return
	}

	var head [512]byte
	n, err := f.ReadAt(head[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		h.notFound(w, r, t, "read")
		return
	}
	base := path.Base(t.Path)
	hd.Set("Content-Type", workspace.DetectMIME(base, head[:n]))
	hd.Set("Content-Disposition", "attachment; filename*=UTF-8''"+escapeRFC5987(base))
	h.log("files.served", "workspace", t.WorkspaceID, "path", t.Path, "kid", t.KID,
		"size", fi.Size(), "method", r.Method, "sig_hash", sigHash(r))
	// name "" so that ServeContent never guesses a type of its own. It
	// measures the size again by seeking: the section pins it to the size
	// checked above, however the sandbox resizes the file meanwhile.
	http.ServeContent(w, r, "", fi.ModTime(), io.NewSectionReader(f, 0, fi.Size()))
}

func (h *Handler) forbidden(w http.ResponseWriter, r *http.Request, reason string) {
	h.log("files.denied", "reason", reason, "method", r.Method, "remote", r.RemoteAddr, "sig_hash", sigHash(r))
	writeTiny(w, http.StatusForbidden, "forbidden\n")
}

func (h *Handler) notFound(w http.ResponseWriter, r *http.Request, t Target, reason string) {
	h.log("files.not_found", "reason", reason, "workspace", t.WorkspaceID, "path", t.Path, "kid", t.KID,
		"remote", r.RemoteAddr, "sig_hash", sigHash(r))
	writeTiny(w, http.StatusNotFound, "not found\n")
}

func writeTiny(w http.ResponseWriter, code int, body string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(code)
	_, _ = io.WriteString(w, body)
}

// sigHash identifies a URL in logs without revealing its signature.
func sigHash(r *http.Request) string {
	q := r.URL.RawQuery
	for q != "" {
		var part string
		part, q, _ = strings.Cut(q, "&")
		if v, ok := strings.CutPrefix(part, "sig="); ok {
			sum := sha256.Sum256([]byte(v))
			return hex.EncodeToString(sum[:6])
		}
	}
	return ""
}

// escapeRFC5987 percent-encodes everything but RFC 5987 attr-chars.
func escapeRFC5987(s string) string {
	const hexd = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$&+-.^_`|~", c) >= 0 {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hexd[c>>4])
		b.WriteByte(hexd[c&15])
	}
	return b.String()
}
