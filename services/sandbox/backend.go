// Package sandbox defines the backend interface every execution engine
// implements: local Docker first, then a bubblewrap process sandbox and
// hosted providers. Tools talk to a Session, never to a container.
package sandbox

import (
	"context"
	"time"
)

// Runner is one language a backend can run.
type Runner struct {
	Language string `json:"language"`
	Image    string `json:"image"`
	// Source says what a backend without images runs the language on:
	// the image's exported file system, or the host's interpreters.
	Source string `json:"source,omitempty"`
}

// SessionRef names a session's sandbox: WorkspaceID is an unguessable
// 32-hex ID that names the host workspace directory and appears in signed
// URLs; Dir is that directory on the host.
type SessionRef struct {
	WorkspaceID string
	Dir         string
	Principal   string
}

// ExecRequest is one run of code.
type ExecRequest struct {
	Language       string
	Code           string
	Timeout        time.Duration
	MaxOutputBytes int // per stream
	// Mode is ModeFresh (also "") or ModeNotebook.
	Mode string
}

// Run modes: a fresh process per run, or a cell of the session's
// persistent Python kernel.
const (
	ModeFresh    = "fresh"
	ModeNotebook = "notebook"
)

// ExecResult is what a run produced. Output is raw (the tool layer strips
// escapes); Truncated says a stream hit MaxOutputBytes.
type ExecResult struct {
	ExitCode  int
	Signal    string // e.g. "SIGKILL" when killed by a signal
	Stdout    []byte
	Stderr    []byte
	Truncated bool
	TimedOut  bool
	OOMKilled bool
	Duration  time.Duration
	// Changed lists the workspace files the run created or modified.
	Changed []FileInfo
	// Displays are the run's rich outputs in order (a notebook cell's
	// result and displays, matplotlib figures); DisplaysDropped counts
	// those left out for size.
	Displays        []Display
	DisplaysDropped int
	// Exception is a notebook cell's uncaught exception (the traceback
	// ends Stderr).
	Exception *Exception
	// Kernel is set for notebook runs.
	Kernel *KernelStatus
	// Backend names the backend that ran it when it is not the broker's
	// configured one (a Fallback's secondary); "" means Backend.Name().
	Backend string
}

// Display is one rich output as a MIME bundle; image values are decoded
// bytes, text values UTF-8 as the sandbox sent them (unclean).
type Display struct {
	Kind string // DisplayResult or DisplayData
	Data map[string][]byte
}

// Display kinds: a notebook cell's last expression (Jupyter's
// execute_result), or anything else shown (display_data: display(),
// figures).
const (
	DisplayResult = "result"
	DisplayData   = "display"
)

// Exception names a notebook cell's uncaught exception.
type Exception struct {
	Name, Value string
}

// KernelStatus is what a notebook run did to the session's kernel.
type KernelStatus struct {
	ExecutionCount int
	// Started: this run started a new kernel. StateLost: an earlier one
	// of the session had run, so its variables are gone; Reason says why.
	Started   bool
	StateLost bool
	Reason    string
	// Ended says why the kernel ended during this run ("" if it lives on).
	Ended string
}

// StartedLive reports whether the run started a kernel that lives on (false
// for a nil k).
func (k *KernelStatus) StartedLive() bool {
	return k != nil && k.Started && k.Ended == ""
}

// FileInfo describes a workspace file; Path is slash-separated and relative.
type FileInfo struct {
	Path    string
	Size    int64
	ModTime time.Time
}

// File is a (possibly partial) read of one file.
type File struct {
	FileInfo
	Data []byte // bytes [offset, offset+len(Data))
}

// Session is one session's sandbox as the tools see it.
type Session interface {
	Exec(ctx context.Context, req ExecRequest) (ExecResult, error)
	WriteFile(ctx context.Context, path string, data []byte, overwrite bool) error
	ReadFile(ctx context.Context, path string, offset, max int64) (File, error)
	ListFiles(ctx context.Context, dir string) ([]FileInfo, error)
	// PrepareWorkspace creates the workspace if it does not exist yet, owned
	// by the session's user, for writers that bypass the session (signed
	// uploads).
	PrepareWorkspace(ctx context.Context) error
	// Release frees the sandbox's compute (containers) but keeps its files.
	Release(ctx context.Context) error
	// Destroy frees compute and deletes the files.
	Destroy(ctx context.Context) error
}

// Backend creates or claims session sandboxes.
type Backend interface {
	Name() string
	Runners(ctx context.Context) ([]Runner, error)
	Open(ctx context.Context, ref SessionRef) (Session, error)
	// Close releases pooled resources; sessions' files are kept.
	Close(ctx context.Context) error
	Ping(ctx context.Context) error
}
