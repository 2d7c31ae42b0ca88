package files

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"
	"time"

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
	// "files.denied" (403) or "files.not_found" (404) for downloads, and
	// "files.uploaded" or "files.upload_failed" for verified uploads. The
	// signature and the raw query are never logged; sig_hash is a short
	// SHA-256 prefix.
	Log func(event string, kv ...any)
	// Limits is the workspace quota uploads are held to (MaxFiles,
	// MaxBytes); zero fields take workspace.DefaultLimits.
	Limits workspace.Limits
	// MaxFileBytes caps the size of a file served (404 above it) or
	// uploaded (413); 0 means Limits.MaxBytes, the workspace quota;
	// negative means no cap on downloads.
	MaxFileBytes int64
	// UploadGrace and UploadMinRate bound how long an upload's body may
	// take: byte n must arrive within UploadGrace + n/UploadMinRate of the
	// request (0 means DefaultUploadGrace and DefaultUploadMinRate).
	UploadGrace   time.Duration
	UploadMinRate int64 // bytes per second
	// Audit records every verified upload (see UploadAudit); nil refuses
	// uploads, which must never happen unaudited.
	Audit UploadAudit

	uploads uploadSlots
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

// ServeHTTP verifies the URL and, only if it verifies, serves the file
// (GET, HEAD) or stores the upload (PUT). 403 for anything wrong with the
// request or its signature, 404 for a correctly signed URL whose target is
// missing or not a regular file.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hd := w.Header()
	hd.Set("X-Content-Type-Options", "nosniff")
	hd.Set("Content-Security-Policy", "sandbox")
	hd.Set("Referrer-Policy", "no-referrer")
	hd.Set("Cache-Control", "private, no-store")

	if h.Signer == nil {
		h.forbidden(w, r, "no signer")
		return
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		h.serveDownload(w, r)
	case http.MethodPut:
		h.serveUpload(w, r)
	default:
		h.forbidden(w, r, "method")
	}
}

// maxFileBytes is the cap on one file, downloaded or uploaded; <= 0 is none.
func (h *Handler) maxFileBytes() int64 {
	if h.MaxFileBytes != 0 {
		return h.MaxFileBytes
	}
	if h.Limits.MaxBytes > 0 {
		return h.Limits.MaxBytes
	}
	return workspace.DefaultLimits().MaxBytes
}

func (h *Handler) serveDownload(w http.ResponseWriter, r *http.Request) {
	t, err := h.Signer.Verify(r.URL.EscapedPath(), r.URL.RawQuery)
	if err != nil {
		h.forbidden(w, r, denyReason(err))
		return
	}

	// The signature is good: now, and only now, the filesystem.
	ws, err := workspace.Open(h.workspaceDir(t.WorkspaceID), h.Limits, workspace.WithOwner(-1, -1))
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
	if limit := h.maxFileBytes(); limit > 0 && fi.Size() > limit {
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
	hd := w.Header()
	hd.Set("Content-Type", workspace.DetectMIME(base, head[:n]))
	hd.Set("Content-Disposition", "attachment; filename*=UTF-8''"+escapeRFC5987(base))
	if tag := etag(fi); tag != "" {
		hd.Set("ETag", tag)
	}
	// An If-Range date is a weak validator here: the sandbox sets mtimes at
	// will, so a resumed download could splice two versions. Only an
	// entity-tag can match (RFC 9110 §13.1.5); otherwise the whole file.
	if ir := r.Header.Get("If-Range"); ir != "" && !strings.HasPrefix(ir, `"`) {
		r = r.Clone(r.Context())
		r.Header.Del("Range")
	}
	h.log("files.served", "workspace", t.WorkspaceID, "path", t.Path, "kid", t.KID,
		"size", fi.Size(), "method", r.Method, "range", r.Header.Get("Range") != "", "sig_hash", sigHash(r))
	// name "" so that ServeContent never guesses a type of its own. It
	// measures the size again by seeking: the section pins it to the size
	// checked above, however the sandbox resizes the file meanwhile, and
	// ranges are checked against that size too. ServeContent evaluates
	// If-Match, If-Unmodified-Since, If-None-Match, If-Modified-Since and
	// If-Range against the ETag and modification time, and serves single
	// and multipart ranges (RFC 9110).
	http.ServeContent(w, r, "", fi.ModTime(), io.NewSectionReader(f, 0, fi.Size()))
}

func (h *Handler) workspaceDir(id string) string {
	return filepath.Join(h.Root, "workspaces", id)
}

// etag is a strong validator of the opened file: a hash of its device,
// inode, size, and modification and change times in nanoseconds. A write
// moves both times; setting mtime back moves ctime, which no unprivileged
// process can set. The hash keeps inode numbers and exact times out of
// responses. Kernels with multigrain timestamps (Linux 6.13+ on ext4, xfs,
// btrfs, tmpfs) give a change after the stat a distinct ctime; older ones
// count in clock ticks, so a same-size rewrite within one tick of the
// stat could keep the tag.
func etag(fi os.FileInfo) string {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ""
	}
	var b [7 * 8]byte
	for i, v := range []uint64{st.Dev, st.Ino, uint64(st.Size), uint64(st.Mtim.Sec), uint64(st.Mtim.Nsec), uint64(st.Ctim.Sec), uint64(st.Ctim.Nsec)} {
		binary.BigEndian.PutUint64(b[i*8:], v)
	}
	sum := sha256.Sum256(b[:])
	return `"` + base64.RawURLEncoding.EncodeToString(sum[:16]) + `"`
}

// denyReason is a Verify error's fixed reason, for logs.
func denyReason(err error) string {
	return strings.TrimPrefix(strings.TrimPrefix(err.Error(), ErrDenied.Error()), ": ")
}

func (h *Handler) forbidden(w http.ResponseWriter, r *http.Request, reason string) {
	h.log("files.denied", "reason", reason, "method", r.Method, "remote", r.RemoteAddr, "sig_hash", sigHash(r))
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		closeConn(w) // never read a refused body
	}
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
