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
}

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
