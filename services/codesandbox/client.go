// Package codesandbox is the hosted project provider: a client for the
// CodeSandbox management API (REST, bearer key), a client for the in-VM
// Pitcher agent (WebSocket + msgpack), and a projects.Provider built on
// both. All CodeSandbox types stay in this package (the product is in
// wind-down; see codesandbox-api.md §0), so another hosted back end can
// replace it behind projects.Provider.
package codesandbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// DefaultBaseURL is the management API of csb_ keys.
const DefaultBaseURL = "https://api.codesandbox.io"

// TogetherBaseURL is where the SDK sends keys that do not start with
// "csb_" (Together-issued keys, codesandbox-api.md §0).
const TogetherBaseURL = "https://api.together.ai/csb/sdk"

const (
	defaultTimeout      = 30 * time.Second
	defaultMaxRetries   = 3
	defaultRetryBase    = 200 * time.Millisecond
	defaultMaxRetryWait = 10 * time.Second
	// maxResponseBytes bounds a management API body; the largest real one
	// (a 50-item sandbox list) is far below this.
	maxResponseBytes = 4 << 20
	// slowTimeoutFactor stretches the per-attempt timeout of hibernate and
	// shutdown, which "can take ~30 s" (§2.1).
	slowTimeoutFactor = 2
	// fallbackRetryAfter is reported when a 429 names no reset: the VM
	// budget frees up when another VM stops, and /vm/running is refreshed
	// about every 30 s (§2.1).
	fallbackRetryAfter = 30 * time.Second
)

// Options configure the management API client.
type Options struct {
	BaseURL    string        // CSB_API_URL; default DefaultBaseURL (TogetherBaseURL for keys without "csb_")
	APIKey     string        // CSB_API_KEY; required
	HTTP       *http.Client  // default: a client that follows no redirects
	Timeout    time.Duration // per attempt; default 30s (doubled for hibernate and shutdown)
	MaxRetries int           // retries after the first attempt; default 3, <0 for none
	Log        zerolog.Logger

	// RetryBase is the first backoff step, doubled per retry with jitter
	// (default 200ms). MaxRetryWait is the longest single wait: a 429 whose
	// reset is further away is returned at once (default 10s).
	RetryBase    time.Duration
	MaxRetryWait time.Duration
}

// Client calls the CodeSandbox management API.
type Client struct {
	base    *url.URL
	key     string
	http    *http.Client
	timeout time.Duration
	retries int
	step    time.Duration
	maxWait time.Duration
	log     zerolog.Logger
}

// New checks o and returns a client. It makes no call.
func New(o Options) (*Client, error) {
	if strings.TrimSpace(o.APIKey) == "" {
		return nil, errors.New("codesandbox: APIKey is required")
	}
	if o.BaseURL == "" {
		o.BaseURL = DefaultBaseURL
		if !strings.HasPrefix(o.APIKey, "csb_") {
			o.BaseURL = TogetherBaseURL
		}
	}
	base, err := parseBaseURL(o.BaseURL)
	if err != nil {
		return nil, err
	}
	c := &Client{
		base:    base,
		key:     o.APIKey,
		http:    o.HTTP,
		timeout: o.Timeout,
		retries: o.MaxRetries,
		step:    o.RetryBase,
		maxWait: o.MaxRetryWait,
		log:     o.Log.With().Str("component", "codesandbox").Logger(),
	}
	if c.http == nil {
		c.http = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if c.timeout <= 0 {
		c.timeout = defaultTimeout
	}
	switch {
	case c.retries == 0:
		c.retries = defaultMaxRetries
	case c.retries < 0:
		c.retries = 0
	}
	if c.step <= 0 {
		c.step = defaultRetryBase
	}
	if c.maxWait <= 0 {
		c.maxWait = defaultMaxRetryWait
	}
	return c, nil
}

// parseBaseURL accepts https, or http to a loopback host (test fakes): the
// bearer key never crosses a network in clear text.
func parseBaseURL(s string) (*url.URL, error) {
	u, err := url.Parse(strings.TrimRight(s, "/"))
	if err != nil || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return nil, errors.New("codesandbox: BaseURL must be an absolute URL without credentials, query or fragment")
	}
	switch u.Scheme {
	case "https":
	case "http":
		if !config.IsLoopbackHost(u.Hostname()) {
			return nil, errors.New("codesandbox: BaseURL must use https (http only for loopback)")
		}
	default:
		return nil, errors.New("codesandbox: BaseURL must use https")
	}
	return u, nil
}

// Sandbox IDs go into URL paths, so they are checked, never escaped into
// something else: real IDs are short lowercase alphanumerics (§2.4).
var sandboxIDRe = regexp.MustCompile(`^[a-z0-9]{1,32}$`)

// Template references may also be tags (pt_…) or aliases (namespace@alias).
var templateRefRe = regexp.MustCompile(`^[A-Za-z0-9_@-][A-Za-z0-9_.@-]{0,127}$`)

// ValidTemplateRef reports whether s has the form of a template
// reference fork accepts (sandbox ID, tag or alias).
func ValidTemplateRef(s string) bool {
	return templateRefRe.MatchString(s) && !strings.Contains(s, "..")
}

// ValidSandboxID reports whether id has the form of a CodeSandbox ID.
func ValidSandboxID(id string) bool { return sandboxIDRe.MatchString(id) }

func checkID(id string) error {
	if !ValidSandboxID(id) {
		return brokererr.New(brokererr.SandboxNotFound, "no sandbox with that ID")
	}
	return nil
}

// call is one management API request.
type call struct {
	method, path string
	query        url.Values
	body         any
	// idempotent calls are retried on 5xx and transport errors too; the
	// others (fork) only on a 429 that refused the request as a whole. A
	// 429 for the concurrent-VM budget is not retried for them: the
	// reference does not say whether a fork with start_options made the
	// sandbox before its VM was refused, and a retry could make a second.
	idempotent bool
	// notFound says what a 404 means: a missing sandbox (calls on
	// /sandbox/{id} and /vm/{id}), a missing template (fork), or, for
	// calls that name no sandbox, a missing endpoint (a wrong CSB_API_URL).
	notFound notFoundKind
	// slow calls get a longer per-attempt timeout.
	slow bool
	// bare responses are the payload itself, not an envelope (/meta/info).
	bare bool
}

type notFoundKind int

const (
	notFoundEndpoint notFoundKind = iota
	notFoundSandbox
	notFoundTemplate
)

// response is one attempt's outcome.
type response struct {
	status int
	header http.Header
	body   []byte
}

// MetaInfo returns the key's team, scopes and rate limits. It is the
// cheapest authenticated call. Its body is a bare MetaInformation (see
// MetaInfo); an enveloped one is read too, since no source says what the
// live service sends and Ping must not hinge on it.
func (c *Client) MetaInfo(ctx context.Context) (*MetaInfo, error) {
	var out MetaInfo
	var raw json.RawMessage
	if err := c.do(ctx, call{method: http.MethodGet, path: "/meta/info", idempotent: true, bare: true}, &raw); err != nil {
		return nil, err
	}
	body := raw
	var top map[string]json.RawMessage
	if json.Unmarshal(raw, &top) == nil && top["api"] == nil {
		if data, _, err := decodeEnvelope(raw); err == nil {
			body = data
		}
	}
	err := json.Unmarshal(body, &out)
	if err == nil && out.API.Name == "" && out.API.LatestVersion == "" { // api is required
		err = errors.New("no api in the response")
	}
	if err != nil {
		return nil, brokererr.Wrap(fmt.Errorf("GET /meta/info: %w", err), brokererr.Unavailable, "CodeSandbox sent an unusable response")
	}
	return &out, nil
}

// ListSandboxes lists the workspace's sandboxes (one page).
func (c *Client) ListSandboxes(ctx context.Context, lo ListOptions) (*SandboxList, error) {
	q := url.Values{}
	if len(lo.Tags) > 0 {
		q.Set("tags", strings.Join(lo.Tags, ","))
	}
	if lo.OrderBy != "" {
		q.Set("order_by", lo.OrderBy)
	}
	if lo.Direction != "" {
		q.Set("direction", lo.Direction)
	}
	if lo.PageSize > 0 {
		q.Set("page_size", strconv.Itoa(lo.PageSize))
	}
	if lo.Page > 0 {
		q.Set("page", strconv.Itoa(lo.Page))
	}
	if lo.Running {
		q.Set("status", "running")
	}
	var out SandboxList
	return &out, c.do(ctx, call{method: http.MethodGet, path: "/sandbox", query: q, idempotent: true}, &out)
}

// GetSandbox returns one sandbox.
func (c *Client) GetSandbox(ctx context.Context, id string) (*Sandbox, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	var out Sandbox
	return &out, c.do(ctx, call{method: http.MethodGet, path: "/sandbox/" + id, idempotent: true, notFound: notFoundSandbox}, &out)
}

// Fork forks a template (sandbox ID, tag or alias). With StartOptions the
// VM is started by the same call and the response carries StartResponse.
func (c *Client) Fork(ctx context.Context, template string, req ForkRequest) (*ForkResponse, error) {
	if !ValidTemplateRef(template) {
		return nil, brokererr.New(brokererr.InvalidInput, "invalid CodeSandbox template reference")
	}
	var out ForkResponse
	err := c.do(ctx, call{method: http.MethodPost, path: "/sandbox/" + url.PathEscape(template) + "/fork", body: req, notFound: notFoundTemplate}, &out)
	if err != nil {
		return nil, err
	}
	if !ValidSandboxID(out.ID) {
		return nil, brokererr.New(brokererr.Unavailable, "CodeSandbox returned an unusable sandbox ID")
	}
	return &out, nil
}

// Start starts or resumes the VM and returns the agent's address.
func (c *Client) Start(ctx context.Context, id string, o StartOptions) (*StartResponse, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	var out StartResponse
	return &out, c.do(ctx, call{method: http.MethodPost, path: "/vm/" + id + "/start", body: o, idempotent: true, notFound: notFoundSandbox}, &out)
}

// Hibernate snapshots and suspends a running VM (404 when not running).
func (c *Client) Hibernate(ctx context.Context, id string) error {
	return c.vmAction(ctx, id, "hibernate")
}

// Shutdown stops a running VM without a memory snapshot (404 when not running).
func (c *Client) Shutdown(ctx context.Context, id string) error {
	return c.vmAction(ctx, id, "shutdown")
}

func (c *Client) vmAction(ctx context.Context, id, action string) error {
	if err := checkID(id); err != nil {
		return err
	}
	var out json.RawMessage
	return c.do(ctx, call{method: http.MethodPost, path: "/vm/" + id + "/" + action, body: struct{}{}, idempotent: true, notFound: notFoundSandbox, slow: true}, &out)
}

// Delete permanently deletes the sandbox and its VM.
func (c *Client) Delete(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	var out json.RawMessage
	return c.do(ctx, call{method: http.MethodDelete, path: "/vm/" + id, idempotent: true, notFound: notFoundSandbox}, &out)
}

// RunningVMs lists the workspace's running VMs.
func (c *Client) RunningVMs(ctx context.Context) (*RunningVMs, error) {
	var out RunningVMs
	return &out, c.do(ctx, call{method: http.MethodGet, path: "/vm/running", idempotent: true}, &out)
}

// CreatePreviewToken creates a preview token valid until expiresAt.
func (c *Client) CreatePreviewToken(ctx context.Context, id string, expiresAt time.Time) (*PreviewToken, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	req := struct {
		ExpiresAt string `json:"expires_at"`
	}{expiresAt.UTC().Format(time.RFC3339)}
	var out struct {
		SandboxID string       `json:"sandbox_id"`
		Token     PreviewToken `json:"token"`
	}
	// A retried 5xx may leave an extra token behind; it expires like this one.
	if err := c.do(ctx, call{method: http.MethodPost, path: "/sandbox/" + id + "/tokens", body: req, idempotent: true, notFound: notFoundSandbox}, &out); err != nil {
		return nil, err
	}
	if out.Token.Token == "" {
		return nil, brokererr.New(brokererr.Unavailable, "CodeSandbox returned no preview token")
	}
	return &out.Token, nil
}

// do runs cl with bounded, jittered retries and maps the outcome to
// brokererr codes. out receives the envelope's data.
func (c *Client) do(ctx context.Context, cl call, out any) error {
	var payload []byte
	if cl.body != nil {
		var err error
		if payload, err = json.Marshal(cl.body); err != nil {
			return fmt.Errorf("codesandbox: encode %s: %w", cl.path, err)
		}
	}
	for attempt := 0; ; attempt++ {
		start := time.Now()
		res, err := c.once(ctx, cl, payload)
		if err != nil {
			if ctx.Err() != nil {
				return ctxError(ctx)
			}
			c.log.Warn().Str("method", cl.method).Str("path", cl.path).Int("attempt", attempt).
				Err(c.scrub(err)).Msg("csb_request_failed")
			if cl.idempotent && attempt < c.retries && c.sleep(ctx, c.backoff(attempt)) {
				continue
			}
			if ctx.Err() != nil {
				return ctxError(ctx)
			}
			return brokererr.Wrap(c.scrub(err), brokererr.Unavailable, "CodeSandbox did not answer")
		}
		c.log.Debug().Str("method", cl.method).Str("path", cl.path).Int("status", res.status).
			Int("attempt", attempt).Int64("duration_ms", time.Since(start).Milliseconds()).Msg("csb_request")

		switch s := res.status; {
		case s >= 200 && s < 300:
			return c.decode(cl, res, out)
		case s == http.StatusTooManyRequests:
			rl := ParseRateLimit(res.header, time.Now())
			if attempt < c.retries && rl.Wait <= c.maxWait && (cl.idempotent || !vmBudgetExhausted(res.header)) {
				d := min(max(rl.Wait, c.backoff(attempt)), c.maxWait)
				c.log.Warn().Str("path", cl.path).Int("status", s).Int("attempt", attempt).
					Int64("wait_ms", d.Milliseconds()).Msg("csb_retry")
				if c.sleep(ctx, d) {
					continue
				}
			}
			return c.rateLimited(cl, res, rl)
		case s >= 500:
			if cl.idempotent && attempt < c.retries {
				d := c.backoff(attempt)
				c.log.Warn().Str("path", cl.path).Int("status", s).Int("attempt", attempt).
					Int64("wait_ms", d.Milliseconds()).Msg("csb_retry")
				if c.sleep(ctx, d) {
					continue
				}
			}
			if ctx.Err() != nil {
				return ctxError(ctx)
			}
			return brokererr.Wrap(c.cause(cl, res), brokererr.Unavailable, "CodeSandbox is unavailable (HTTP %d); try again later", s)
		default:
			return c.clientError(cl, res)
		}
	}
}

// once makes one attempt under the per-attempt timeout.
func (c *Client) once(ctx context.Context, cl call, payload []byte) (*response, error) {
	timeout := c.timeout
	if cl.slow {
		timeout *= slowTimeoutFactor
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	u := *c.base
	u.Path = c.base.Path + cl.path
	u.RawPath = ""
	if len(cl.query) > 0 {
		u.RawQuery = cl.query.Encode()
	}
	var body io.Reader
	if payload != nil {
		body = bytes.NewReader(payload)
	}
	req, err := http.NewRequestWithContext(actx, cl.method, u.String(), body)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+c.key)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "sandbox-broker-codesandbox")
	if payload != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxResponseBytes {
		return nil, fmt.Errorf("response to %s is larger than %d bytes", cl.path, maxResponseBytes)
	}
	return &response{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

func (c *Client) decode(cl call, res *response, out any) error {
	data, msg, err := json.RawMessage(res.body), "", error(nil)
	if !cl.bare {
		data, msg, err = decodeEnvelope(res.body)
	}
	if err != nil {
		if msg != "" {
			err = fmt.Errorf("%w: %s", err, c.scrubText(msg))
		}
		return brokererr.Wrap(fmt.Errorf("%s %s: %w", cl.method, cl.path, err), brokererr.Unavailable, "CodeSandbox sent an unusable response")
	}
	if err := json.Unmarshal(data, out); err != nil {
		return brokererr.Wrap(fmt.Errorf("%s %s: decode data: %w", cl.method, cl.path, err), brokererr.Unavailable, "CodeSandbox sent an unusable response")
	}
	return nil
}

func (c *Client) rateLimited(cl call, res *response, rl RateLimit) error {
	after := rl.Wait
	if after <= 0 {
		after = fallbackRetryAfter
	}
	// Whole seconds: the model cannot act on less.
	after = ((after + time.Second - 1) / time.Second) * time.Second
	msg := "CodeSandbox rate limit reached"
	if rl.Budget != "" {
		msg += ": no " + rl.Budget + " left"
	}
	return brokererr.Wrap(c.cause(cl, res), brokererr.RateLimitExceeded, "%s", msg).WithRetryAfter(after)
}

func (c *Client) clientError(cl call, res *response) error {
	cause := c.cause(cl, res)
	switch res.status {
	case http.StatusNotFound:
		switch cl.notFound {
		case notFoundSandbox:
			return brokererr.Wrap(cause, brokererr.SandboxNotFound, "sandbox not found or not running")
		case notFoundTemplate:
			return brokererr.Wrap(cause, brokererr.InternalError, "the configured CodeSandbox template does not exist")
		default:
			return brokererr.Wrap(cause, brokererr.InternalError, "CodeSandbox API endpoint not found; check CSB_API_URL")
		}
	case http.StatusUnauthorized, http.StatusForbidden:
		return brokererr.Wrap(cause, brokererr.PermissionDenied, "CodeSandbox refused the broker's credentials for this operation")
	default:
		return brokererr.Wrap(cause, brokererr.InternalError, "CodeSandbox rejected the request (HTTP %d)", res.status)
	}
}

// cause is the server-side error kept for logs: status and the server's
// first message, scrubbed of the key.
func (c *Client) cause(cl call, res *response) error {
	_, msg, _ := decodeEnvelope(res.body)
	if msg == "" {
		return fmt.Errorf("%s %s: HTTP %d", cl.method, cl.path, res.status)
	}
	return fmt.Errorf("%s %s: HTTP %d: %s", cl.method, cl.path, res.status, c.scrubText(msg))
}

func (c *Client) scrubText(s string) string {
	return strings.ReplaceAll(s, c.key, "[redacted]")
}

func (c *Client) scrub(err error) error {
	if err == nil {
		return nil
	}
	return errors.New(c.scrubText(err.Error()))
}

// backoff is RetryBase·2^attempt with jitter in [d/2, d], capped.
func (c *Client) backoff(attempt int) time.Duration {
	d := c.step << min(attempt, 20)
	if d <= 0 || d > c.maxWait {
		d = c.maxWait
	}
	half := d / 2
	return half + time.Duration(rand.Int64N(int64(d-half)+1))
}

// sleep waits d unless ctx ends first or its deadline leaves no time for
// another attempt after the wait.
func (c *Client) sleep(ctx context.Context, d time.Duration) bool {
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= d {
		return false
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// ctxError maps the caller's context ending: a deadline is a timeout the
// model can see; a cancel means nobody is waiting.
func ctxError(ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return brokererr.Wrap(ctx.Err(), brokererr.SandboxTimeout, "CodeSandbox did not answer in time")
	}
	return ctx.Err()
}
