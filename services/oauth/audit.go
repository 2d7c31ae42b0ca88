package oauth

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"time"

	"github.com/sandbox-broker/sandbox-broker/audit"
)

// Auditor is the audit log as this package needs it.
type Auditor interface {
	Append(ctx context.Context, r audit.Record) (int64, error)
}

// Throttle bounds audit rows of refused requests per key (see
// middleware.RejectionThrottle); nil writes them all.
type Throttle interface {
	Admit(key string) (allowed bool, suppressed int64)
}

// event is one audited OAuth action. Like a tool call, an action with an
// effect writes an intent row before the effect (no row, no effect) and an
// outcome row after; a request refused before any effect writes one
// outcome row, throttled so a flood cannot grow the log without bound.
// Params never hold a token, code, secret or verifier.
type event struct {
	log       Auditor
	throttle  Throttle
	onFailure func(tool string)
	id        string
	tool      string
	start     time.Time
	principal string
	params    map[string]any // the intent row's, or the single row's
	late      map[string]any // learnt after the intent row, for the outcome row
	intent    bool
	ended     bool
}

type eventKey struct{}

func (s *Server) newEvent(tool string) *event {
	return newEvent(s.cfg.Audit, s.cfg.Throttle, s.auditFailed, tool)
}

func newEvent(log Auditor, th Throttle, onFailure func(string), tool string) *event {
	var b [8]byte
	_, _ = rand.Read(b[:])
	if onFailure == nil {
		onFailure = func(string) {}
	}
	return &event{log: log, throttle: th, onFailure: onFailure, id: "oauth-" + hex.EncodeToString(b[:]),
		tool: tool, start: time.Now(), params: map[string]any{}}
}

// AuditRefusal writes the throttled audit row of a bearer token the
// resource refused (tool "oauth.bearer"). It reports whether a write failed.
func AuditRefusal(ctx context.Context, log Auditor, th Throttle, e *TokenError, path string) (failed bool) {
	ev := newEvent(log, th, func(string) { failed = true }, "oauth.bearer")
	code := "invalid_token"
	if e.Scope != "" {
		code = "insufficient_scope"
	}
	ev.reject(ctx, code, map[string]any{"reason": e.Reason, "path": truncate(path, 64)})
	return failed
}

func withEvent(ctx context.Context, e *event) context.Context {
	return context.WithValue(ctx, eventKey{}, e)
}

// eventFrom returns the action on ctx (nil outside an audited handler).
func eventFrom(ctx context.Context) *event {
	e, _ := ctx.Value(eventKey{}).(*event)
	return e
}

// set adds params to the row still to be written. Safe on a nil event.
func (e *event) set(params map[string]any) {
	if e == nil {
		return
	}
	dst := e.params
	if e.intent {
		if e.late == nil {
			e.late = map[string]any{}
		}
		dst = e.late
	}
	for k, v := range params {
		dst[k] = v
	}
}

func paramsJSON(m map[string]any) json.RawMessage {
	if len(m) == 0 {
		return json.RawMessage(`{}`)
	}
	b, err := json.Marshal(m)
	if err != nil {
		return json.RawMessage(`{}`)
	}
	return b
}

// begin writes the intent row; an error means the effect must not happen.
func (e *event) begin(ctx context.Context, principal string, params map[string]any) error {
	if e == nil {
		return errors.New("oauth: no audited action on the context")
	}
	e.principal = principal
	e.set(params)
	_, err := e.log.Append(ctx, audit.Record{CallID: e.id, Phase: audit.PhaseIntent, Principal: e.principal, Tool: e.tool, Params: paramsJSON(e.params)})
	if err != nil {
		e.onFailure(e.tool)
		return err
	}
	e.intent = true
	return nil
}

// end writes the outcome row once. code is the OAuth error code, "" on success.
func (e *event) end(ctx context.Context, outcome audit.Outcome, code string, params map[string]any) {
	if e == nil || e.ended {
		return
	}
	e.set(params)
	e.ended = true
	rec := audit.Record{CallID: e.id, Phase: audit.PhaseOutcome, Principal: e.principal, Tool: e.tool,
		Outcome: outcome, ErrorCode: code, DurationMS: time.Since(e.start).Milliseconds()}
	if e.intent {
		rec.Params = paramsJSON(e.late)
	} else {
		if outcome != audit.OutcomeSuccess && e.throttle != nil {
			ok, suppressed := e.throttle.Admit(e.tool)
			if !ok {
				return
			}
			if suppressed > 0 {
				e.params["suppressed_rejections"] = suppressed
			}
		}
		rec.Params = paramsJSON(e.params)
	}
	// The row outlives a client that hung up.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := e.log.Append(actx, rec); err != nil {
		e.onFailure(e.tool)
	}
}

// reject records a request refused before any effect.
func (e *event) reject(ctx context.Context, code string, params map[string]any) {
	outcome := audit.OutcomeDenied
	if code == "temporarily_unavailable" {
		outcome = audit.OutcomeRateLimited
	}
	e.end(ctx, outcome, code, params)
}

// recorder buffers a response so it can be audited before it is sent: a
// token that cannot be audited is never delivered. OAuth responses are
// small (a few KB).
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func newRecorder() *recorder { return &recorder{header: http.Header{}} }

func (r *recorder) Header() http.Header { return r.header }
func (r *recorder) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
}
func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.body.Write(p)
}

func (r *recorder) flush(w http.ResponseWriter) {
	for k, v := range r.header {
		w.Header()[k] = v
	}
	if r.status == 0 {
		r.status = http.StatusOK
	}
	w.WriteHeader(r.status)
	_, _ = w.Write(r.body.Bytes())
}

// oauthError reads the error code of a buffered response: the JSON body of
// a token or revocation error, or the error parameter of a redirect.
func (r *recorder) oauthError() string {
	if r.status >= 300 && r.status < 400 {
		if u, err := url.Parse(r.header.Get("Location")); err == nil {
			if q, err := url.ParseQuery(u.RawQuery); err == nil && q.Get("error") != "" {
				return q.Get("error")
			}
		}
		return ""
	}
	if r.status < 400 {
		return ""
	}
	var e struct {
		Error string `json:"error"`
	}
	if json.Unmarshal(r.body.Bytes(), &e) == nil && e.Error != "" && len(e.Error) <= 64 {
		return e.Error
	}
	return "invalid_request"
}

// audited runs h with an action on its context, buffers the response, and
// writes the outcome row before the response leaves.
func (s *Server) audited(tool string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ev := s.newEvent(tool)
		rec := newRecorder()
		h.ServeHTTP(rec, r.WithContext(withEvent(r.Context(), ev)))
		code := rec.oauthError()
		switch {
		case code == "" && ev.intent:
			ev.end(r.Context(), audit.OutcomeSuccess, "", nil)
		case code == "":
			// Nothing happened worth a row (the authorize step that shows consent).
		case code == "server_error":
			ev.end(r.Context(), audit.OutcomeFailure, code, nil)
		default:
			ev.reject(r.Context(), code, nil)
		}
		rec.flush(w)
	})
}
