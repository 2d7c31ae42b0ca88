// Package agent is the process that runs inside every sandbox container
// (`sandbox-broker agent`) and the broker's client for it. The broker
// bind-mounts its own binary read-only at /opt/sandbox/broker and a
// per-container socket directory at /run/sandbox; the agent listens on
// /run/sandbox/agent.sock. The agent runs as the sandbox user, so the
// broker treats everything it says as hostile: sizes are capped and every
// call has a deadline.
package agent

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
}

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
)

// PingLanguage makes a cheap liveness request: Request{Language:
// PingLanguage} is answered at once with an empty, successful Response
// (ExitCode 0, no Error) without taking the run lock or starting anything;
// its Zygote field tells whether a warm Python zygote is ready. Code,
// TimeoutMS and MaxOutputBytes are ignored.
const PingLanguage = "__ping__"
