package tools

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/agenttask"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/egress"
	ghsvc "github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/modelgw"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// ToolsetAgent names the autonomous-task toolset; the broker registers it
// only when a model API key is configured.
const ToolsetAgent = "agent"

// TaskGateway is the model gateway as tasks need it (*modelgw.Gateway).
type TaskGateway interface {
	CheckBudget(ctx context.Context, principal string, l modelgw.Limits) error
	Handler(c modelgw.Caller) http.Handler
}

// TaskCommitter commits a task's files (*github.Manager); CheckTarget
// refuses a repository or branch outside the allow-list before anything
// runs.
type TaskCommitter interface {
	GitHubCommitter
	CheckTarget(repoID, branch string) error
}

// Tasks is what the agent toolset needs.
type Tasks struct {
	Jobs    *Jobs
	Gateway TaskGateway // nil: tasks are not configured
	Policy  func(identity.Principal) agenttask.Policy
	// Models are those a task may name; the first is the default. Small is
	// the one the agent uses for background work.
	Models         []string
	SmallModel     string
	DefaultTimeout time.Duration
	MaxTurns       int
	GitHub         TaskCommitter // nil without GitHub
}

// Limits of the task tools.
const (
	maxTaskFilesBytes = 10 << 20 // decoded, all files of one call
	maxTaskArgBytes   = 16 << 20 // the base64 of maxTaskFilesBytes and the task
	maxGetFilesBytes  = 10 << 20 // content returned by one get_files call
)

func (t *Tasks) ready() error {
	if t == nil || t.Gateway == nil || t.Jobs == nil || t.Jobs.Egress == nil {
		return brokererr.New(brokererr.NotConfigured, "agent tasks are not configured on this broker")
	}
	return t.Jobs.ready()
}

// TaskFile is a file execute_task writes into the workspace first.
type TaskFile struct {
	Path    string `json:"path" validate:"required,max=1024,clean" desc:"Workspace-relative path (under /mnt/data)."`
	Content string `json:"content" validate:"max=14680064" desc:"File content, standard base64."`
}

// ExecuteTaskArgs are execute_task's arguments.
type ExecuteTaskArgs struct {
	Task          string     `json:"task" validate:"required,max=32768,clean" audit:"digest" desc:"What the agent should do, in plain language."`
	SessionID     string     `json:"session_id,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Reuse this session's workspace and its files; omit to start a new session."`
	Files         []TaskFile `json:"files,omitempty" validate:"omitempty,max=100,dive" audit:"digest" desc:"Files to put in the workspace before the agent starts (at most 100, 10 MiB decoded in all); existing files of the same path are replaced."`
	Timeout       int        `json:"timeout,omitempty" validate:"omitempty,min=1,max=3600" desc:"Seconds the agent may work (default 300, at most your tier's maximum); then it is stopped with everything it started."`
	Agent         string     `json:"agent,omitempty" validate:"omitempty,oneof=claude-code opencode" audit:"clear" desc:"Which coding agent runs the task (default claude-code)."`
	Model         string     `json:"model,omitempty" validate:"omitempty,max=64,clean" audit:"clear" desc:"Model the agent uses; one of the broker's allowed models (default the first)."`
	Network       NetworkArg `json:"network,omitempty" audit:"clear" desc:"Network beside the model gateway: \"none\" (default), {\"allowed_domains\": [...]} or \"public\", as far as your tier allows. Private, loopback, link-local and metadata addresses are always refused."`
	RepoID        string     `json:"repo_id,omitempty" validate:"omitempty,session_id,required_with=Branch" audit:"clear" desc:"Allow-listed repository to commit the files the agent changed to, once it completes (with branch)."`
	Branch        string     `json:"branch,omitempty" validate:"omitempty,max=200,clean,required_with=RepoID" audit:"clear" desc:"Work branch for that commit."`
	CreatePR      bool       `json:"create_pr,omitempty" desc:"Open a pull request for that commit."`
	CommitMessage string     `json:"commit_message,omitempty" validate:"omitempty,max=200,clean" audit:"digest" desc:"Commit message (default: the task's first line)."`
}

// TaskResult is execute_task's answer, and the task event's detail.
type TaskResult struct {
	ExecutionID string `json:"execution_id"`
	SessionID   string `json:"session_id"`
	// Status is completed, failed or timeout; running while the agent
	// still works (follow it with get_execution_output).
	Status          string   `json:"status"`
	Output          string   `json:"output"`
	FilesCreated    []string `json:"files_created"`
	DurationSeconds float64  `json:"duration_seconds"`
	Error           string   `json:"error,omitempty"`
	// ErrorCode is QUOTA_EXCEEDED when the model budget ran out.
	ErrorCode   string              `json:"error_code,omitempty"`
	Commit      *GitHubCommitResult `json:"commit,omitempty"`
	CommitError string              `json:"commit_error,omitempty"`
	Files       []FileRef           `json:"files,omitempty"`
	Hint        string              `json:"hint,omitempty"`
	Agent       string              `json:"agent,omitempty"`
	Model       string              `json:"model,omitempty"`
	Network     string              `json:"network,omitempty"`
	Turns       int                 `json:"turns,omitempty"`
}

// Task statuses beside the execution's.
const (
	TaskCompleted = "completed"
	TaskFailed    = "failed"
	TaskTimeout   = "timeout"
)

// taskPlan is a validated execute_task call.
type taskPlan struct {
	files   map[string][]byte
	timeout time.Duration
	agent   string
	model   string
	policy  egress.Policy
	limits  modelgw.Limits
}

// plan checks everything before anything is held or started: a refused
// call starts no container and touches no workspace.
func (t *Tasks) plan(ctx context.Context, p identity.Principal, a *ExecuteTaskArgs) (taskPlan, error) {
	pol := t.Policy(p)
	pl := taskPlan{timeout: t.DefaultTimeout, agent: cmp.Or(a.Agent, agenttask.ClaudeCode), model: a.Model,
		policy: egress.Policy{Mode: egress.ModeNone}, limits: pol.Budget}
	if a.Timeout > 0 {
		pl.timeout = time.Duration(a.Timeout) * time.Second
	}
	if pl.timeout > pol.MaxTimeout {
		return pl, brokererr.New(brokererr.InvalidInput, "timeout may be at most %d seconds for your tier (%s)", int(pol.MaxTimeout/time.Second), p.Tier)
	}
	if pl.model == "" {
		pl.model = t.Models[0]
	} else if !slices.Contains(t.Models, pl.model) {
		return pl, brokererr.New(brokererr.InvalidInput, "model %q is not allowed; allowed: %s", pl.model, strings.Join(t.Models, ", "))
	}
	if a.Network.Policy.Mode != "" { // a value, not a pointer, so the audit row records it
		pl.policy = a.Network.Policy
	}
	if rank(pl.policy.Mode) > rank(pol.Network) {
		return pl, brokererr.New(brokererr.PermissionDenied, "network %q is beyond what your tier (%s) allows tasks: %s", pl.policy.Mode, p.Tier, pol.Network)
	}
	if a.RepoID != "" {
		if t.GitHub == nil {
			return pl, brokererr.New(brokererr.NotConfigured, "GitHub is not configured on this broker")
		}
		if err := t.GitHub.CheckTarget(a.RepoID, a.Branch); err != nil {
			return pl, err
		}
	}
	var err error
	if pl.files, err = decodeTaskFiles(a.Files); err != nil {
		return pl, err
	}
	return pl, t.Gateway.CheckBudget(ctx, p.ID, pl.limits)
}

// rank orders network modes from none to public.
func rank(m egress.Mode) int {
	switch m {
	case egress.ModeAllow:
		return 1
	case egress.ModePublic:
		return 2
	}
	return 0
}

// decodeTaskFiles validates every path and decodes every file.
func decodeTaskFiles(in []TaskFile) (map[string][]byte, error) {
	out := make(map[string][]byte, len(in))
	total := 0
	for i, f := range in {
		rel, err := workspace.ValidatePath(f.Path)
		if err != nil {
			return nil, err
		}
		if _, dup := out[rel]; dup {
			return nil, brokererr.New(brokererr.InvalidInput, "files[%d]: %s is listed twice", i, rel)
		}
		if total+base64.StdEncoding.DecodedLen(len(f.Content)) > maxTaskFilesBytes+2 {
			return nil, brokererr.New(brokererr.FileSizeExceeded, "files hold more than %d bytes in all", maxTaskFilesBytes)
		}
		data, err := base64.StdEncoding.Strict().DecodeString(f.Content)
		if err != nil {
			return nil, brokererr.New(brokererr.InvalidInput, "files[%d] (%s): content is not valid standard base64", i, rel)
		}
		if total += len(data); total > maxTaskFilesBytes {
			return nil, brokererr.New(brokererr.FileSizeExceeded, "files hold more than %d bytes in all", maxTaskFilesBytes)
		}
		out[rel] = data
	}
	return out, nil
}

// ExecuteTask hands a task to a coding agent in the session's sandbox.
func (t *Tasks) ExecuteTask() ServerTool {
	return newTool("execute_task",
		"Hand a whole task to a coding agent (Claude Code, or OpenCode) that works unattended, with auto-approval, in your session's sandbox: it reads and writes files under /mnt/data, runs code and reaches a model only through the broker. Waits up to 50 s; a longer task keeps running as an execution (follow it with get_execution_output, stop it with cancel_execution). Returns the agent's answer and the files it created or changed.",
		maxTaskArgBytes, writeAnnotations("Execute task", true, false),
		func(ctx context.Context, p identity.Principal, a *ExecuteTaskArgs) (*mcp.CallToolResult, error) {
			if err := t.ready(); err != nil {
				return nil, err
			}
			begun := time.Now()
			pl, err := t.plan(ctx, p, a)
			if err != nil {
				return nil, err
			}
			id, sess, err := t.start(ctx, p, a, pl)
			if err != nil {
				return nil, err
			}
			// The wait counts from the call's start: a slow container start
			// must not push the answer past what clients allow a call.
			if wait := min(maxInlineWait-time.Since(begun), pl.timeout+5*time.Second); wait > 0 {
				_, _ = t.Jobs.follow(ctx, p, id, "task", wait)
			}
			res := t.result(ctx, p, id)
			res.SessionID = sess
			return t.withFiles(ctx, p, res)
		})
}

// start launches the agent as an execution. Its stream becomes events; when
// it ends, a task event carries its outcome (and the commit, when asked).
func (t *Tasks) start(ctx context.Context, p identity.Principal, a *ExecuteTaskArgs, pl taskPlan) (string, string, error) {
	id := jobs.NewID() // named before it starts: the gateway's audit rows carry it
	var refusal atomic.Pointer[brokererr.Error]
	reader := agenttask.NewReader(pl.agent)
	begun := time.Now()
	execID, sessID, _, err := t.Jobs.launch(ctx, p, a.SessionID, pl.timeout, func(lease *sessions.Lease) (jobs.StartRequest, error) {
		for path, data := range pl.files {
			if err := lease.Session.WriteFile(ctx, path, data, true); err != nil {
				return jobs.StartRequest{}, err
			}
		}
		before, err := lease.Session.ListFiles(ctx, "")
		if err != nil {
			return jobs.StartRequest{}, err
		}
		proxyFor := t.Jobs.egressBuilder(p, lease, pl.policy)
		gw := t.Gateway.Handler(modelgw.Caller{Principal: p.ID, Limits: pl.limits, SessionID: lease.ID, ExecutionID: id,
			OnRefused: func(e *brokererr.Error) {
				if e.Code == brokererr.QuotaExceeded {
					refusal.Store(e)
				}
			}})
		command, env := agenttask.Command(agenttask.Spec{Agent: pl.agent, Prompt: a.Task, Model: pl.model,
			SmallModel: t.SmallModel, MaxTurns: t.MaxTurns})
		sess, sessID := lease.Session, lease.ID
		return jobs.StartRequest{
			ID:   id,
			Spec: sandbox.JobSpec{Command: command, Language: agent.LangAgent, Env: env, Timeout: pl.timeout},
			// Always a network path: the gateway, beside the session's
			// egress proxy with the task's policy (none by default).
			Egress: func(deny func(jobs.EgressDenial)) (func(net.Listener), error) {
				proxy, err := proxyFor(deny)
				if err != nil {
					return nil, err
				}
				return func(ln net.Listener) { modelgw.Serve(ln, gw, proxy) }, nil
			},
			Network: "model-gateway+" + pl.policy.String(),
			Stdout:  reader.Feed,
			Final: func(x sandbox.JobExit, cancelled bool) []jobs.Event {
				res := TaskResult{ExecutionID: id, SessionID: sessID, Agent: pl.agent, Model: pl.model,
					Network: pl.policy.String(), DurationSeconds: time.Since(begun).Round(time.Millisecond).Seconds()}
				evs := reader.Flush()
				settle(&res, reader.Outcome(), x, cancelled, refusal.Load())
				fctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				changed := changedFiles(fctx, sess, before)
				res.FilesCreated = make([]string, 0, len(changed))
				for _, f := range changed {
					res.FilesCreated = append(res.FilesCreated, f.Path)
				}
				if a.RepoID != "" && res.Status == TaskCompleted {
					t.commit(fctx, &res, sess, changed, a)
				}
				detail, _ := json.Marshal(res)
				return append(evs, jobs.Event{Type: jobs.EventTask, Detail: detail})
			},
		}, nil
	})
	return execID, sessID, err
}

// settle decides the task's status from how the execution ended and what
// the agent's stream said.
func settle(res *TaskResult, o agenttask.Outcome, x sandbox.JobExit, cancelled bool, refused *brokererr.Error) {
	res.Output, res.Turns, res.Status = o.Output, o.Turns, TaskFailed
	switch {
	case x.TimedOut:
		res.Status, res.Error = TaskTimeout, "the task did not finish within its timeout; the agent and everything it started were stopped"
	case cancelled:
		res.Error = "the task was cancelled; the agent and everything it started were stopped"
	case x.Err != nil:
		res.Error = "the task's sandbox stopped answering"
		if e := brokererr.As(x.Err); e != nil {
			res.Error, res.ErrorCode = e.Message, string(e.Code)
		}
	case refused != nil:
		res.Error, res.ErrorCode = refused.Message, string(refused.Code)
	case o.IsError:
		res.Error = cmp.Or(o.Error, "the agent reported an error")
	case x.ExitCode != 0 || x.Signal != "":
		res.Error = "the agent exited abnormally (" + cmp.Or(x.Signal, "non-zero exit") + ")"
	case !o.Ended:
		res.Error = "the agent ended without an answer"
	default:
		res.Status = TaskCompleted
	}
}

// changedFiles lists the workspace files created or changed since before.
func changedFiles(ctx context.Context, s sandbox.Session, before []sandbox.FileInfo) []sandbox.FileInfo {
	after, err := s.ListFiles(ctx, "")
	if err != nil {
		return nil
	}
	old := make(map[string]sandbox.FileInfo, len(before))
	for _, f := range before {
		old[f.Path] = f
	}
	var out []sandbox.FileInfo
	for _, f := range after {
		if o, ok := old[f.Path]; !ok || o.Size != f.Size || !o.ModTime.Equal(f.ModTime) {
			out = append(out, f)
		}
	}
	return out
}

// commit writes the changed files to the work branch, as
// commit_session_files does: read by the broker, the token never in the
// sandbox. Its failure is reported beside the task's success.
func (t *Tasks) commit(ctx context.Context, res *TaskResult, s sandbox.Session, changed []sandbox.FileInfo, a *ExecuteTaskArgs) {
	switch {
	case len(changed) == 0:
		res.CommitError = "the agent changed no files; nothing was committed"
		return
	case len(changed) > ghsvc.MaxFiles:
		res.CommitError = "the agent changed more files than one commit may hold; nothing was committed"
		return
	}
	files := make(map[string][]byte, len(changed))
	for _, f := range changed {
		if _, err := ghsvc.ValidateRepoPath(f.Path); err != nil {
			res.CommitError = f.Path + " cannot be committed (" + string(brokererr.CodeOf(err)) + "); nothing was committed"
			return
		}
		data, err := s.ReadFile(ctx, f.Path, 0, ghsvc.MaxFileBytes+1)
		if err != nil || len(data.Data) > ghsvc.MaxFileBytes {
			res.CommitError = f.Path + " could not be read or is larger than a commit allows; nothing was committed"
			return
		}
		files[f.Path] = data.Data
	}
	msg := a.CommitMessage
	if msg == "" {
		msg, _, _ = strings.Cut(a.Task, "\n")
		msg = capRunes("Agent task: "+msg, 200)
	}
	cr, err := t.GitHub.Commit(ctx, ghsvc.CommitRequest{RepoID: a.RepoID, Branch: a.Branch, Files: files, Message: msg, CreatePR: a.CreatePR})
	if err != nil {
		res.CommitError = string(brokererr.CodeOf(err))
		if e := brokererr.As(err); e != nil {
			res.CommitError += ": " + e.Message
		}
		return
	}
	res.Commit = &GitHubCommitResult{Success: true, CommitSHA: cr.CommitSHA, Branch: cr.Branch, PRURL: cr.PRURL}
}

func capRunes(s string, n int) string {
	r := []rune(s)
	if len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

// result reads a task's outcome: the task event once the execution ended,
// else a running status.
func (t *Tasks) result(ctx context.Context, p identity.Principal, id string) TaskResult {
	running := TaskResult{ExecutionID: id, Status: jobs.StatusRunning, FilesCreated: []string{},
		Hint: "the agent is still working: follow it with get_execution_output (wait=true), stop it with cancel_execution; the last event, of type task, has the outcome"}
	info, err := t.Jobs.Jobs.Status(ctx, p.ID, id)
	if err != nil || info.Status == jobs.StatusRunning {
		return running
	}
	out, err := t.Jobs.Jobs.Read(ctx, p.ID, id, jobs.ReadRequest{Since: max(info.LastSeq-4, 0), MaxEvents: 8, MaxBytes: 1 << 20})
	if err == nil {
		for _, ev := range slices.Backward(out.Events) {
			var res TaskResult
			if ev.Type == jobs.EventTask && json.Unmarshal(ev.Detail, &res) == nil {
				return res
			}
		}
	}
	// Ended without its outcome (the broker stopped meanwhile).
	return TaskResult{ExecutionID: id, Status: TaskFailed, FilesCreated: []string{}, Error: cmp.Or(info.Error, "the task ended without an outcome")}
}

// withFiles adds resource links (and signed links) for the files created.
func (t *Tasks) withFiles(ctx context.Context, p identity.Principal, res TaskResult) (*mcp.CallToolResult, error) {
	e := t.Jobs.Engine
	if len(res.FilesCreated) == 0 || res.SessionID == "" {
		return jsonResult(res)
	}
	lease, err := e.Sessions.Acquire(ctx, p.ID, res.SessionID, false)
	if err != nil {
		return jsonResult(res)
	}
	defer lease.Release()
	list, err := lease.Session.ListFiles(ctx, "")
	if err != nil {
		return jsonResult(res)
	}
	var changed []sandbox.FileInfo
	for _, f := range list {
		if slices.Contains(res.FilesCreated, f.Path) {
			changed = append(changed, f)
		}
	}
	return prependJSON(e.filesResult(ctx, lease, changed, &res.Files), res)
}
