package tools

import (
	"cmp"
	"context"
	"encoding/json"
	"net"
	"regexp"
	"strings"
	"time"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/egress"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Jobs is what the execution tools need beyond the Engine.
type Jobs struct {
	Engine *Engine
	Jobs   *jobs.Manager
	// Egress returns the proxy a job of the principal's session (by
	// workspace ID) reaches the network through under policy, reporting
	// each request's verdict to onDecision; it is only called for policies
	// other than none.
	Egress func(principal, sessionKey string, policy egress.Policy, onDecision func(egress.Decision)) (func(net.Listener), error)
}

// Limits of the execution tools.
const (
	maxInlineWait   = 50 * time.Second // below the 60 s many clients allow a call
	defaultPollWait = 25 * time.Second
	// gatherWindow: a long-poll that got output keeps collecting this long,
	// so a job printing line by line is not one call per line.
	gatherWindow  = 250 * time.Millisecond
	maxPageEvents = 500
	maxPageBytes  = 64 << 10
	maxStdinBytes = 64 << 10
	maxEnvVars    = 64
	maxEnvBytes   = 32 << 10
	maxListed     = 100
)

func (j *Jobs) ready() error {
	if j == nil || j.Jobs == nil {
		return brokererr.New(brokererr.NotConfigured, "no sandbox backend is available on this broker")
	}
	return j.Engine.ready()
}

// NetworkArg is sandbox_config.network: "none", "public" or an object
// with allowed_domains / denied_domains.
type NetworkArg struct {
	Policy egress.Policy
}

// UnmarshalJSON parses strictly; errors are structured.
func (n *NetworkArg) UnmarshalJSON(b []byte) error {
	p, err := egress.ParsePolicy(json.RawMessage(b))
	if err != nil {
		return err
	}
	n.Policy = p
	return nil
}

// MarshalJSON is the normalised policy as the audit log records it: the
// mode and, for an allow-list, its allowed and denied domains.
func (n NetworkArg) MarshalJSON() ([]byte, error) {
	p := n.Policy
	if p.Mode == "" {
		p.Mode = egress.ModeNone
	}
	m := map[string]any{"mode": p.Mode}
	if p.Mode == egress.ModeAllow {
		m["allowed_domains"], m["denied_domains"] = append([]string{}, p.Allowed...), append([]string{}, p.Denied...)
	}
	return json.Marshal(m)
}

// JSONSchema publishes the union.
func (NetworkArg) JSONSchema() map[string]any { return egress.JSONSchema() }

// SandboxConfig is execute_code's sandbox_config.
type SandboxConfig struct {
	Network *NetworkArg `json:"network,omitempty" audit:"clear" desc:"Egress: \"none\" (default), \"public\" (any public address), or {\"allowed_domains\": [\"api.example.com\", \"*.example.org\"], \"denied_domains\": [...]}. Private, loopback, link-local and metadata addresses are always refused."`
}

// ExecuteCodeAsyncArgs are execute_code_async's arguments. The
// timeout's upper bound is SANDBOX_MAX_TIMEOUT, added by timeoutRule.
type ExecuteCodeAsyncArgs struct {
	Command          string            `json:"command" validate:"required,max=65536,clean" audit:"digest" desc:"Shell command, run with bash -c in the session's sandbox."`
	SessionID        string            `json:"session_id,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Session to use; omit to start a new one."`
	TimeoutSeconds   int               `json:"timeout_seconds,omitempty" validate:"omitempty,min=1" desc:"Wall-clock limit; the whole process tree is killed when it passes (default 60)."`
	Interactive      bool              `json:"interactive,omitempty" desc:"Keep stdin open for send_stdin."`
	WorkingDirectory string            `json:"working_directory,omitempty" validate:"omitempty,max=1024,clean" audit:"clear" desc:"Directory relative to the workspace (/mnt/data); it must stay inside it."`
	Environment      map[string]string `json:"environment,omitempty" validate:"omitempty,max=64,dive,max=8192,clean" audit:"keys" desc:"Extra environment variables (names [A-Za-z_][A-Za-z0-9_]*; loader, shell-startup and proxy variables are refused)."`
	SandboxConfig    *SandboxConfig    `json:"sandbox_config,omitempty" audit:"clear" desc:"Per-execution sandbox settings."`
}

// ExecuteCodeArgs are execute_code's arguments.
type ExecuteCodeArgs struct {
	ExecuteCodeAsyncArgs
	WaitForCompletion *bool `json:"wait_for_completion,omitempty" desc:"Wait (up to 50 s) for the command to finish (default true). If it is still running, poll with get_execution_output."`
}

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,127}$`)

// deniedEnv are variables that change how programs load or how the shell
// starts, or that would point traffic past the egress proxy.
var deniedEnv = map[string]bool{
	"BASH_ENV": true, "ENV": true, "IFS": true, "PS4": true, "SHELLOPTS": true, "BASHOPTS": true,
	"PROMPT_COMMAND": true, "CDPATH": true, "GLOBIGNORE": true, "PATH": true,
	"HTTP_PROXY": true, "HTTPS_PROXY": true, "ALL_PROXY": true, "NO_PROXY": true, "FTP_PROXY": true,
	"NODE_OPTIONS": true, "PYTHONSTARTUP": true, "PYTHONPATH": true, "PERL5OPT": true, "RUBYOPT": true,
}

func checkEnv(env map[string]string) error {
	total := 0
	for k, v := range env {
		if !envName.MatchString(k) {
			return brokererr.New(brokererr.InvalidInput, "environment name %q is not allowed; use [A-Za-z_][A-Za-z0-9_]*", truncateName(k))
		}
		u := strings.ToUpper(k)
		if deniedEnv[u] || strings.HasPrefix(u, "LD_") || strings.HasPrefix(u, "DYLD_") || strings.HasPrefix(u, "BASH_FUNC_") || strings.HasPrefix(u, "SANDBOX_") {
			return brokererr.New(brokererr.InvalidInput, "environment variable %s may not be set", k)
		}
		total += len(k) + len(v)
	}
	if total > maxEnvBytes {
		return brokererr.New(brokererr.InvalidInput, "environment is larger than %d bytes", maxEnvBytes)
	}
	return nil
}

func truncateName(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}

// ExecutionResult is what execute_code and get_execution_output return.
type ExecutionResult struct {
	ExecutionID string       `json:"execution_id"`
	SessionID   string       `json:"session_id,omitempty"`
	Status      string       `json:"status"`
	ExitCode    *int         `json:"exit_code,omitempty"`
	Output      []jobs.Event `json:"output"`
	Dropped     int64        `json:"dropped,omitempty"`
	NextSince   int64        `json:"next_since"`
	More        bool         `json:"more,omitempty"`
	// EgressDenied says which network requests the sandbox's proxy refused
	// and by which rule: programs often show only "403".
	EgressDenied      []jobs.EgressDenial `json:"egress_denied,omitempty"`
	EgressDeniedOther int                 `json:"egress_denied_other,omitempty"`
	Hint              string              `json:"hint,omitempty"`
	// Backend names the engine that runs the execution (execute_code).
	Backend string `json:"backend,omitempty"`
}

// backendRunner notes which backend started a job (a fallback may run it
// elsewhere than the configured backend).
type backendRunner struct {
	sandbox.JobRunner
	name string
}

func (r *backendRunner) StartJob(ctx context.Context, spec sandbox.JobSpec, sink sandbox.JobSink) (sandbox.Job, error) {
	j, err := r.JobRunner.StartJob(ctx, spec, sink)
	if b, ok := j.(sandbox.BackendReporter); ok && err == nil {
		r.name = b.Backend()
	}
	return j, err
}

// start validates and starts a job; backend names the engine running it.
func (j *Jobs) start(ctx context.Context, p identity.Principal, a *ExecuteCodeAsyncArgs) (execID, sessID, backend string, err error) {
	if err := j.ready(); err != nil {
		return "", "", "", err
	}
	e := j.Engine
	wd := ""
	if a.WorkingDirectory != "" && a.WorkingDirectory != "." {
		if wd, err = workspace.ValidatePath(strings.TrimSuffix(a.WorkingDirectory, "/")); err != nil {
			return "", "", "", err
		}
	}
	if err := checkEnv(a.Environment); err != nil {
		return "", "", "", err
	}
	timeout := e.DefaultTimeout
	if a.TimeoutSeconds > 0 { // at most SANDBOX_MAX_TIMEOUT: timeoutRule
		timeout = time.Duration(a.TimeoutSeconds) * time.Second
	}
	policy := egress.Policy{Mode: egress.ModeNone}
	if a.SandboxConfig != nil && a.SandboxConfig.Network != nil {
		policy = a.SandboxConfig.Network.Policy
	}
	return j.launch(ctx, p, a.SessionID, timeout, func(lease *sessions.Lease) (jobs.StartRequest, error) {
		spec := sandbox.JobSpec{Command: a.Command, WorkDir: wd, Env: a.Environment, Timeout: timeout, Interactive: a.Interactive}
		var network jobs.EgressBuilder
		if policy.Mode != egress.ModeNone && j.Egress != nil {
			network = j.egressBuilder(p, lease, policy)
		}
		return jobs.StartRequest{Spec: spec, Network: policy.String(), Egress: network}, nil
	})
}

// egressBuilder gives a job of lease's session the egress proxy for
// policy, reporting the requests a rule refused as the job's events.
func (j *Jobs) egressBuilder(p identity.Principal, lease *sessions.Lease, policy egress.Policy) jobs.EgressBuilder {
	return func(deny func(jobs.EgressDenial)) (func(net.Listener), error) {
		return j.Egress(p.ID, lease.WorkspaceID, policy, func(d egress.Decision) {
			if !d.Allowed && d.Rule != "" { // refused by a rule, not failed
				deny(jobs.EgressDenial{Host: d.Host, Port: d.Port, Reason: d.Reason, Rule: d.Rule})
			}
		})
	}
}

// launch runs a validated job in the caller's session: it holds timeout of
// the daily execution budget and the session, lets prepare build the job
// (Spec, Network, Egress, the stream hooks; it may use the session, which
// it holds), and starts it. The budget is settled and the session unpinned
// when the job ends; the job is counted in the sandbox metrics then.
// backend names the engine that started it (a fallback may differ).
func (j *Jobs) launch(ctx context.Context, p identity.Principal, sessionID string, timeout time.Duration,
	prepare func(*sessions.Lease) (jobs.StartRequest, error)) (execID, sessID, backend string, err error) {
	e := j.Engine
	hold, err := e.reserveExecution(ctx, p, timeout)
	if err != nil {
		return "", "", "", err
	}
	started := false // from then on OnEnd settles
	defer func() {
		if !started {
			hold.settle(0)
		}
	}()
	lease, err := e.Sessions.Acquire(ctx, p.ID, sessionID, true)
	if err != nil {
		return "", "", "", err
	}
	defer lease.Release()
	hold.started()
	jr, ok := lease.Session.(sandbox.JobRunner)
	if !ok {
		return "", "", "", brokererr.New(brokererr.NotConfigured, "this sandbox backend cannot run executions")
	}
	runner := &backendRunner{JobRunner: jr, name: e.Backend.Name()}
	req, err := prepare(lease)
	if err != nil {
		return "", "", "", err
	}
	req.Principal, req.SessionID, req.SessionKey, req.Runner = p.ID, lease.ID, lease.WorkspaceID, runner
	language := cmp.Or(req.Spec.Language, "shell")
	unpin := lease.Pin()
	started = true
	onEnd := req.OnEnd
	ended := make(chan sandbox.JobExit, 1)
	req.OnEnd = func(x sandbox.JobExit) {
		unpin()
		hold.settle(x.Duration)
		if onEnd != nil {
			onEnd(x)
		}
		ended <- x
	}
	id, err := j.Jobs.Start(ctx, req)
	if err != nil {
		return "", "", "", err // it never ran: not an execution to count
	}
	go func() {
		x := <-ended
		e.observe(language, jobOutcome(x), x.Duration)
	}()
	return id, lease.ID, runner.name, nil
}

// jobOutcome classifies a job's end for the metrics (a cancelled job ends
// by a signal, which counts as an error).
func jobOutcome(x sandbox.JobExit) string {
	switch {
	case x.TimedOut:
		return middleware.ExecTimeout
	case x.Err != nil || x.ExitCode != 0 || x.Signal != "":
		return middleware.ExecError
	}
	return middleware.ExecOK
}

// page reads events after since and cleans their text.
func (j *Jobs) page(ctx context.Context, p identity.Principal, id string, since int64, wait time.Duration) (ExecutionResult, error) {
	out, err := j.Jobs.Read(ctx, p.ID, id, jobs.ReadRequest{Since: since, Wait: wait, MaxEvents: maxPageEvents, MaxBytes: maxPageBytes, Gather: gatherWindow})
	if err != nil {
		return ExecutionResult{}, err
	}
	res := ExecutionResult{ExecutionID: id, Status: out.Status, Dropped: out.Dropped, NextSince: out.Next, More: out.More, Output: out.Events,
		EgressDenied: out.EgressDenied, EgressDeniedOther: out.EgressDeniedOther}
	if res.Output == nil {
		res.Output = []jobs.Event{}
	}
	for i := range res.Output {
		ev := &res.Output[i]
		ev.Data, _ = cleanOutput([]byte(ev.Data), maxPageBytes)
		if (ev.Type == jobs.EventExit || ev.Type == jobs.EventCancelled) && ev.Code != nil {
			res.ExitCode = ev.Code
		}
	}
	switch {
	case res.Dropped > 0:
		res.Hint = "older output was dropped to respect the log's size cap"
	case len(res.EgressDenied) > 0:
		res.Hint = "the sandbox's network proxy refused requests: egress_denied says which host and which rule of sandbox_config.network"
	}
	return res, nil
}

// follow waits up to d for the job to end, streaming its output as
// notifications and a progress tick every second (what names the job in
// it), and returns the events from the start.
func (j *Jobs) follow(ctx context.Context, p identity.Principal, id, what string, d time.Duration) (ExecutionResult, error) {
	n := newNotifier(ctx, j.Engine.Redact)
	defer n.tick(ctx, what, time.Second)()
	done := j.Jobs.Done(p.ID, id)
	timer := time.NewTimer(d)
	defer timer.Stop()
	var seen int64
	for done != nil {
		changed := j.Jobs.Changed(p.ID, id)
		if n != nil && n.outputCut() {
			n.progress(ctx, what+" running") // a sign of life only
		} else if n != nil {
			out, err := j.Jobs.Read(ctx, p.ID, id, jobs.ReadRequest{Since: seen, MaxEvents: maxPageEvents, MaxBytes: maxPageBytes})
			if err == nil {
				for _, ev := range out.Events {
					if text := notifyText(ev); text != "" {
						data, _ := cleanOutput([]byte(text), maxPageBytes)
						n.output(ctx, ev.Type, data)
					}
					n.progress(ctx, what+" "+ev.Type)
				}
				seen = out.Next
			}
		}
		if changed == nil {
			break
		}
		select {
		case <-done:
			done = nil
		case <-changed:
		case <-timer.C:
			done = nil
		case <-ctx.Done():
			done = nil
		}
	}
	return j.page(ctx, p, id, 0, 0)
}

// notifyText is what an event streams as a log message: output, and a
// task's agent text, tool calls, tool results and answer.
func notifyText(ev jobs.Event) string {
	switch ev.Type {
	case jobs.EventStdout, jobs.EventStderr, jobs.EventAssistant, jobs.EventToolResult, jobs.EventResult:
		return ev.Data
	case jobs.EventToolUse:
		return ev.Tool + " " + ev.Data
	}
	return ""
}

func withHint(r ExecutionResult) ExecutionResult {
	if r.Status == jobs.StatusRunning && r.Hint == "" {
		r.Hint = "still running: call get_execution_output with since=next_since (wait=true to long-poll)"
	}
	return r
}

// ExecuteCode runs a shell command as a job and waits for it (bounded).
func (j *Jobs) ExecuteCode() ServerTool {
	return newTool("execute_code",
		"Run a shell command in your session's sandbox as a tracked execution. Waits up to 50 s for it to finish and returns its output events; longer commands keep running and are read with get_execution_output. No network unless sandbox_config.network allows it.",
		256<<10, writeAnnotations("Execute command", false, false),
		func(ctx context.Context, p identity.Principal, a *ExecuteCodeArgs) (*mcp.CallToolResult, error) {
			id, sess, backend, err := j.start(ctx, p, &a.ExecuteCodeAsyncArgs)
			if err != nil {
				return nil, err
			}
			var res ExecutionResult
			if a.WaitForCompletion == nil || *a.WaitForCompletion {
				wait := maxInlineWait
				if a.TimeoutSeconds > 0 && time.Duration(a.TimeoutSeconds)*time.Second+5*time.Second < wait {
					wait = time.Duration(a.TimeoutSeconds)*time.Second + 5*time.Second
				}
				res, err = j.follow(ctx, p, id, "execution", wait)
			} else {
				res, err = j.page(ctx, p, id, 0, 0)
			}
			if err != nil {
				// It has started: hiding that behind an error would make a
				// retry start it twice.
				res = ExecutionResult{ExecutionID: id, Status: jobs.StatusRunning, Output: []jobs.Event{},
					Hint: "started, but its output could not be read just now: call get_execution_output"}
			}
			res.SessionID, res.Backend = sess, backend
			return jsonResult(withHint(res))
		}).withRules(timeoutRule("timeout_seconds", j.Engine))
}

// ExecuteCodeAsync starts a job and returns at once.
func (j *Jobs) ExecuteCodeAsync() ServerTool {
	return newTool("execute_code_async",
		"Start a shell command in your session's sandbox and return at once with its execution_id; read output with get_execution_output, feed input with send_stdin, stop it with cancel_execution.",
		256<<10, writeAnnotations("Start command", false, false),
		func(ctx context.Context, p identity.Principal, a *ExecuteCodeAsyncArgs) (*mcp.CallToolResult, error) {
			id, sess, backend, err := j.start(ctx, p, a)
			if err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"execution_id": id, "session_id": sess, "status": jobs.StatusRunning, "backend": backend})
		}).withRules(timeoutRule("timeout_seconds", j.Engine))
}

// ExecutionIDArgs name one execution.
type ExecutionIDArgs struct {
	ExecutionID string `json:"execution_id" validate:"required,max=64,clean" audit:"clear" desc:"The execution_id from execute_code or execute_code_async."`
}

// GetExecutionOutputArgs are get_execution_output's arguments.
type GetExecutionOutputArgs struct {
	ExecutionID string `json:"execution_id" validate:"required,max=64,clean" audit:"clear" desc:"The execution_id from execute_code or execute_code_async."`
	Since       int64  `json:"since,omitempty" validate:"min=0" desc:"Return events with seq greater than this (the previous call's next_since); 0 for all."`
	Wait        bool   `json:"wait,omitempty" desc:"Long-poll: wait for new events if there are none yet."`
	MaxWaitS    int    `json:"max_wait_s,omitempty" validate:"omitempty,min=1,max=50" desc:"Longest wait in seconds (default 25, at most 50)."`
}

// GetExecutionOutput reads a job's events by cursor.
func (j *Jobs) GetExecutionOutput() ServerTool {
	return newTool("get_execution_output",
		"Read an execution's output events after the cursor `since` (events carry seq; pass the returned next_since next time). With wait=true it long-polls until new output arrives (then gathers for 250 ms more, up to 64 KB) or the execution ends.",
		0, readAnnotations("Read execution output"),
		func(ctx context.Context, p identity.Principal, a *GetExecutionOutputArgs) (*mcp.CallToolResult, error) {
			if err := j.ready(); err != nil {
				return nil, err
			}
			var wait time.Duration
			if a.Wait {
				wait = defaultPollWait
				if a.MaxWaitS > 0 {
					wait = time.Duration(a.MaxWaitS) * time.Second
				}
			}
			res, err := j.page(ctx, p, a.ExecutionID, a.Since, wait)
			if err != nil {
				return nil, err
			}
			return jsonResult(withHint(res))
		})
}

// SendStdinArgs are send_stdin's arguments.
type SendStdinArgs struct {
	ExecutionID string `json:"execution_id" validate:"required,max=64,clean" audit:"clear" desc:"An interactive execution."`
	InputData   string `json:"input_data" validate:"max=65536,clean" audit:"digest" desc:"Text to write to its stdin (include \\n to end a line)."`
	Close       bool   `json:"close,omitempty" desc:"Close stdin after writing (end of input)."`
}

// SendStdin writes to an interactive job's stdin.
func (j *Jobs) SendStdin() ServerTool {
	return newTool("send_stdin", "Write text to the stdin of an execution started with interactive=true; close=true ends its input.",
		128<<10, writeAnnotations("Send stdin", false, false),
		func(ctx context.Context, p identity.Principal, a *SendStdinArgs) (*mcp.CallToolResult, error) {
			if err := j.ready(); err != nil {
				return nil, err
			}
			if a.InputData == "" && !a.Close {
				return nil, brokererr.New(brokererr.InvalidInput, "send input_data, close=true, or both")
			}
			if err := j.Jobs.SendStdin(ctx, p.ID, a.ExecutionID, []byte(a.InputData), a.Close); err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"execution_id": a.ExecutionID, "bytes_written": len(a.InputData), "closed": a.Close})
		})
}

// CancelExecutionArgs are cancel_execution's arguments.
type CancelExecutionArgs struct {
	ExecutionID string `json:"execution_id" validate:"required,max=64,clean" audit:"clear" desc:"The execution to stop."`
	Force       bool   `json:"force,omitempty" desc:"SIGKILL at once instead of SIGTERM then SIGKILL after 5 s."`
}

// CancelExecution stops a job.
func (j *Jobs) CancelExecution() ServerTool {
	return newTool("cancel_execution", "Stop a running execution: SIGTERM to its whole process group, then SIGKILL after 5 s (force=true: SIGKILL at once).",
		0, writeAnnotations("Cancel execution", true, true),
		func(ctx context.Context, p identity.Principal, a *CancelExecutionArgs) (*mcp.CallToolResult, error) {
			if err := j.ready(); err != nil {
				return nil, err
			}
			info, err := j.Jobs.Cancel(ctx, p.ID, a.ExecutionID, a.Force)
			if err != nil {
				return nil, err
			}
			return jsonResult(info)
		})
}

// ListExecutionsArgs are list_executions' arguments.
type ListExecutionsArgs struct {
	SessionID string `json:"session_id,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Only this session's executions."`
}

// ListExecutions lists the caller's executions.
func (j *Jobs) ListExecutions() ServerTool {
	return newTool("list_executions", "List your executions, newest first (at most 100), optionally in one session.",
		0, readAnnotations("List executions"),
		func(ctx context.Context, p identity.Principal, a *ListExecutionsArgs) (*mcp.CallToolResult, error) {
			if err := j.ready(); err != nil {
				return nil, err
			}
			list, err := j.Jobs.List(ctx, p.ID, a.SessionID, maxListed)
			if err != nil {
				return nil, err
			}
			for i := range list {
				list[i].Command = truncateCommand(list[i].Command)
			}
			return jsonResult(map[string]any{"executions": list})
		})
}

func truncateCommand(s string) string {
	s, _ = cleanOutput([]byte(s), 200)
	return s
}

// GetExecutionStatus reports one execution.
func (j *Jobs) GetExecutionStatus() ServerTool {
	return newTool("get_execution_status", "Report an execution's status, exit code and last event seq.",
		0, readAnnotations("Execution status"),
		func(ctx context.Context, p identity.Principal, a *ExecutionIDArgs) (*mcp.CallToolResult, error) {
			if err := j.ready(); err != nil {
				return nil, err
			}
			info, err := j.Jobs.Status(ctx, p.ID, a.ExecutionID)
			if err != nil {
				return nil, err
			}
			info.Command = truncateCommand(info.Command)
			return jsonResult(info)
		})
}
