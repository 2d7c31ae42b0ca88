package tools

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/mark3labs/mcp-go/mcp"
	"golang.org/x/mod/sumdb/note"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
)

// The console's own tools serve the web console's audit desk, operator
// view and session picker. They go through the same chain as every tool
// (so each console action is rate-limited and audited under the person's
// principal) but are registered only on the console's in-process server:
// no MCP transport lists them, so no model can call them.

// ToolsetConsole names the console's tools in audit rows ("console.*").
const ToolsetConsole = "console"

// AuditDesk is the audit log as the console reads it.
type AuditDesk struct {
	Path, CheckpointPath string
	Verifier             note.Verifier
	// Verify runs the same check as `sandbox-broker audit verify`.
	Verify func(ctx context.Context) (audit.VerifyReport, error)

	mu        sync.Mutex // one verification at a time
	verifying bool
	last      *Verification
}

// Verification is the last "verify now" result.
type Verification struct {
	At     time.Time          `json:"at"`
	Report audit.VerifyReport `json:"report"`
}

// Decision is one recent decision of the session reaper or an egress
// proxy, for the operator view.
type Decision struct {
	At        time.Time `json:"at"`
	Source    string    `json:"source"` // "reaper" or "egress"
	Action    string    `json:"action"` // idle_released, expired, allowed, denied
	Principal string    `json:"principal,omitempty"`
	Subject   string    `json:"subject"` // a session ID, or host:port
	Reason    string    `json:"reason,omitempty"`
}

// Console is what the console's tools need.
type Console struct {
	Audit    *AuditDesk
	Sessions *sessions.Manager // nil without a sandbox backend
	Jobs     *jobs.Manager     // likewise
	Projects *projects.Manager // nil without a project provider
	Usage    UsageReader
	Limits   func(identity.Principal) quota.Limits
	// Principals are the configured principals (their quotas are listed
	// even when they hold nothing).
	Principals func() []identity.Principal
	Decisions  func() []Decision
}

// ConsoleToolset is every console tool.
func ConsoleToolset(c *Console) *Toolset {
	return NewToolset(ToolsetConsole, "The web console's own views (never listed on an MCP transport)").
		AddReadTools(c.mySessions(), c.auditQuery(), c.auditRecord(), c.auditState(), c.auditVerify(),
			c.auditExport(), c.auditTail(), c.operatorOverview()).
		AddWriteTools(c.closeAnySession(), c.cancelAnyExecution())
}

// requireAdmin refuses a principal not marked admin.
func requireAdmin(p identity.Principal, what string) error {
	if p.Admin {
		return nil
	}
	return brokererr.New(brokererr.PermissionDenied,
		"%s is for admins (\"admin\": true on the principal's MCP_TOKENS_FILE entry, or the OAuth admin claim)", what)
}

// Console listing bounds.
const (
	maxConsoleRows = 500
	maxAuditPage   = 200
)

// MySessionsArgs takes no arguments.
type MySessionsArgs struct{}

func (c *Console) mySessions() ServerTool {
	return newTool("console.my_sessions", "List your own sessions, most recently used first.", 0, readAnnotations("My sessions"),
		func(ctx context.Context, p identity.Principal, _ *MySessionsArgs) (*mcp.CallToolResult, error) {
			if c.Sessions == nil {
				return nil, brokererr.New(brokererr.Unavailable, "no sandbox backend is available on this broker")
			}
			all, err := c.Sessions.All(ctx, p.ID, maxConsoleRows)
			if err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"sessions": all})
		})
}

// AuditFilterArgs select audit rows for console.audit_query, _export and
// _tail (Before and Limit page a query; AfterSeq starts a tail or an
// export). Every value is recorded in the call's own audit row: what an
// admin looked for is itself audited.
type AuditFilterArgs struct {
	Principal string `json:"principal,omitempty" validate:"omitempty,max=128,clean" audit:"clear" desc:"Only rows of this principal."`
	Tool      string `json:"tool,omitempty" validate:"omitempty,max=128,clean" audit:"clear" desc:"Only rows of this tool."`
	Outcome   string `json:"outcome,omitempty" validate:"omitempty,oneof=success failure rate_limited denied" audit:"clear" desc:"Only outcome rows with this outcome."`
	ErrorCode string `json:"error_code,omitempty" validate:"omitempty,max=64,clean" audit:"clear" desc:"Only rows with this error code."`
	CallID    string `json:"call_id,omitempty" validate:"omitempty,max=128,clean" audit:"clear" desc:"Only rows of this call."`
	Since     string `json:"since,omitempty" validate:"omitempty,datetime=2006-01-02T15:04:05Z07:00" audit:"clear" desc:"Rows at or after this time (RFC 3339)."`
	Until     string `json:"until,omitempty" validate:"omitempty,datetime=2006-01-02T15:04:05Z07:00" audit:"clear" desc:"Rows before this time (RFC 3339)."`
	Before    int64  `json:"before,omitempty" validate:"omitempty,min=1" audit:"clear" desc:"Query: only rows below this sequence number (the previous page's cursor)."`
	Limit     int    `json:"limit,omitempty" validate:"omitempty,min=1,max=200" audit:"clear" desc:"Query: rows per page (default 50)."`
	AfterSeq  int64  `json:"after_seq,omitempty" validate:"omitempty,min=1" audit:"clear" desc:"Export and tail: only rows after this sequence number (to resume)."`
}

func (a AuditFilterArgs) filter() audit.Filter {
	f := audit.Filter{Principal: a.Principal, Tool: a.Tool, Outcome: a.Outcome, ErrorCode: a.ErrorCode, CallID: a.CallID}
	f.Since, _ = time.Parse(time.RFC3339, a.Since) // validated
	f.Until, _ = time.Parse(time.RFC3339, a.Until)
	f.AfterSeq = a.AfterSeq
	return f
}

// auditError turns a reader failure into a structured error.
func auditError(err error) error {
	if errors.Is(err, audit.ErrNoDatabase) {
		return brokererr.New(brokererr.Unavailable, "the audit log has no database yet")
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "the audit log could not be read")
}

func (c *Console) auditQuery() ServerTool {
	return newTool("console.audit_query", "Audit rows matching a filter, newest first.", 0, readAnnotations("Query the audit log"),
		func(ctx context.Context, p identity.Principal, a *AuditFilterArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "the audit desk"); err != nil {
				return nil, err
			}
			limit := a.Limit
			if limit == 0 {
				limit = 50
			}
			page, err := audit.Query(ctx, c.Audit.Path, a.filter(), a.Before, min(limit, maxAuditPage))
			if err != nil {
				return nil, auditError(err)
			}
			return jsonResult(page)
		})
}

// AuditRecordArgs name one row.
type AuditRecordArgs struct {
	Seq int64 `json:"seq" validate:"required,min=1" audit:"clear" desc:"The row's sequence number."`
}

// AuditRecord is one row in full with the other rows of its call.
type AuditRecord struct {
	Row  audit.Row     `json:"row"`
	Call []audit.Entry `json:"call"`
}

func (c *Console) auditRecord() ServerTool {
	return newTool("console.audit_record", "One audit row in full, with its chain hashes and the other rows of its call.", 0,
		readAnnotations("Read an audit row"),
		func(ctx context.Context, p identity.Principal, a *AuditRecordArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "the audit desk"); err != nil {
				return nil, err
			}
			row, call, err := audit.ReadRow(ctx, c.Audit.Path, a.Seq)
			if errors.Is(err, audit.ErrNoRow) {
				return nil, brokererr.New(brokererr.InvalidInput, "the audit log has no row %d", a.Seq)
			}
			if err != nil {
				return nil, auditError(err)
			}
			if call == nil {
				call = []audit.Entry{}
			}
			return jsonResult(AuditRecord{Row: row, Call: call})
		})
}

// AuditState is the chain's state: its head, latest checkpoint and the
// last verification run from the console.
type AuditState struct {
	audit.Head
	LastVerification *Verification `json:"last_verification,omitempty"`
	Verifying        bool          `json:"verifying"`
}

// AuditStateArgs takes no arguments.
type AuditStateArgs struct{}

func (c *Console) auditState() ServerTool {
	return newTool("console.audit_state", "The audit chain's newest row, latest signed checkpoint and last verification.", 0,
		readAnnotations("Audit chain state"),
		func(ctx context.Context, p identity.Principal, _ *AuditStateArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "the audit desk"); err != nil {
				return nil, err
			}
			h, err := audit.ReadHead(ctx, c.Audit.Path, c.Audit.CheckpointPath, c.Audit.Verifier)
			if err != nil {
				return nil, auditError(err)
			}
			c.Audit.mu.Lock()
			st := AuditState{Head: h, LastVerification: c.Audit.last, Verifying: c.Audit.verifying}
			c.Audit.mu.Unlock()
			return jsonResult(st)
		})
}

// AuditVerifyArgs takes no arguments.
type AuditVerifyArgs struct{}

func (c *Console) auditVerify() ServerTool {
	return newTool("console.audit_verify",
		"Verify the whole audit chain and its signed checkpoints now, as `sandbox-broker audit verify` does, and report the first break.", 0,
		readAnnotations("Verify the audit chain"),
		func(ctx context.Context, p identity.Principal, _ *AuditVerifyArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "the audit desk"); err != nil {
				return nil, err
			}
			d := c.Audit
			d.mu.Lock()
			if d.verifying {
				d.mu.Unlock()
				return nil, brokererr.New(brokererr.Conflict, "a verification is already running; its result will show in the chain state")
			}
			d.verifying = true
			d.mu.Unlock()
			rep, err := d.Verify(ctx)
			v := &Verification{At: time.Now().UTC(), Report: rep}
			d.mu.Lock()
			d.verifying = false
			if err == nil {
				d.last = v
			}
			d.mu.Unlock()
			if err != nil {
				return nil, auditError(err)
			}
			// The verification's finding is in its own outcome row.
			middleware.OutcomeDetail(ctx, "chain_ok", rep.OK)
			middleware.OutcomeDetail(ctx, "rows", rep.Rows)
			if !rep.OK {
				middleware.OutcomeDetail(ctx, "first_bad_seq", rep.FirstBadSeq)
			}
			return jsonResult(v)
		})
}

// RowSink receives the rows of a streaming console tool (export, tail).
type RowSink func(audit.Entry) error

type rowSinkKey struct{}

// WithRowSink gives console.audit_export and console.audit_tail somewhere
// to stream rows: the console's HTTP response.
func WithRowSink(ctx context.Context, s RowSink) context.Context {
	return context.WithValue(ctx, rowSinkKey{}, s)
}

func rowSink(ctx context.Context) (RowSink, error) {
	s, ok := ctx.Value(rowSinkKey{}).(RowSink)
	if !ok || s == nil {
		return nil, brokererr.New(brokererr.InvalidInput, "this tool streams rows to the web console only")
	}
	return s, nil
}

// StreamResult is what a streaming console tool returns once it ends.
type StreamResult struct {
	Rows    int64 `json:"rows"`
	LastSeq int64 `json:"last_seq"`
}

func (c *Console) auditExport() ServerTool {
	return newTool("console.audit_export", "Stream every audit row matching a filter, oldest first, as NDJSON to the console.", 0,
		readAnnotations("Export audit rows"),
		func(ctx context.Context, p identity.Principal, a *AuditFilterArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "the audit desk"); err != nil {
				return nil, err
			}
			sink, err := rowSink(ctx)
			if err != nil {
				return nil, err
			}
			var res StreamResult
			err = audit.Each(ctx, c.Audit.Path, a.filter(), func(e audit.Entry) error {
				res.Rows, res.LastSeq = res.Rows+1, e.Seq
				return sink(e)
			})
			middleware.OutcomeDetail(ctx, "rows", res.Rows)
			if err != nil {
				return nil, auditError(err)
			}
			return jsonResult(res)
		})
}

func (c *Console) auditTail() ServerTool {
	return newTool("console.audit_tail",
		"Stream audit rows matching a filter to the console as they are committed, until the console stops reading.", 0,
		readAnnotations("Tail the audit log"),
		func(ctx context.Context, p identity.Principal, a *AuditFilterArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "the audit desk"); err != nil {
				return nil, err
			}
			sink, err := rowSink(ctx)
			if err != nil {
				return nil, err
			}
			res := StreamResult{LastSeq: a.AfterSeq}
			err = audit.Follow(ctx, c.Audit.Path, a.filter(), 500*time.Millisecond, func(e audit.Entry) error {
				res.Rows, res.LastSeq = res.Rows+1, e.Seq
				return sink(e)
			})
			middleware.OutcomeDetail(ctx, "rows", res.Rows)
			if err != nil && ctx.Err() == nil {
				return nil, auditError(err)
			}
			return jsonResult(res)
		})
}

// Overview is what the operator view shows.
type Overview struct {
	Sessions  []sessions.Overview `json:"sessions"`
	Jobs      []jobs.Owned        `json:"running_executions"`
	Projects  []projects.Owned    `json:"project_sandboxes"`
	Quotas    []PrincipalQuota    `json:"quotas"`
	Decisions []Decision          `json:"decisions"`
}

// PrincipalQuota is one principal's use of its quotas.
type PrincipalQuota struct {
	Principal string      `json:"principal"`
	Tier      quota.Tier  `json:"tier"`
	Admin     bool        `json:"admin,omitempty"`
	Limits    UsageLimits `json:"limits"`
	Used      UsageCounts `json:"used"`
}

// OperatorOverviewArgs takes no arguments.
type OperatorOverviewArgs struct{}

func (c *Console) operatorOverview() ServerTool {
	return newTool("console.operator_overview",
		"Live sessions of every principal with their compute, running executions, project sandboxes, quota use per principal and the reaper's and egress proxies' recent decisions.", 0,
		readAnnotations("Operator overview"),
		func(ctx context.Context, p identity.Principal, _ *OperatorOverviewArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "the operator view"); err != nil {
				return nil, err
			}
			o := Overview{Sessions: []sessions.Overview{}, Jobs: []jobs.Owned{}, Projects: []projects.Owned{}, Decisions: c.Decisions()}
			var err error
			if c.Sessions != nil {
				if o.Sessions, err = c.Sessions.All(ctx, "", maxConsoleRows); err != nil {
					return nil, err
				}
			}
			if c.Jobs != nil {
				if o.Jobs, err = c.Jobs.All(ctx, jobs.StatusRunning, maxConsoleRows); err != nil {
					return nil, err
				}
			}
			if c.Projects != nil {
				if o.Projects, err = c.Projects.All(ctx, maxConsoleRows); err != nil {
					return nil, err
				}
			}
			if o.Quotas, err = c.quotas(ctx, o); err != nil {
				return nil, err
			}
			return jsonResult(o)
		})
}

// quotas lists the configured principals and any other principal holding
// something (an OAuth principal not in the tokens file).
func (c *Console) quotas(ctx context.Context, o Overview) ([]PrincipalQuota, error) {
	seen := map[string]bool{}
	var ps []identity.Principal
	for _, p := range c.Principals() {
		seen[p.ID] = true
		ps = append(ps, p)
	}
	add := func(id string) {
		if !seen[id] {
			seen[id] = true
			ps = append(ps, identity.Principal{ID: id})
		}
	}
	for _, s := range o.Sessions {
		add(s.Principal)
	}
	for _, j := range o.Jobs {
		add(j.Principal)
	}
	for _, pr := range o.Projects {
		add(pr.Principal)
	}
	out := []PrincipalQuota{}
	for _, p := range ps {
		l := c.Limits(p)
		u, err := c.Usage.Usage(ctx, p.ID, l)
		if err != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "usage is unavailable right now")
		}
		out = append(out, PrincipalQuota{Principal: p.ID, Tier: p.Tier, Admin: p.Admin,
			Limits: UsageLimits{CallsPerMinute: l.CallsPerMinute, SandboxesPerHour: l.SandboxesPerHour, ExecutionSPerDay: int64(l.ExecutionPerDay / time.Second)},
			Used:   UsageCounts{CallsThisMinute: u.CallsUsedLastMinute, SandboxesThisHour: u.SandboxesUsedLastHour, ExecutionSToday: int64(u.ExecutionUsedToday / time.Second)}})
	}
	return out, nil
}

// CloseAnySessionArgs name another principal's session.
type CloseAnySessionArgs struct {
	Principal string `json:"principal" validate:"required,max=128,clean" audit:"clear" desc:"The session's owner."`
	SessionID string `json:"session_id" validate:"required,session_id" audit:"clear" desc:"The session to close."`
}

func (c *Console) closeAnySession() ServerTool {
	return newTool("console.close_session", "Close any principal's session: its sandbox stops and its files are deleted.", 0,
		writeAnnotations("Close a session (admin)", true, true),
		func(ctx context.Context, p identity.Principal, a *CloseAnySessionArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "closing another principal's session"); err != nil {
				return nil, err
			}
			if c.Sessions == nil {
				return nil, brokererr.New(brokererr.Unavailable, "no sandbox backend is available on this broker")
			}
			if err := c.Sessions.Remove(ctx, a.Principal, a.SessionID); err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"closed": true, "principal": a.Principal, "session_id": a.SessionID})
		})
}

// CancelAnyExecutionArgs name another principal's execution.
type CancelAnyExecutionArgs struct {
	Principal   string `json:"principal" validate:"required,max=128,clean" audit:"clear" desc:"The execution's owner."`
	ExecutionID string `json:"execution_id" validate:"required,max=64,clean" audit:"clear" desc:"The execution to stop."`
	Force       bool   `json:"force,omitempty" audit:"clear" desc:"SIGKILL at once instead of SIGTERM first."`
}

func (c *Console) cancelAnyExecution() ServerTool {
	return newTool("console.cancel_execution", "Stop any principal's running execution.", 0,
		writeAnnotations("Cancel an execution (admin)", true, true),
		func(ctx context.Context, p identity.Principal, a *CancelAnyExecutionArgs) (*mcp.CallToolResult, error) {
			if err := requireAdmin(p, "cancelling another principal's execution"); err != nil {
				return nil, err
			}
			if c.Jobs == nil {
				return nil, brokererr.New(brokererr.Unavailable, "no sandbox backend is available on this broker")
			}
			info, err := c.Jobs.Cancel(ctx, a.Principal, a.ExecutionID, a.Force)
			if err != nil {
				return nil, err
			}
			return jsonResult(jobs.Owned{Principal: a.Principal, Info: info})
		})
}
