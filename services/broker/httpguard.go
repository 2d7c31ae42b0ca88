package broker

import (
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/connguard"
	"github.com/sandbox-broker/sandbox-broker/services/oauth"
)

// Limits on what refused HTTP requests may cost (SECURITY.md, Transport
// hardening). Connection caps are in services/connguard.
const (
	// Requests without a valid token per client address (connguard.AddrKey):
	// past this rate they get 429 instead of 401.
	unauthPerSecond = 10
	unauthBurst     = 50
	// Log lines per kind of refusal: past this rate they are counted, and the
	// next line written says how many were suppressed.
	refusalLogsPerSecond = 5
	refusalLogBurst      = 50
)

// httpRefusals throttles refused HTTP requests.
type httpRefusals struct {
	unauth *middleware.RejectionThrottle // keyed by client address
	logs   *middleware.RejectionThrottle // keyed by event name
}

func newHTTPRefusals() *httpRefusals {
	return &httpRefusals{
		unauth: middleware.NewRejectionThrottle(unauthPerSecond, unauthBurst),
		logs:   middleware.NewRejectionThrottle(refusalLogsPerSecond, refusalLogBurst),
	}
}

// refusalLog starts the log line for one refused request, or returns nil
// (zerolog's no-op event) past refusalLogsPerSecond for this event.
func (b *Broker) refusalLog(event string, level func() *zerolog.Event) *zerolog.Event {
	ok, suppressed := b.refusals.logs.Admit(event)
	if !ok {
		return nil
	}
	ev := level()
	if suppressed > 0 {
		ev = ev.Int64("suppressed", suppressed)
	}
	return ev
}

// unauthorized answers a request without a valid bearer token: 401 with a
// challenge, or 429 past the client address's rate, and the connection is
// closed after it without reading the request body.
func (b *Broker) unauthorized(w http.ResponseWriter, r *http.Request, tokenPresent bool, tokenErr *oauth.TokenError) {
	closeConn(w)
	if ok, _ := b.refusals.unauth.Admit(connguard.AddrKey(r.RemoteAddr)); !ok {
		b.refusalLog("auth_rejected", b.log.Warn).Bool("rate_limited", true).Msg("auth_rejected")
		w.Header().Set("Retry-After", "1")
		writeJSON(w, http.StatusTooManyRequests, map[string]string{"error": "RATE_LIMIT_EXCEEDED", "message": "too many unauthenticated requests from this address"})
		return
	}
	challenge, status := b.challenge(tokenPresent, tokenErr)
	w.Header().Set("WWW-Authenticate", challenge)
	b.refusalLog("auth_rejected", b.log.Warn).Str("path", r.URL.Path).Bool("token_present", tokenPresent).Msg("auth_rejected")
	writeJSON(w, status, map[string]string{"error": "UNAUTHENTICATED", "message": "a valid bearer token is required"})
}

// closeConn makes net/http close the connection after this response rather
// than read the rest of the request body to reuse it.
func closeConn(w http.ResponseWriter) {
	w.Header().Set("Connection", "close")
}

// boundBody gives a request body the body timeout to arrive, and never lets
// net/http drain what a handler left unread: once the handler returns, an
// unread body ends the connection at once, so a client trickling a body
// (to a refusal, /healthz or anything else) holds nothing.
func (b *Broker) boundBody(next http.Handler) http.Handler {
	timeout := time.Duration(b.cfg.BodyTimeoutS) * time.Second
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody {
			next.ServeHTTP(w, r)
			return
		}
		rc := http.NewResponseController(w)
		_ = rc.SetReadDeadline(time.Now().Add(timeout))
		body := &deadlineBody{ReadCloser: r.Body, rc: rc}
		r.Body = body
		next.ServeHTTP(w, r)
		if !body.done.Load() {
			_ = rc.SetReadDeadline(time.Now())
		}
	})
}

// deadlineBody records that the whole body was read and lifts the read
// deadline then, so a response that streams on (SSE) is not cut by it
// (net/http's own background read happens to lift it too; this does not
// rely on that).
type deadlineBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	done atomic.Bool
}

func (d *deadlineBody) Read(p []byte) (int, error) {
	n, err := d.ReadCloser.Read(p)
	if err == io.EOF && d.done.CompareAndSwap(false, true) {
		_ = d.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}
