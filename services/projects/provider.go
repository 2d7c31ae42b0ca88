// Package projects runs web projects (react, next, vue, node) in a hosted
// CodeSandbox VM or, without CSB_API_KEY, on the local Docker engine. The
// tools see one Provider; ownership and the TTL live here, not in providers.
package projects

import (
	"context"
	"net/http"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Templates a project can start from.
var Templates = []string{"react", "next", "vue", "node"}

// Output kinds of get_sandbox_output.
const (
	OutputConsoleLog = "console_log"
	OutputBuild      = "build_output"
	OutputPreviewURL = "preview_url"
)

// Limits every provider applies to a project sandbox.
const (
	MemoryBytes    = 512 << 20
	NanoCPUs       = 500_000_000
	CommandTimeout = 2 * time.Minute
	TTL            = time.Hour
)

// ForbiddenPrefixes are refused as any component of a project path.
var ForbiddenPrefixes = workspace.ProjectForbiddenNames

// CreateRequest is a validated create_sandbox_for_project call.
type CreateRequest struct {
	ProjectName string
	Template    string
	// Files are workspace-relative paths (already validated) → content.
	Files map[string][]byte
}

// Provider creates and reaches project sandboxes. IDs are the provider's
// own (CodeSandbox's sandbox ID, or a local 32-hex ID); a provider never
// decides who owns a sandbox.
type Provider interface {
	Name() string // "codesandbox" or "local"
	Create(ctx context.Context, req CreateRequest) (Sandbox, error)
	Open(ctx context.Context, id string) (Sandbox, error)
	// Destroy shuts the sandbox down and deletes it; a missing one is no error.
	Destroy(ctx context.Context, id string) error
	Ping(ctx context.Context) error
	Close(ctx context.Context) error
}

// Sweeper is a Provider that can delete sandboxes of its own that the
// projects table does not list (a crash between create and the row, a lost
// state database), where they would otherwise run and bill unseen.
type Sweeper interface {
	// Sweep deletes the provider's sandboxes for which known reports
	// false, and returns how many it deleted. A known error stops it.
	Sweep(ctx context.Context, known func(ctx context.Context, id string) (bool, error)) (int, error)
}

// Sandbox is one project sandbox.
type Sandbox interface {
	ID() string
	// WriteFiles writes validated paths, creating parent directories.
	WriteFiles(ctx context.Context, files map[string][]byte) error
	// ReadFile reads one validated path (used by commit_session_files).
	ReadFile(ctx context.Context, path string, max int64) ([]byte, error)
	// Build runs the project's build and returns its combined output and
	// exit code; it is bounded by CommandTimeout.
	Build(ctx context.Context) (output []byte, exitCode int, err error)
	// ConsoleLog is the tail of the app's own log.
	ConsoleLog(ctx context.Context, max int) ([]byte, error)
	// PreviewURL is where the app can be seen (signed and expiring for the
	// local provider; with a preview token for private CodeSandbox VMs).
	PreviewURL(ctx context.Context) (string, error)
}

// PreviewServer is implemented by providers whose previews the broker
// serves itself under /preview/{sandbox_id}/. The handler is reached only
// after the broker checked the signed link or cookie for that ID; it gets
// the request with the /preview/{id} prefix stripped.
type PreviewServer interface {
	Preview(ctx context.Context, id string) (http.Handler, error)
}
