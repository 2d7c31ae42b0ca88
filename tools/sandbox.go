package tools

import (
	"context"
	"encoding/base64"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
)

// Engine is what the sandbox and file tools need, injected by the broker.
// A nil Sessions means no backend is available.
type Engine struct {
	Sessions       *sessions.Manager
	Backend        sandbox.Backend
	URLs           URLSigner
	Exec           ExecutionBudget
	Limits         func(identity.Principal) quota.Limits
	DefaultTimeout time.Duration
	MaxTimeout     time.Duration
	// Redact filters text streamed in notifications (the chain redacts
	// results, not notifications); nil disables streaming.
	Redact func(string) string
	// MaxLinkBytes caps the files signed links serve and accept.
	MaxLinkBytes int64
	// Metrics counts executions (nil: not counted).
	Metrics *middleware.SandboxMetrics
}

// observe counts one finished execution in the sandbox metrics.
func (e *Engine) observe(language, outcome string, d time.Duration) {
	if e.Metrics != nil && e.Backend != nil {
		e.Metrics.Observe(e.Backend.Name(), language, outcome, d)
	}
}

// URLSigner makes signed download links for workspace files, and upload
// links; it fails when the broker has no public address, and tools then
// leave download links out.
type URLSigner interface {
	URL(workspaceID, path string) (string, time.Time, error)
	UploadURL(workspaceID, path string, maxBytes int64, overwrite bool) (string, time.Time, error)
}

// ExecutionBudget is the per-day execution quota: a run reserves its
// timeout before it starts and settles with the time it really took.
type ExecutionBudget interface {
	ReserveExecution(ctx context.Context, principal string, l quota.Limits, d time.Duration) (quota.Decision, quota.Reservation, error)
	RenewExecution(ctx context.Context, r quota.Reservation) error
	SettleExecution(ctx context.Context, r quota.Reservation, d time.Duration) error
}

// executionHold is a run's reservation of the daily execution budget.
type executionHold struct {
	e   *Engine
	ctx context.Context // outlives a cancelled call
	r   quota.Reservation
	at  time.Time // when it was reserved
}

// started re-dates the reservation once the run holds its session, if it
// waited (for another run in it) long enough for its expiry to come close.
func (h executionHold) started() {
	if time.Since(h.at) < quota.ReservationGrace/2 {
		return
	}
	ctx, cancel := context.WithTimeout(h.ctx, 5*time.Second)
	defer cancel()
	_ = h.e.Exec.RenewExecution(ctx, h.r)
}

// settle charges the time really spent; call it exactly once.
func (h executionHold) settle(d time.Duration) {
	ctx, cancel := context.WithTimeout(h.ctx, 5*time.Second)
	defer cancel()
	_ = h.e.Exec.SettleExecution(ctx, h.r, d)
}

// reserveExecution holds timeout of p's daily execution budget.
func (e *Engine) reserveExecution(ctx context.Context, p identity.Principal, timeout time.Duration) (executionHold, error) {
	dec, r, err := e.Exec.ReserveExecution(ctx, p.ID, e.Limits(p), timeout)
	if err != nil {
		return executionHold{}, brokererr.Wrap(err, brokererr.Unavailable, "quota store unavailable")
	}
	switch {
	case !dec.Allowed && dec.Remaining == 0:
		return executionHold{}, brokererr.New(brokererr.QuotaExceeded, "daily execution time is used up").WithRetryAfter(dec.RetryAfter)
	case !dec.Allowed:
		return executionHold{}, brokererr.New(brokererr.QuotaExceeded,
			"%ds of daily execution time are free beside running executions, and a run holds its whole timeout (%ds): lower the timeout or wait",
			dec.Remaining/1000, int64(timeout/time.Second)).WithRetryAfter(dec.RetryAfter)
	}
	return executionHold{e: e, ctx: context.WithoutCancel(ctx), r: r, at: time.Now()}, nil
}

// Output and inline-content caps for one result.
const (
	maxStreamBytes   = 32 << 10
	maxAgentBytes    = 64 << 10
	maxInlineImage   = 1 << 20
	maxInlineImages  = 4
	maxFilesReported = 50
	maxUploadBytes   = 10 << 20
	maxReadBytes     = 1 << 20
	defaultReadBytes = 256 << 10
)

// timeoutRule bounds a timeout argument by SANDBOX_MAX_TIMEOUT, in the
// schema and the validator alike; without an engine (docs) by its default.
func timeoutRule(field string, e *Engine) middleware.Rule {
	limit := config.Defaults().MaxTimeoutS
	if e != nil && e.MaxTimeout > 0 {
		limit = int(e.MaxTimeout / time.Second)
	}
	return middleware.Rule{Field: field, Tag: fmt.Sprintf("max=%d", limit)}
}

func (e *Engine) ready() error {
	if e == nil || e.Sessions == nil {
		return brokererr.New(brokererr.NotConfigured, "no sandbox backend is available on this broker")
	}
	return nil
}

// sessionID resolves session_id and its alias conversationId (the spec's name).
func sessionID(id, conversationID string) (string, error) {
	if id != "" && conversationID != "" && id != conversationID {
		return "", brokererr.New(brokererr.InvalidInput, "session_id and conversationId differ; send one")
	}
	if id != "" {
		return id, nil
	}
	return conversationID, nil
}

// RunCodeArgs are run_code's arguments.
type RunCodeArgs struct {
	SessionID      string `json:"session_id,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Session to use; omit to start a new one. Reuse it to keep files and state."`
	ConversationID string `json:"conversationId,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Alias of session_id."`
	Language       string `json:"language" validate:"required,max=32,clean" audit:"clear" desc:"Runner language; list_runners shows what is available (python, typescript, bash)."`
	Code           string `json:"code" validate:"required,max=262144,clean" audit:"digest" desc:"Source code to run. The working directory is /mnt/data (also /data), which persists for the session."`
	TimeoutS       int    `json:"timeout_s,omitempty" validate:"omitempty,min=1" desc:"Wall-clock limit in seconds (default 60)."`
	Mode           string `json:"mode,omitempty" validate:"omitempty,oneof=fresh notebook" audit:"clear" desc:"fresh (default): a new process per run. notebook (python only): a cell of the session's IPython kernel (as in Jupyter), which keeps variables and imports between calls and shows the last expression's value, figures and rich displays. A timeout or out-of-memory kill ends the kernel and its state."`
}

// RunCodeResult is run_code's structured output.
type RunCodeResult struct {
	SessionID  string    `json:"session_id"`
	Success    bool      `json:"success"`
	ExitCode   int       `json:"exit_code"`
	Signal     string    `json:"signal,omitempty"`
	Stdout     string    `json:"stdout"`
	Stderr     string    `json:"stderr"`
	Output     string    `json:"output"`
	DurationMS int64     `json:"duration_ms"`
	TimedOut   bool      `json:"timed_out"`
	OOMKilled  bool      `json:"oom_killed"`
	Truncated  bool      `json:"truncated"`
	Files      []FileRef `json:"files"`
	// Backend names the engine that ran the code (a fallback may run it
	// elsewhere than list_runners says).
	Backend string `json:"backend"`
	// Rich output: Result is the text of a notebook cell's last
	// expression; Displays lists every result, display and figure, whose
	// images and HTML follow as content.
	Result          string        `json:"result,omitempty"`
	Displays        []DisplayRef  `json:"displays,omitempty"`
	DisplaysOmitted int           `json:"displays_omitted,omitempty"`
	Exception       *ExceptionRef `json:"exception,omitempty"`
	Kernel          *KernelRef    `json:"kernel,omitempty"`
}

// RunCode runs code in the caller's session sandbox.
func RunCode(e *Engine) ServerTool {
	return newTool("run_code",
		"Run Python, TypeScript or Bash code in your session's sandbox (no network). Files written under /mnt/data persist for the session; new or changed files come back as sandbox:// resource links (read them with resources/read), images also inline, plus signed download links when the broker has a public URL. Matplotlib figures a Python run shows or leaves open come back as images. mode=notebook runs Python in the session's persistent IPython kernel, as in Jupyter (state kept between calls, last expression displayed).",
		512<<10, writeAnnotations("Run code", false, false),
		func(ctx context.Context, p identity.Principal, a *RunCodeArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			id, err := sessionID(a.SessionID, a.ConversationID)
			if err != nil {
				return nil, err
			}
			if err := e.checkLanguage(ctx, a.Language); err != nil {
				return nil, err
			}
			if a.Mode == sandbox.ModeNotebook && a.Language != "python" {
				return nil, brokererr.New(brokererr.InvalidInput, "mode notebook runs python only; use mode fresh for %s", a.Language)
			}
			timeout := e.DefaultTimeout
			if a.TimeoutS > 0 { // at most SANDBOX_MAX_TIMEOUT: timeoutRule
				timeout = time.Duration(a.TimeoutS) * time.Second
			}
			hold, err := e.reserveExecution(ctx, p, timeout)
			if err != nil {
				return nil, err
			}
			lease, err := e.Sessions.Acquire(ctx, p.ID, id, true)
			if err != nil {
				hold.settle(0)
				return nil, err
			}
			defer lease.Release()
			hold.started()
			stop := newNotifier(ctx, e.Redact).tick(ctx, "run_code", time.Second)
			res, err := lease.Session.Exec(ctx, sandbox.ExecRequest{Language: a.Language, Code: a.Code, Timeout: timeout, MaxOutputBytes: maxAgentBytes, Mode: a.Mode})
			stop()
			// Spent time counts even when the run failed; charged while
			// the outcome row is written.
			spent := res.Duration
			middleware.BesideOutcome(ctx, func() { hold.settle(spent) })
			e.observe(a.Language, runOutcome(res, err), res.Duration)
			if err != nil {
				return nil, err
			}
			out := RunCodeResult{SessionID: lease.ID, ExitCode: res.ExitCode, Signal: res.Signal, TimedOut: res.TimedOut,
				OOMKilled: res.OOMKilled, DurationMS: res.Duration.Milliseconds(), Truncated: res.Truncated, Backend: res.Backend}
			if out.Backend == "" {
				out.Backend = e.Backend.Name()
			}
			var t1, t2 bool
			out.Stdout, t1 = cleanOutput(res.Stdout, maxStreamBytes)
			out.Stderr, t2 = cleanOutput(res.Stderr, maxStreamBytes)
			out.Truncated = out.Truncated || t1 || t2
			out.Output = joinOutput(out.Stdout, out.Stderr)
			out.Success = res.ExitCode == 0 && !res.TimedOut && !res.OOMKilled && res.Signal == ""
			shown := richOutput(&out, lease.ID, res)
			files := e.filesResult(ctx, lease, res.Changed, &out.Files)
			files.Content = append(shown, files.Content...)
			return prependJSON(files, out)
		}).withRules(timeoutRule("timeout_s", e))
}

// runOutcome classifies a run for the metrics.
func runOutcome(res sandbox.ExecResult, err error) string {
	switch {
	case res.TimedOut || brokererr.CodeOf(err) == brokererr.SandboxTimeout:
		return middleware.ExecTimeout
	case err != nil || res.ExitCode != 0 || res.Signal != "" || res.OOMKilled:
		return middleware.ExecError
	}
	return middleware.ExecOK
}

func joinOutput(stdout, stderr string) string {
	switch {
	case stderr == "":
		return stdout
	case stdout == "":
		return stderr
	case strings.HasSuffix(stdout, "\n"):
		return stdout + stderr
	}
	return stdout + "\n" + stderr
}

func (e *Engine) checkLanguage(ctx context.Context, lang string) error {
	runners, err := e.Backend.Runners(ctx)
	if err != nil {
		return err
	}
	var names []string
	for _, r := range runners {
		if r.Language == lang {
			return nil
		}
		names = append(names, r.Language)
	}
	sort.Strings(names)
	return brokererr.New(brokererr.UnknownLanguage, "unknown language %q; available: %s", lang, strings.Join(names, ", "))
}

// filesResult describes the files a run wrote (at most maxFilesReported):
// each gets resource links, images also come inline and small text files
// embedded, within the caps. It never fails: the run has happened.
func (e *Engine) filesResult(ctx context.Context, lease *sessions.Lease, list []sandbox.FileInfo, refs *[]FileRef) *mcp.CallToolResult {
	res := &mcp.CallToolResult{}
	*refs = []FileRef{}
	images, embedded := 0, 0
	for i, f := range list {
		if i >= maxFilesReported {
			break
		}
		ref, ok := e.fileRef(lease, f)
		if !ok {
			continue
		}
		*refs = append(*refs, ref)
		switch {
		case isImage(ref.MIME) && f.Size <= maxInlineImage && images < maxInlineImages:
			if file, err := lease.Session.ReadFile(ctx, f.Path, 0, maxInlineImage); err == nil {
				res.Content = append(res.Content, mcp.NewImageContent(base64.StdEncoding.EncodeToString(file.Data), ref.MIME))
				images++
			}
		case textual(ref.MIME) && f.Size <= maxEmbedText && embedded+int(f.Size) <= maxEmbedTotal:
			if file, err := lease.Session.ReadFile(ctx, f.Path, 0, maxEmbedText); err == nil {
				if text, ok := exactText(ref.MIME, file.Data); ok {
					res.Content = append(res.Content, mcp.NewEmbeddedResource(mcp.TextResourceContents{URI: ref.URI, MIMEType: ref.MIME, Text: text}))
					embedded += len(file.Data)
				}
			}
		}
		res.Content = append(res.Content, ref.links()...)
	}
	return res
}

func isImage(mime string) bool {
	switch mime {
	case "image/png", "image/jpeg", "image/gif", "image/webp", "image/svg+xml":
		return true
	}
	return false
}

// prependJSON puts v first, as text and structured content.
func prependJSON(res *mcp.CallToolResult, v any) (*mcp.CallToolResult, error) {
	head, err := jsonResult(v)
	if err != nil {
		return nil, err
	}
	head.Content = append(head.Content, res.Content...)
	return head, nil
}

// ListRunnersArgs takes no arguments.
type ListRunnersArgs struct{}

// ListRunners reports the languages the backend can run.
func ListRunners(e *Engine) ServerTool {
	return newTool("list_runners", "List the languages run_code accepts, with the runner image behind each.",
		0, readAnnotations("List runners"),
		func(ctx context.Context, _ identity.Principal, _ *ListRunnersArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			runners, err := e.Backend.Runners(ctx)
			if err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"backend": e.Backend.Name(), "runners": runners})
		})
}

// CloseSessionArgs are close_session's arguments.
type CloseSessionArgs struct {
	SessionID string `json:"session_id" validate:"required,session_id" audit:"clear" desc:"Session to close; its sandbox and files are deleted."`
}

// CloseSession destroys a session's sandbox and files.
func CloseSession(e *Engine) ServerTool {
	return closeSession(e, "close_session", "Close a session: its sandbox stops and its files are deleted.")
}

// CleanupSession is close_session under the name the task tools use: one
// implementation, two names.
func CleanupSession(e *Engine) ServerTool {
	return closeSession(e, "cleanup_session", "Clean up a task's session: its sandbox (and any running task) stops and its workspace is deleted. The same operation as close_session.")
}

func closeSession(e *Engine, name, description string) ServerTool {
	return newTool(name, description, 0, writeAnnotations("Close session", true, true),
		func(ctx context.Context, p identity.Principal, a *CloseSessionArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			if err := e.Sessions.Remove(ctx, p.ID, a.SessionID); err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"session_id": a.SessionID, "closed": true})
		})
}
