// Package agent is the process that runs inside every sandbox container
// (`sandbox-broker agent`, or cmd/sandbox-agent: the agent built alone) and
// the broker's client for it. The broker bind-mounts the agent binary (see
// Binary) read-only at /opt/sandbox/broker and a
// per-container socket directory at /run/sandbox; the agent listens on
// /run/sandbox/agent.sock. The agent runs as the sandbox user, so the
// broker treats everything it says as hostile: sizes are capped and every
// call has a deadline.
package agent

import (
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// SocketDir and SocketName locate the agent's socket inside the container.
const (
	SocketDir  = "/run/sandbox"
	SocketName = "agent.sock"
	// WorkDir is the workspace mount and every run's working directory.
	WorkDir = "/mnt/data"
)

// Request is one run. One request per connection: the client writes one JSON
// line, the agent answers with one JSON line and closes. An empty Language
// means the agent's own --language; unknown fields are rejected.
type Request struct {
	Language       string `json:"language"`
	Code           string `json:"code"`
	TimeoutMS      int64  `json:"timeout_ms"`
	MaxOutputBytes int    `json:"max_output_bytes"` // per stream
	// Mode is ModeFresh ("" too) or ModeNotebook (python only).
	Mode string `json:"mode,omitempty"`
	// Warm, in a ping, starts the runtime of the agent's language (see
	// warm.go) unless it is up or starting.
	Warm bool `json:"warm,omitempty"`
}

// Run modes.
const (
	// ModeFresh runs the code in a new process, as `python3 main.py` would.
	ModeFresh = sandbox.ModeFresh
	// ModeNotebook runs the code as a cell of the agent's Python kernel
	// (IPython's InteractiveShell, see kernel.py), started on first use,
	// which keeps its state across runs.
	ModeNotebook = sandbox.ModeNotebook
)

// Response is the run's outcome.
type Response struct {
	ExitCode   int    `json:"exit_code"`
	Signal     string `json:"signal,omitempty"`
	Stdout     []byte `json:"stdout"`
	Stderr     []byte `json:"stderr"`
	Truncated  bool   `json:"truncated"`
	TimedOut   bool   `json:"timed_out"`
	DurationMS int64  `json:"duration_ms"`
	// Error is set when the agent could not run the code at all.
	Error string `json:"error,omitempty"`
	// Zygote is true when the run was forked from the agent's pre-warmed
	// Python zygote instead of a fresh interpreter (informational).
	Zygote bool `json:"zygote,omitempty"`
	// Warm, in a ping's answer, tells that the runtime of the agent's
	// language is ready (always for a language without one).
	Warm bool `json:"warm,omitempty"`
	// Cold is set on a python run that could not use a warm zygote: it was
	// not up (still preloading, or released when idle) or failed.
	Cold bool `json:"cold,omitempty"`
	// Displays are the run's rich outputs in order: a notebook cell's
	// result and display() calls, and the matplotlib figures it showed or
	// left open (in both modes). At most MaxDisplays, MaxDisplayBytes.
	Displays []Display `json:"displays,omitempty"`
	// DisplaysDropped counts displays left out for the caps.
	DisplaysDropped int `json:"displays_dropped,omitempty"`
	// Exception is a notebook cell's uncaught exception (its traceback is
	// at the end of Stderr).
	Exception *Exception `json:"exception,omitempty"`
	// Kernel is set for notebook runs.
	Kernel *KernelStatus `json:"kernel,omitempty"`
}

// Display is one Jupyter MIME bundle: MIME type to content, text as is and
// images base64-encoded, as in the Jupyter messaging protocol. Only the
// DisplayMIMETypes are kept.
type Display struct {
	// Kind is "result" (a cell's last expression, Jupyter's
	// execute_result) or "display" (display_data: display(), figures).
	Kind string            `json:"kind"`
	Data map[string]string `json:"data"`
}

// Display kinds.
const (
	DisplayResult = sandbox.DisplayResult
	DisplayData   = sandbox.DisplayData
)

// DisplayMIMETypes are the MIME types a Display may carry (kernel.py keeps
// the same list).
var DisplayMIMETypes = []string{"text/plain", "text/html", "image/png", "image/jpeg"}

// Exception is Jupyter's error content without the traceback.
type Exception struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// KernelStatus tells what happened to the notebook kernel in a run.
type KernelStatus struct {
	ExecutionCount int `json:"execution_count,omitempty"`
	// Started is set when this run started a new kernel.
	Started bool `json:"started,omitempty"`
	// Lost says why this agent's previous kernel had gone (set with
	// Started; "" when this agent never ran one).
	Lost string `json:"lost,omitempty"`
	// Ended says why the kernel ended during this run ("" when it lives on).
	Ended string `json:"ended,omitempty"`
}

// MaxResponseBytes bounds what the client reads from the agent.
const MaxResponseBytes = 16 << 20

// Limits and defaults applied by the agent.
const (
	// MaxRequestBytes bounds one request line (the code travels inside it).
	// A longer line is answered with Error and the connection is closed.
	MaxRequestBytes = 8 << 20
	// DefaultTimeoutMS applies when Request.TimeoutMS is 0.
	DefaultTimeoutMS = 60_000
	// MaxTimeoutMS is the largest accepted Request.TimeoutMS.
	MaxTimeoutMS = 3_600_000
	// DefaultMaxOutputBytes applies per stream when Request.MaxOutputBytes is 0.
	DefaultMaxOutputBytes = 64 << 10
	// MaxOutputLimit is the largest honoured Request.MaxOutputBytes; larger
	// values are clamped so that both streams, base64-encoded, always fit in
	// MaxResponseBytes.
	MaxOutputLimit = 4 << 20
	// MaxDisplays bounds a response's Displays.
	MaxDisplays = 32
	// MaxDisplayBytes bounds the JSON encoding of a response's Displays,
	// so that they and both streams at MaxOutputLimit fit MaxResponseBytes.
	MaxDisplayBytes = 3 << 20
)

// Languages the agent knows. The image decides which interpreters exist; a
// language whose interpreter is missing is answered with Error.
const (
	LangPython     = "python"     // python3 main.py (or the zygote)
	LangTypeScript = "typescript" // tsx main.ts
	LangJavaScript = "javascript" // node main.js
	LangBash       = "bash"       // bash main.sh
	// LangNode is a shell in the Node runner, which carries the web project
	// starters; project builds run through it.
	LangNode = "node" // bash main.sh
	// LangAgent is a shell in the agent runner (coding agents for
	// execute_task), which only tasks use.
	LangAgent = "agent" // bash main.sh
)

// RunLanguages are the languages run_code offers; LangNode is the project
// providers' alone.
var RunLanguages = []string{LangPython, LangTypeScript, LangJavaScript, LangBash}

// JobLanguageOrder is the order in which a job without a language picks its
// runner: the first a backend has. Jobs are shell commands and every
// runner has bash; the python runner also has the most tools, so a
// command's environment does not depend on what the session ran before.
var JobLanguageOrder = []string{LangPython, LangBash, LangNode, LangTypeScript, LangJavaScript}

// PingLanguage makes a cheap liveness request: Request{Language:
// PingLanguage} is answered at once with an empty, successful Response
// (ExitCode 0, no Error) without taking the run lock or starting anything;
// its Zygote field tells whether a warm Python zygote is ready and Warm
// whether the agent's language runtime is; with Warm set it starts that
// runtime. Code, TimeoutMS and MaxOutputBytes are ignored.
const PingLanguage = "__ping__"

// Jobs. A job is a long-lived `bash -c` command that runs beside runs: it
// does not take the run lock and the post-run sweep spares its session.
//
// A client starts one by sending, as the connection's first line, a
// JobRequest with "op":"job" (run requests carry no "op"). The connection
// then stays open and carries one JSON JobFrame per line in both directions:
//
//	agent → client  started {pid} first, then out {s, d}, ack {id, error},
//	                and finally exit {code, signal, timed_out, duration_ms};
//	                or a single error {kind, error} when the job is refused.
//	client → agent  stdin {id, d}, close_stdin {id}, signal {id, sig};
//	                every command is answered with an ack carrying its id.
//
// At most one stdin or close_stdin command may be unanswered at a time (a
// second one is refused with an ack error); signals are answered at once.
// When the client's connection drops, the agent kills the job.
type JobRequest struct {
	Command string `json:"command"`
	// WorkDir is an absolute path inside the sandbox, under the agent's
	// WorkDir once symlinks are resolved; "" is the agent's WorkDir.
	WorkDir string   `json:"work_dir,omitempty"`
	Env     []string `json:"env,omitempty"` // KEY=VALUE, added to the base env
	// TimeoutMS ends the job (its whole session) when it elapses; 0 means
	// DefaultTimeoutMS, at most MaxTimeoutMS.
	TimeoutMS   int64 `json:"timeout_ms"`
	Interactive bool  `json:"interactive,omitempty"`
	// EgressSocket is the path, inside the sandbox, of a Unix socket
	// directly in the agent's socket directory; the agent forwards a
	// loopback TCP port to it and points the job's proxy variables there.
	EgressSocket string `json:"egress_socket,omitempty"`
	// EgressTunnel, in pod mode, is a token (sandbox.NewID) naming the egress
	// tunnels the broker opens for this job (tunnel.go) instead of a socket.
	EgressTunnel string `json:"egress_tunnel,omitempty"`
}

// OpJob is the "op" of a job request's first line.
const OpJob = "job"

// JobFrame is one line of a job connection; T says which fields matter.
type JobFrame struct {
	T          string `json:"t"`
	ID         uint64 `json:"id,omitempty"`  // command / ack correlation
	PID        int    `json:"pid,omitempty"` // started
	S          string `json:"s,omitempty"`   // out: "stdout" | "stderr"
	D          []byte `json:"d,omitempty"`   // out, stdin
	Sig        string `json:"sig,omitempty"` // signal: one of JobSignals
	Code       int    `json:"code,omitempty"`
	Signal     string `json:"signal,omitempty"`
	TimedOut   bool   `json:"timed_out,omitempty"`
	DurationMS int64  `json:"duration_ms,omitempty"`
	Kind       string `json:"kind,omitempty"` // error: one of the JobErr* kinds
	Error      string `json:"error,omitempty"`
}

// Frame types.
const (
	FrameStarted    = "started"
	FrameOut        = "out"
	FrameExit       = "exit"
	FrameAck        = "ack"
	FrameError      = "error"
	FrameStdin      = "stdin"
	FrameCloseStdin = "close_stdin"
	FrameSignal     = "signal"
)

// Kinds of a refused job (FrameError).
const (
	JobErrInvalid  = "invalid"  // the request is wrong; do not retry as is
	JobErrLimit    = "limit"    // too many jobs; retry later
	JobErrInternal = "internal" // the agent could not start it
)

// Job limits.
const (
	// MaxJobs is how many jobs one agent runs at once.
	MaxJobs = 16
	// MaxJobFrameBytes bounds one frame line in either direction.
	MaxJobFrameBytes = 256 << 10
	// MaxJobChunk bounds the data of one out or stdin frame. Output is
	// coalesced up to this size and flushed at a newline or after
	// JobFlushDelay.
	MaxJobChunk = 32 << 10
	// MaxJobEnv bounds the number of Env entries.
	MaxJobEnv = 256
	// MaxEgressConns bounds the connections a job's egress forwarder holds
	// open at once (both ends of each forwarded connection count).
	MaxEgressConns = 64
)

// JobSignals maps the signal names a client may send to their numbers.
var JobSignals = map[string]syscall.Signal{
	"TERM": syscall.SIGTERM, "KILL": syscall.SIGKILL, "INT": syscall.SIGINT, "HUP": syscall.SIGHUP,
}

// JobFlushDelay is how long a partial output line waits for more data.
const JobFlushDelay = 50 * time.Millisecond
