// Package middleware wraps every tool handler in the same chain:
// identity → validation → rate limit → audit (intent) → handler →
// audit (outcome) → error sanitising → output redaction. Calls refused at
// validation count toward the rate limit too.
package middleware

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"
	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// MaxMessageLen caps error messages sent to the client.
const MaxMessageLen = 200

// Auditor is the audit log as the chain needs it.
type Auditor interface {
	Append(ctx context.Context, r audit.Record) (int64, error)
}

// RateLimiter is the quota store as the chain needs it.
type RateLimiter interface {
	AllowCall(ctx context.Context, principal string, l quota.Limits) (quota.Decision, error)
}

// Deps are the chain's collaborators, injected so tests use real ones.
type Deps struct {
	Specs    func(tool string) (ArgSpec, bool)
	Limits   func(identity.Principal) quota.Limits
	Limiter  RateLimiter
	Audit    Auditor
	Metrics  *Metrics
	Redactor *redact.Redactor
	Log      zerolog.Logger
	Now      func() time.Time
	// Rejections throttles audit rows of refused calls; nil writes them all.
	Rejections *RejectionThrottle
}

// call is the per-call record the stages share through the context.
type call struct {
	id        string
	tool      string
	start     time.Time
	principal string
	params    json.RawMessage
	source    audit.Source
	audited   bool // intent row written; the Audit stage owns the outcome row

	mu     sync.Mutex
	detail map[string]any // the outcome row's params (OutcomeDetail)

	beside   sync.WaitGroup // BesideOutcome's work
	panicked any            // a panic of BesideOutcome's work
}

// BesideOutcome starts f in the background, beside the rest of the
// handler and the call's outcome row, and the call's answer waits for it:
// for work the answer does not show but the caller may read next, such as
// charging a run's time (get_usage then shows it). Outside the chain it
// runs f at once.
func BesideOutcome(ctx context.Context, f func()) {
	c, ok := ctx.Value(callKey{}).(*call)
	if !ok {
		f()
		return
	}
	c.beside.Add(1)
	go func() {
		defer c.beside.Done()
		defer func() {
			if p := recover(); p != nil {
				c.mu.Lock()
				c.panicked = p
				c.mu.Unlock()
			}
		}()
		f()
	}()
}

// OutcomeDetail records what a call did beyond success or failure in its
// outcome audit row, e.g. that the work it started continues as an
// execution: key → value, which must hold no secret. Outside the chain it
// does nothing.
func OutcomeDetail(ctx context.Context, key string, value any) {
	c, ok := ctx.Value(callKey{}).(*call)
	if !ok {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.detail == nil {
		c.detail = map[string]any{}
	}
	c.detail[key] = value
}

// outcomeParams is the outcome row's params: the recorded details, or {}.
func (c *call) outcomeParams() json.RawMessage {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.detail) == 0 {
		return json.RawMessage(`{}`)
	}
	b, err := json.Marshal(c.detail)
	if err != nil {
		return json.RawMessage(`{}`)
	}
	return b
}

type callKey struct{}

type sourceKey struct{}

// WithSource records where calls on ctx arrive: the transport, and for
// HTTP the peer's address and user agent. Transports set it; every audit
// row of such a call carries it, with the MCP session and the toolset.
func WithSource(ctx context.Context, s audit.Source) context.Context {
	return context.WithValue(ctx, sourceKey{}, s)
}

// source is the audit source of a call of tool on ctx.
func (d Deps) source(ctx context.Context, tool string) audit.Source {
	s, _ := ctx.Value(sourceKey{}).(audit.Source)
	if cs := server.ClientSessionFromContext(ctx); cs != nil {
		s.MCPSession = cs.SessionID()
	}
	if spec, ok := d.Specs(tool); ok {
		s.Toolset = spec.Toolset
	}
	return s
}

// Chain returns the tool middlewares, outermost first, for
// server.WithToolHandlerMiddleware.
func Chain(d Deps) []server.ToolHandlerMiddleware {
	if d.Now == nil {
		d.Now = time.Now
	}
	return []server.ToolHandlerMiddleware{
		d.redactOutput,
		d.sanitize,
		d.observe,
		d.identity,
		d.validate,
		d.rateLimit,
		d.audit,
	}
}

// redactOutput removes secrets and token shapes from everything returned.
func (d Deps) redactOutput(next server.ToolHandlerFunc) server.ToolHandlerFunc {
	return func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		res, err := next(ctx, req)
		return RedactResult(d.Redactor, res), err
	}
}

// sanitize turns every error into a structured tool result. Only
// *brokererr.Error messages pass, redacted and capped; the rest become
// INTERNAL_ERROR with no detail.
func (d Deps) sanitize(next server.ToolHandlerFunc) server.ToolHandlerFunc {
	return func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		res, err := next(ctx, req)
		if err == nil && res != nil {
			return res, nil
		}
		if err == nil {
			err = fmt.Errorf("tool %s returned no result", req.Params.Name)
		}
		return ErrorResult(d.Redactor, err), nil
	}
}

// ErrorResult renders err as {error, message, retryable, retry_after_s?}.
// A state store that cannot be reached (PostgreSQL restarting) is
// UNAVAILABLE and retryable, whichever store call met it.
func ErrorResult(r *redact.Redactor, err error) *mcp.CallToolResult {
	e := brokererr.As(statedb.Classify(err))
	switch {
	case e != nil:
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		e = brokererr.New(brokererr.Unavailable, "the call was cancelled or timed out")
	default:
		e = brokererr.New(brokererr.InternalError, "internal error")
	}
	body := map[string]any{
		"error":     string(e.Code),
		"message":   r.Message(e.Message, MaxMessageLen),
		"retryable": e.Retryable,
	}
	if e.RetryAfter > 0 {
		body["retry_after_s"] = int64((e.RetryAfter + time.Second - 1) / time.Second)
	}
	text, _ := json.Marshal(body)
	return &mcp.CallToolResult{
		Content:           []mcp.Content{mcp.NewTextContent(string(text))},
		StructuredContent: body,
		IsError:           true,
	}
}

// observe counts, logs and, for calls refused before the Audit stage,
// writes their single audit row.
func (d Deps) observe(next server.ToolHandlerFunc) server.ToolHandlerFunc {
	return func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		c := &call{id: newCallID(), tool: req.Params.Name, start: d.Now(), params: json.RawMessage(`{}`),
			source: d.source(ctx, req.Params.Name)}
		ctx = context.WithValue(ctx, callKey{}, c)
		res, err := next(ctx, req)
		c.beside.Wait()
		if c.panicked != nil {
			d.Log.Error().Str("call_id", c.id).Str("tool", c.tool).Str("panic", fmt.Sprint(c.panicked)).Msg("beside_outcome_panic")
		}
		dur := d.since(c.start)
		outcome := classify(res, err, c.audited)
		code := brokererr.CodeOf(err)
		if !c.audited {
			d.auditRejection(ctx, c, outcome, code, dur)
		}
		d.Metrics.observe(c.tool, string(outcome), dur)
		ev := d.Log.Info()
		if outcome != audit.OutcomeSuccess {
			ev = d.Log.Warn()
		}
		ev = ev.Str("call_id", c.id).Str("tool", c.tool).Str("principal", c.principal).
			Str("outcome", string(outcome)).Str("error_code", string(code)).
			Int64("duration_ms", dur.Milliseconds())
		if cause := internalCause(err); cause != "" {
			ev = ev.Str("cause", d.Redactor.Message(cause, 300))
		}
		ev.Msg("tool_call")
		return res, err
	}
}

// since is the time from start, never negative: with an injected clock
// that steps back, a negative duration would cost the call its outcome row.
// (time.Now's monotonic reading never steps back.)
func (d Deps) since(start time.Time) time.Duration {
	return max(0, d.Now().Sub(start))
}

// internalCause is the server-side reason behind an error, for the log only.
func internalCause(err error) string {
	if err == nil {
		return ""
	}
	if e := brokererr.As(err); e != nil {
		if u := e.Unwrap(); u != nil {
			return u.Error()
		}
		return ""
	}
	return err.Error()
}

// auditRejection writes the single row of a call refused before the handler.
// Rows are throttled per principal so a flood of refused calls cannot grow
// the log without bound; the next row written carries the suppressed count.
func (d Deps) auditRejection(ctx context.Context, c *call, outcome audit.Outcome, code brokererr.Code, dur time.Duration) {
	params := c.params
	if d.Rejections != nil {
		allowed, suppressed := d.Rejections.Admit(c.principal)
		if !allowed {
			d.Metrics.auditSuppressed.Inc()
			return
		}
		if suppressed > 0 {
			params = withSuppressed(params, suppressed)
		}
	}
	rec := audit.Record{CallID: c.id, Phase: audit.PhaseOutcome, Principal: c.principal, Tool: c.tool,
		Params: params, Outcome: outcome, ErrorCode: string(code), DurationMS: dur.Milliseconds(), Source: c.source}
	if _, err := d.Audit.Append(ctx, rec); err != nil {
		d.Metrics.auditFailures.Inc()
		d.Log.Error().Str("call_id", c.id).Str("tool", c.tool).Msg("audit_write_failed")
	}
}

func withSuppressed(params json.RawMessage, n int64) json.RawMessage {
	m := map[string]any{}
	_ = json.Unmarshal(params, &m)
	m["suppressed_rejections"] = n
	b, _ := json.Marshal(m)
	return b
}

func classify(res *mcp.CallToolResult, err error, reachedHandler bool) audit.Outcome {
	switch {
	case err == nil && res != nil && !res.IsError:
		return audit.OutcomeSuccess
	case err == nil && res != nil:
		return audit.OutcomeFailure
	}
	switch brokererr.CodeOf(err) {
	case brokererr.RateLimitExceeded, brokererr.QuotaExceeded:
		return audit.OutcomeRateLimited
	case brokererr.PermissionDenied, brokererr.Unauthenticated:
		return audit.OutcomeDenied
	}
	if !reachedHandler {
		return audit.OutcomeDenied
	}
	return audit.OutcomeFailure
}

func callFrom(ctx context.Context) *call {
	if c, ok := ctx.Value(callKey{}).(*call); ok {
		return c
	}
	return &call{}
}

// identity refuses calls that no transport authenticated.
func (d Deps) identity(next server.ToolHandlerFunc) server.ToolHandlerFunc {
	return func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		p, ok := identity.FromContext(ctx)
		if !ok {
			return nil, brokererr.New(brokererr.Unauthenticated, "the call carries no authenticated principal")
		}
		callFrom(ctx).principal = p.ID
		return next(ctx, req)
	}
}

// validate decodes the arguments strictly into the tool's struct, checks
// them, and hands the typed value to the handler through the context. A
// refused call still counts toward the caller's rate limit (nothing else
// happens for it), so a flood of invalid calls meets RATE_LIMIT_EXCEEDED
// like any other flood.
func (d Deps) validate(next server.ToolHandlerFunc) server.ToolHandlerFunc {
	return func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		v, err := d.decodeArgs(ctx, req)
		if err != nil {
			if lerr := d.allowCall(ctx, req.Params.Name); lerr != nil {
				return nil, lerr
			}
			return nil, err
		}
		return next(context.WithValue(ctx, argsKey{}, v), req)
	}
}

func (d Deps) decodeArgs(ctx context.Context, req mcp.CallToolRequest) (any, error) {
	spec, ok := d.Specs(req.Params.Name)
	if !ok {
		return nil, fmt.Errorf("tool %q has no argument spec", req.Params.Name)
	}
	raw, err := rawArguments(req)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.InvalidInput, "arguments could not be read")
	}
	if len(raw) > spec.MaxBytes {
		return nil, brokererr.New(brokererr.InvalidInput, "arguments are %d bytes; this tool accepts at most %d", len(raw), spec.MaxBytes)
	}
	v, err := spec.decode(raw)
	if err != nil {
		return nil, err
	}
	if b, err := json.Marshal(redactParams(d.Redactor, spec.summary(v))); err == nil {
		callFrom(ctx).params = b
	}
	return v, nil
}

func redactParams(r *redact.Redactor, m map[string]any) any {
	b, err := json.Marshal(m)
	if err != nil {
		return map[string]any{}
	}
	var generic any
	_ = json.Unmarshal(b, &generic)
	return r.Value(generic)
}

// rateLimit applies the principal's calls-per-minute limit, persisted in
// SQLite so a restart does not reset it.
func (d Deps) rateLimit(next server.ToolHandlerFunc) server.ToolHandlerFunc {
	return func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		if err := d.allowCall(ctx, req.Params.Name); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

// allowCall takes one call from the principal's per-minute budget.
func (d Deps) allowCall(ctx context.Context, tool string) error {
	p, _ := identity.FromContext(ctx)
	dec, err := d.Limiter.AllowCall(ctx, p.ID, d.Limits(p))
	if err != nil {
		return unavailable(err, "rate limiter unavailable; try again")
	}
	if !dec.Allowed {
		d.Metrics.rateLimited.WithLabelValues(tool).Inc()
		return brokererr.New(brokererr.RateLimitExceeded,
			"rate limit of %d calls per minute reached", dec.Limit).WithRetryAfter(dec.RetryAfter)
	}
	return nil
}

// audit writes the intent before the handler runs and the outcome after.
// If the intent cannot be written the handler never runs.
func (d Deps) audit(next server.ToolHandlerFunc) server.ToolHandlerFunc {
	return func(ctx context.Context, req mcp.CallToolRequest) (res *mcp.CallToolResult, err error) {
		c := callFrom(ctx)
		intent := audit.Record{CallID: c.id, Phase: audit.PhaseIntent, Principal: c.principal, Tool: c.tool, Params: c.params, Source: c.source}
		if _, aerr := d.Audit.Append(ctx, intent); aerr != nil {
			d.Metrics.auditFailures.Inc()
			d.Log.Error().Str("call_id", c.id).Str("tool", c.tool).Msg("audit_intent_failed")
			return nil, unavailable(aerr, "the audit log is unavailable, so the call was refused")
		}
		c.audited = true
		res, err = d.runHandler(ctx, next, req)
		out := audit.Record{CallID: c.id, Phase: audit.PhaseOutcome, Principal: c.principal, Tool: c.tool,
			Params: c.outcomeParams(), Outcome: classify(res, err, true), ErrorCode: string(brokererr.CodeOf(err)),
			DurationMS: d.since(c.start).Milliseconds(), Source: c.source}
		// The outcome row uses a context that outlives a cancelled call.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, aerr := d.Audit.Append(actx, out); aerr != nil {
			d.Metrics.auditFailures.Inc()
			d.Log.Error().Str("call_id", c.id).Str("tool", c.tool).Msg("audit_outcome_failed")
		}
		return res, err
	}
}

// sqliteFull is SQLite's SQLITE_FULL result code.
const sqliteFull = 13

// unavailable refuses a call because a store it must write failed. A full
// disk is named as such: nothing runs until space is freed, and retrying
// then succeeds.
func unavailable(err error, msg string) error {
	var coded interface{ Code() int }
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) ||
		(errors.As(err, &coded) && coded.Code()&0xff == sqliteFull) {
		msg = "the broker's storage is full, so the call was refused"
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "%s", msg)
}

// runHandler converts a handler panic into an internal error, so the outcome
// row is still written and the server keeps serving.
func (d Deps) runHandler(ctx context.Context, next server.ToolHandlerFunc, req mcp.CallToolRequest) (res *mcp.CallToolResult, err error) {
	defer func() {
		if r := recover(); r != nil {
			d.Log.Error().Str("tool", req.Params.Name).Str("stack", string(debug.Stack())).Msg("tool_panic")
			res, err = nil, fmt.Errorf("tool %s panicked", req.Params.Name)
		}
	}()
	return next(ctx, req)
}

func newCallID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "call_" + hex.EncodeToString(b[:])
}
