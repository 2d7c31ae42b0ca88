package files

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/connguard"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Upload defaults (see Handler).
const (
	// DefaultUploadGrace is how long an upload body may take before its
	// first byte, on top of n/UploadMinRate for byte n.
	DefaultUploadGrace = 60 * time.Second
	// DefaultUploadMinRate is the slowest average rate an upload may keep:
	// 64 KiB/s, so a 512 MiB upload may take up to 2 h 16 min, and a client
	// trickling bytes holds its connection no longer than its data earns.
	DefaultUploadMinRate = 64 << 10
	// MaxUploadsPerWorkspace uploads may stream into one workspace at once;
	// more get 429.
	MaxUploadsPerWorkspace = 4
)

// UploadAudit records a verified upload. It is called before anything is
// written and returns only once the upload's intent is durably recorded;
// an error refuses the upload (audit before execute), with 404 when it is
// a *brokererr.Error with code SandboxNotFound (the workspace belongs to
// no session) and 503 otherwise. end is called exactly once, with what was
// stored or why nothing was.
type UploadAudit func(ctx context.Context, u Upload, sigHash string) (end func(res UploadResult, err error), err error)

// UploadResult is what a successful upload stored, and the PUT response's
// JSON body.
type UploadResult struct {
	Path     string `json:"path"`
	Size     int64  `json:"size"`
	SHA256   string `json:"sha256"`
	Replaced bool   `json:"replaced"`
}

// serveUpload verifies a PUT link and streams the body into the workspace
// (workspace.WriteFrom: a temporary file renamed into place, the quota
// enforced while the bytes arrive). Answers: 201 (created) or 200
// (replaced) with an UploadResult; 403 bad link; 404 no such workspace;
// 408 body too slow; 409 exists or not a file; 413 over the link's max,
// the size cap or the quota; 429 too many uploads into the workspace;
// 503 audit log unavailable. The body of a request whose link does not
// verify is never read; a verified upload that is refused lingers (see
// linger) so that its client reads the answer.
func (h *Handler) serveUpload(w http.ResponseWriter, r *http.Request) {
	u, err := h.Signer.VerifyUpload(r.URL.EscapedPath(), r.URL.RawQuery)
	if err != nil {
		h.forbidden(w, r, denyReason(err))
		return
	}
	limit := u.MaxBytes
	if c := h.maxFileBytes(); c > 0 && c < limit {
		limit = c
	}
	// A client that waits for "100 Continue" has sent no body when it is
	// refused now; one that did not may be sending it: linger for it.
	refuse := func(status int, code brokererr.Code, format string, args ...any) {
		h.uploadRefused(w, r, u, status, code, format, args...)
		if !strings.EqualFold(r.Header.Get("Expect"), "100-continue") {
			linger(w, r)
		}
	}
	if r.ContentLength > limit {
		refuse(http.StatusRequestEntityTooLarge, brokererr.FileSizeExceeded, "the body is larger than this link accepts (%d bytes)", limit)
		return
	}
	release, ok := h.uploads.acquire(u.WorkspaceID)
	if !ok {
		w.Header().Set("Retry-After", "5")
		refuse(http.StatusTooManyRequests, brokererr.RateLimitExceeded, "%d uploads into this workspace are already running", MaxUploadsPerWorkspace)
		return
	}
	defer release()
	if h.Audit == nil {
		refuse(http.StatusServiceUnavailable, brokererr.Unavailable, "uploads are not available")
		return
	}
	end, err := h.Audit(r.Context(), u, sigHash(r))
	if err != nil {
		if brokererr.CodeOf(err) == brokererr.SandboxNotFound {
			refuse(http.StatusNotFound, brokererr.SandboxNotFound, "no such workspace")
		} else {
			refuse(http.StatusServiceUnavailable, brokererr.Unavailable, "the audit log is unavailable, so the upload was refused")
		}
		return
	}

	// Verified and audited: like a bearer-authenticated connection, it no
	// longer counts against its address, and a flood of unauthenticated
	// connections cannot close it mid-transfer (the minimum rate and the
	// per-workspace cap bound what it holds).
	connguard.Trust(r.Context())
	res, err := h.store(w, r, u, limit)
	end(res, err)
	if err != nil {
		status, code, msg := uploadStatus(err)
		h.uploadRefused(w, r, u, status, code, "%s", msg)
		if err != errTooSlow && err != errBodyBroken { // the body still flows
			linger(w, r)
		}
		return
	}
	h.log("files.uploaded", "workspace", u.WorkspaceID, "path", u.Path, "kid", u.KID, "size", res.Size,
		"replaced", res.Replaced, "sig_hash", sigHash(r))
	status := http.StatusCreated
	if res.Replaced {
		status = http.StatusOK
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(res)
}

// store streams the body into the workspace, at the minimum rate.
func (h *Handler) store(w http.ResponseWriter, r *http.Request, u Upload, limit int64) (UploadResult, error) {
	lim := h.Limits
	lim.MaxFileBytes = limit
	ws, err := workspace.Open(h.workspaceDir(u.WorkspaceID), lim, workspace.WithDirOwner())
	if err != nil {
		return UploadResult{}, brokererr.Wrap(err, brokererr.SandboxNotFound, "no such workspace")
	}
	defer ws.Close()
	sum := sha256.New()
	body := &minRateBody{r: r.Body, rc: http.NewResponseController(w), start: time.Now(),
		grace: h.uploadGrace(), rate: h.uploadMinRate()}
	wr, err := ws.WriteFrom(r.Context(), u.Path, io.TeeReader(body, sum), limit, u.Overwrite)
	if body.err != nil && err != nil { // the body broke off: say so, not what the workspace made of it
		if errors.Is(body.err, os.ErrDeadlineExceeded) {
			return UploadResult{}, errTooSlow
		}
		return UploadResult{}, errBodyBroken
	}
	if err != nil {
		return UploadResult{}, err
	}
	return UploadResult{Path: u.Path, Size: wr.Size, SHA256: hex.EncodeToString(sum.Sum(nil)), Replaced: wr.Replaced}, nil
}

func (h *Handler) uploadGrace() time.Duration {
	if h.UploadGrace > 0 {
		return h.UploadGrace
	}
	return DefaultUploadGrace
}

func (h *Handler) uploadMinRate() int64 {
	if h.UploadMinRate > 0 {
		return h.UploadMinRate
	}
	return DefaultUploadMinRate
}

// Upload failures of the body itself.
var (
	errTooSlow    = brokererr.New(brokererr.InvalidInput, "the body arrived too slowly")
	errBodyBroken = brokererr.New(brokererr.InvalidInput, "the body could not be read to its end")
)

// uploadStatus maps a failed upload to its answer.
func uploadStatus(err error) (int, brokererr.Code, string) {
	switch err {
	case errTooSlow:
		return http.StatusRequestTimeout, brokererr.InvalidInput, errTooSlow.Message
	case errBodyBroken:
		return http.StatusBadRequest, brokererr.InvalidInput, errBodyBroken.Message
	}
	e := brokererr.As(err)
	if e == nil {
		return http.StatusInternalServerError, brokererr.InternalError, "the upload failed"
	}
	switch e.Code {
	case brokererr.FileSizeExceeded, brokererr.QuotaExceeded:
		return http.StatusRequestEntityTooLarge, e.Code, e.Message
	case brokererr.FileExists:
		return http.StatusConflict, e.Code, e.Message
	case brokererr.PathTraversal:
		return http.StatusForbidden, e.Code, e.Message
	case brokererr.SandboxNotFound, brokererr.FileNotFound:
		return http.StatusNotFound, e.Code, e.Message
	case brokererr.InvalidInput: // a parent or the target is not what it must be
		return http.StatusConflict, e.Code, e.Message
	case brokererr.Unavailable:
		return http.StatusServiceUnavailable, e.Code, e.Message
	}
	return http.StatusInternalServerError, brokererr.InternalError, "the upload failed"
}

// uploadRefused answers a verified upload that stored nothing; the
// connection closes after the answer (and after linger, where called).
func (h *Handler) uploadRefused(w http.ResponseWriter, r *http.Request, u Upload, status int, code brokererr.Code, format string, args ...any) {
	msg := brokererr.New(code, format, args...).Message
	h.log("files.upload_failed", "workspace", u.WorkspaceID, "path", u.Path, "kid", u.KID, "status", status,
		"code", string(code), "remote", r.RemoteAddr, "sig_hash", sigHash(r))
	closeConn(w)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": string(code), "message": msg})
}

// A refused upload's body is read and discarded for up to lingerTime and
// lingerBytes after the answer is sent: closing a socket with unread data
// makes the kernel send a reset, which can destroy an answer the client has
// not read yet (net/http skips its own delay for "Connection: close").
const (
	lingerTime  = 2 * time.Second
	lingerBytes = 64 << 20
)

// linger sends the answer written so far, then reads what is left of the
// body, bounded, before the connection is closed.
func linger(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	if err := rc.Flush(); err != nil {
		return
	}
	_ = rc.SetReadDeadline(time.Now().Add(lingerTime))
	_, _ = io.CopyN(io.Discard, r.Body, lingerBytes)
}

// closeConn makes net/http close the connection after the response rather
// than drain the request body to reuse it.
func closeConn(w http.ResponseWriter) {
	w.Header().Set("Connection", "close")
}

// minRateBody lets a body of any size arrive as long as it keeps an
// average rate: byte n must arrive within grace + n/rate of start, or the
// read fails with os.ErrDeadlineExceeded. A client that trickles bytes
// holds the connection no longer than the bytes it sends earn it. err is
// the read error that ended the body early, if any.
type minRateBody struct {
	r     io.Reader
	rc    *http.ResponseController
	start time.Time
	grace time.Duration
	rate  int64
	n     int64
	err   error
}

func (b *minRateBody) Read(p []byte) (int, error) {
	earned := time.Duration(b.n/b.rate)*time.Second + time.Duration(b.n%b.rate)*time.Second/time.Duration(b.rate)
	_ = b.rc.SetReadDeadline(b.start.Add(b.grace + earned))
	k, err := b.r.Read(p)
	b.n += int64(k)
	if err != nil && !errors.Is(err, io.EOF) {
		b.err = err
	}
	return k, err
}

// uploadSlots counts running uploads per workspace.
type uploadSlots struct {
	mu      sync.Mutex
	running map[string]int
}

func (s *uploadSlots) acquire(id string) (release func(), ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running[id] >= MaxUploadsPerWorkspace {
		return nil, false
	}
	if s.running == nil {
		s.running = map[string]int{}
	}
	s.running[id]++
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.running[id]--; s.running[id] == 0 {
			delete(s.running, id)
		}
	}, true
}
