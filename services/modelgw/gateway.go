// Package modelgw is the broker's model gateway: the only way a coding
// agent in a sandbox reaches a model. The agent's ANTHROPIC_BASE_URL names
// the gateway (reached through its job's egress socket, see Serve), and it
// holds only a placeholder key. The gateway checks each request against
// an allow-list of paths and models and a size cap, charges it to the
// principal's daily request and token budgets (tokens counted from the
// answer's usage, streamed or not), writes an audit row with the model and
// token counts (never the prompt or a key), and forwards it to the
// upstream API with the operator's key, which never enters a sandbox.
package modelgw

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Paths the gateway forwards, with the audit name of each.
var paths = map[string]string{
	"/v1/messages":              "model.messages",
	"/v1/messages/count_tokens": "model.count_tokens",
}

// Request headers passed upstream; everything else (any key the agent
// sent included) is dropped.
var forwardRequest = []string{"anthropic-version", "anthropic-beta", "content-type", "accept", "user-agent"}

// Response headers passed back to the agent.
var forwardResponse = []string{"content-type", "request-id", "retry-after", "retry-after-ms", "x-should-retry"}

// Auditor is the audit log as the gateway needs it.
type Auditor interface {
	Append(ctx context.Context, r audit.Record) (int64, error)
}

// Options configure a Gateway.
type Options struct {
	// Upstream is the API's base URL (ANTHROPIC_API_URL), without /v1.
	Upstream string
	// Key returns the API key a principal's calls are made with; "" means
	// it has none.
	Key    func(principal string) string
	Models []string // the models agents may call
	// MaxRequestBytes caps a request body.
	MaxRequestBytes int64
	Budget          *Budget
	Audit           Auditor
	// Client reaches the upstream; default a transport with timeouts that
	// ignores the broker's proxy variables.
	Client *http.Client
	// CallTimeout bounds one call, streamed answer included (default 15 min).
	CallTimeout time.Duration
	Log         zerolog.Logger
}

// Gateway forwards agents' model calls.
type Gateway struct {
	o        Options
	upstream *url.URL
}

// New validates o.
func New(o Options) (*Gateway, error) {
	u, err := url.Parse(strings.TrimSuffix(o.Upstream, "/"))
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.RawQuery != "" || u.User != nil {
		return nil, errors.New("modelgw: the upstream must be an http(s) URL without query or user info")
	}
	if o.Key == nil || o.Budget == nil || o.Audit == nil {
		return nil, errors.New("modelgw: Key, Budget and Audit are required")
	}
	if len(o.Models) == 0 {
		return nil, errors.New("modelgw: no model is allowed")
	}
	if o.MaxRequestBytes <= 0 {
		o.MaxRequestBytes = 8 << 20
	}
	if o.CallTimeout <= 0 {
		o.CallTimeout = 15 * time.Minute
	}
	if o.Client == nil {
		o.Client = &http.Client{Transport: &http.Transport{
			Proxy:                 nil,
			DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
			TLSHandshakeTimeout:   10 * time.Second,
			ResponseHeaderTimeout: 10 * time.Minute,
			MaxIdleConnsPerHost:   32,
			IdleConnTimeout:       90 * time.Second,
			ForceAttemptHTTP2:     true,
		}}
	}
	return &Gateway{o: o, upstream: u}, nil
}

// Caller is whom one task's model calls are charged to.
type Caller struct {
	Principal string
	Limits    Limits
	SessionID string
	// ExecutionID names the task's execution in audit rows.
	ExecutionID string
	// OnRefused, when set, hears of every call the gateway refused with the
	// broker's error (QUOTA_EXCEEDED when a budget is used up).
	OnRefused func(*brokererr.Error)
}

// CheckBudget refuses with QUOTA_EXCEEDED when c's budgets are used up,
// so a task that could make no model call is not started.
func (g *Gateway) CheckBudget(ctx context.Context, principal string, l Limits) error {
	s, err := g.o.Budget.Check(ctx, principal, l)
	if err != nil {
		return brokererr.Wrap(err, brokererr.Unavailable, "the model budget store is unavailable")
	}
	if s.Exhausted != "" {
		return budgetError(s, l)
	}
	if g.o.Key(principal) == "" {
		return brokererr.New(brokererr.PermissionDenied, "no model API key is configured for your principal")
	}
	return nil
}

func budgetError(s Spent, l Limits) *brokererr.Error {
	msg := fmt.Sprintf("today's model request budget (%d requests) is used up", l.RequestsPerDay)
	if s.Exhausted == "tokens" {
		msg = fmt.Sprintf("today's model token budget (%d tokens) is used up", l.TokensPerDay)
	}
	return brokererr.New(brokererr.QuotaExceeded, "%s", msg).WithRetryAfter(s.RetryAfter)
}

// Handler serves c's model calls.
func (g *Gateway) Handler(c Caller) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { g.serve(w, r, c) })
}

// apiError answers in the Messages API's error shape, which agents
// understand; x-should-retry tells the SDKs whether to retry.
func apiError(w http.ResponseWriter, status int, typ, msg string, retry bool, retryAfter time.Duration) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("x-should-retry", strconv.FormatBool(retry))
	if retryAfter > 0 {
		h.Set("retry-after", strconv.FormatInt(int64((retryAfter+time.Second-1)/time.Second), 10))
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"type": "error", "error": map[string]string{"type": typ, "message": msg}})
}

// call is one audited model call.
type call struct {
	g      *Gateway
	c      Caller
	id     string
	tool   string
	start  time.Time
	params map[string]any
	intent bool
}

func (g *Gateway) newCall(c Caller, tool string) *call {
	var b [8]byte
	_, _ = rand.Read(b[:])
	p := map[string]any{"session_id": c.SessionID, "execution_id": c.ExecutionID}
	return &call{g: g, c: c, id: "model-" + hex.EncodeToString(b[:]), tool: tool, start: time.Now(), params: p}
}

func rawParams(m map[string]any) json.RawMessage {
	b, err := json.Marshal(m)
	if err != nil {
		return json.RawMessage(`{}`)
	}
	return b
}

// begin writes the intent row; without it the call is not made.
func (k *call) begin(ctx context.Context) error {
	_, err := k.g.o.Audit.Append(ctx, audit.Record{CallID: k.id, Phase: audit.PhaseIntent, Principal: k.c.Principal,
		Tool: k.tool, Params: rawParams(k.params)})
	k.intent = err == nil
	return err
}

// end writes the outcome row (the only row of a call refused before its
// intent row).
func (k *call) end(ctx context.Context, outcome audit.Outcome, code brokererr.Code, extra map[string]any) {
	p := extra
	if !k.intent {
		p = k.params
		for key, v := range extra {
			p[key] = v
		}
	}
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := k.g.o.Audit.Append(actx, audit.Record{CallID: k.id, Phase: audit.PhaseOutcome, Principal: k.c.Principal,
		Tool: k.tool, Params: rawParams(p), Outcome: outcome, ErrorCode: string(code), DurationMS: time.Since(k.start).Milliseconds()}); err != nil {
		k.g.o.Log.Error().Str("call_id", k.id).Msg("model_call_audit_failed")
	}
}

// refuse answers a call the gateway will not make, audits it and tells
// the task.
func (k *call) refuse(w http.ResponseWriter, r *http.Request, status int, typ string, e *brokererr.Error, outcome audit.Outcome) {
	apiError(w, status, typ, e.Message, false, e.RetryAfter)
	k.end(r.Context(), outcome, e.Code, nil)
	if k.c.OnRefused != nil {
		k.c.OnRefused(e)
	}
}

func (g *Gateway) serve(w http.ResponseWriter, r *http.Request, c Caller) {
	tool, ok := paths[r.URL.Path]
	if !ok || (r.URL.Host != "" && !IsGatewayHost(r.URL.Host)) {
		// Not a model call at all: answered, not audited row by row (the
		// sandbox could flood the log), like egress refusals.
		w.Header().Set("Connection", "close")
		apiError(w, http.StatusNotFound, "not_found_error", "the model gateway serves only POST /v1/messages and /v1/messages/count_tokens", false, 0)
		return
	}
	k := g.newCall(c, tool)
	if r.Method != http.MethodPost {
		k.refuse(w, r, http.StatusMethodNotAllowed, "invalid_request_error", brokererr.New(brokererr.InvalidInput, "the model gateway accepts only POST"), audit.OutcomeDenied)
		return
	}
	if q := r.URL.RawQuery; q != "" && q != "beta=true" {
		k.refuse(w, r, http.StatusBadRequest, "invalid_request_error", brokererr.New(brokererr.InvalidInput, "the model gateway accepts no query other than beta=true"), audit.OutcomeDenied)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, g.o.MaxRequestBytes+1))
	if err != nil {
		apiError(w, http.StatusBadRequest, "invalid_request_error", "the request body could not be read", false, 0)
		return
	}
	k.params["request_bytes"] = len(body)
	if int64(len(body)) > g.o.MaxRequestBytes {
		k.refuse(w, r, http.StatusRequestEntityTooLarge, "request_too_large",
			brokererr.New(brokererr.InvalidInput, "the request is larger than the gateway's limit of %d bytes", g.o.MaxRequestBytes), audit.OutcomeDenied)
		return
	}
	var head struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
	}
	if err := json.Unmarshal(body, &head); err != nil {
		k.refuse(w, r, http.StatusBadRequest, "invalid_request_error", brokererr.New(brokererr.InvalidInput, "the request body is not a JSON object"), audit.OutcomeDenied)
		return
	}
	k.params["model"] = truncate(head.Model, 64)
	k.params["stream"] = head.Stream
	if !slices.Contains(g.o.Models, head.Model) {
		k.refuse(w, r, http.StatusForbidden, "permission_error",
			brokererr.New(brokererr.PermissionDenied, "model %q is not allowed here; allowed: %s", truncate(head.Model, 64), strings.Join(g.o.Models, ", ")), audit.OutcomeDenied)
		return
	}
	key := g.o.Key(c.Principal)
	if key == "" {
		k.refuse(w, r, http.StatusForbidden, "permission_error", brokererr.New(brokererr.PermissionDenied, "no model API key is configured for this principal"), audit.OutcomeDenied)
		return
	}
	spent, err := g.o.Budget.Take(r.Context(), c.Principal, c.Limits)
	if err != nil {
		apiError(w, http.StatusServiceUnavailable, "api_error", "the broker's budget store is unavailable", true, time.Second)
		k.end(r.Context(), audit.OutcomeFailure, brokererr.Unavailable, nil)
		return
	}
	if spent.Exhausted != "" {
		k.refuse(w, r, http.StatusTooManyRequests, "rate_limit_error", budgetError(spent, c.Limits), audit.OutcomeRateLimited)
		return
	}
	if err := k.begin(r.Context()); err != nil {
		apiError(w, http.StatusServiceUnavailable, "api_error", "the broker could not audit the call", true, time.Second)
		return
	}
	g.forward(w, r, k, key, body)
}

// forward makes the call upstream and streams the answer back, metering
// its usage on the way.
func (g *Gateway) forward(w http.ResponseWriter, r *http.Request, k *call, key string, body []byte) {
	ctx, cancel := context.WithTimeout(r.Context(), g.o.CallTimeout)
	defer cancel()
	u := *g.upstream
	u.Path = g.upstream.Path + r.URL.Path
	u.RawQuery = r.URL.RawQuery
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		apiError(w, http.StatusInternalServerError, "api_error", "the gateway could not build the request", false, 0)
		k.end(r.Context(), audit.OutcomeFailure, brokererr.InternalError, nil)
		return
	}
	for _, h := range forwardRequest {
		if v := r.Header.Values(h); len(v) > 0 {
			req.Header[http.CanonicalHeaderKey(h)] = slices.Clone(v)
		}
	}
	req.Header.Set("x-api-key", key)
	resp, err := g.o.Client.Do(req)
	if err != nil {
		g.o.Log.Warn().Str("call_id", k.id).Str("cause", errClass(err)).Msg("model_upstream_failed")
		apiError(w, http.StatusBadGateway, "api_error", "the model API could not be reached", true, 0)
		k.end(r.Context(), audit.OutcomeFailure, brokererr.Unavailable, map[string]any{"status": http.StatusBadGateway})
		return
	}
	defer resp.Body.Close()
	for _, h := range forwardResponse {
		if v := resp.Header.Values(h); len(v) > 0 {
			w.Header()[http.CanonicalHeaderKey(h)] = slices.Clone(v)
		}
	}
	for h, v := range resp.Header {
		if strings.HasPrefix(strings.ToLower(h), "anthropic-ratelimit-") {
			w.Header()[h] = slices.Clone(v)
		}
	}
	w.WriteHeader(resp.StatusCode)
	m := &meter{stream: strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")}
	copyErr := copyFlush(w, io.TeeReader(resp.Body, m))
	use, known := m.Result()
	if resp.StatusCode != http.StatusOK {
		use, known = Usage{}, true // an error answer is not charged
	}
	if err := g.o.Budget.AddTokens(context.WithoutCancel(r.Context()), k.c.Principal, use.Total()); err != nil {
		g.o.Log.Error().Str("call_id", k.id).Msg("model_budget_write_failed")
	}
	out := map[string]any{"model": k.params["model"], "status": resp.StatusCode,
		"input_tokens": use.InputTokens, "output_tokens": use.OutputTokens,
		"cache_creation_input_tokens": use.CacheCreationInputTokens, "cache_read_input_tokens": use.CacheReadInputTokens}
	if !known {
		out["usage_unknown"] = true
		g.o.Log.Warn().Str("call_id", k.id).Msg("model_usage_unknown")
	}
	outcome, code := audit.OutcomeSuccess, brokererr.Code("")
	switch {
	case copyErr != nil:
		outcome, code = audit.OutcomeFailure, brokererr.Unavailable
		out["stream_cut"] = true
	case resp.StatusCode == http.StatusTooManyRequests:
		outcome, code = audit.OutcomeRateLimited, brokererr.RateLimitExceeded
	case resp.StatusCode != http.StatusOK:
		outcome, code = audit.OutcomeFailure, upstreamCode(resp.StatusCode)
	}
	k.end(r.Context(), outcome, code, out)
}

// upstreamCode maps an upstream error status to the broker's vocabulary.
func upstreamCode(status int) brokererr.Code {
	switch {
	case status == http.StatusUnauthorized || status == http.StatusForbidden:
		return brokererr.PermissionDenied
	case status >= 500:
		return brokererr.Unavailable
	}
	return brokererr.InvalidInput
}

// copyFlush copies src to w, flushing after each read so a streamed
// answer reaches the agent as it comes.
func copyFlush(w http.ResponseWriter, src io.Reader) error {
	fl, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// errClass names an upstream failure without its text (which may carry
// the upstream URL).
func errClass(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "cancelled"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return "connection"
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
