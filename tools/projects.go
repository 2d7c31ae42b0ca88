package tools

import (
	"context"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
)

// Projects is what the project tools need.
type Projects struct {
	Manager *projects.Manager
}

// Limits of the project tools (the spec's).
const (
	maxInitialFiles     = 20
	maxInitialFileBytes = 1 << 20
	maxWriteFiles       = 10
	maxWriteFileBytes   = 500 << 10
	maxProjectOutput    = 50 << 10
)

func (pr *Projects) ready() error {
	if pr == nil || pr.Manager == nil {
		return brokererr.New(brokererr.Unavailable, "no project sandbox provider is available on this broker")
	}
	return nil
}

// CreateProjectArgs are create_sandbox_for_project's arguments.
type CreateProjectArgs struct {
	ProjectName  string            `json:"project_name" validate:"required,identifier" audit:"clear" desc:"1-50 characters of A-Z a-z 0-9 _ -."`
	Template     string            `json:"template" validate:"required,oneof=react next vue node" audit:"clear" desc:"Starter: react, next, vue or node."`
	InitialFiles map[string]string `json:"initial_files,omitempty" validate:"omitempty,max=20" audit:"keys" desc:"Files to write over the starter: relative path → content (at most 20 files of 1 MB). Paths under .env, .git, node_modules and .codesandbox are refused."`
}

// CreateSandboxForProject creates a project sandbox from a template.
func (pr *Projects) CreateSandboxForProject() ServerTool {
	return newTool("create_sandbox_for_project",
		"Create a private web-project sandbox (react, next, vue or node starter) with your initial files; returns its sandbox_id and preview_url. Sandboxes are destroyed after 1 hour.",
		24<<20, writeAnnotations("Create project sandbox", false, false),
		func(ctx context.Context, p identity.Principal, a *CreateProjectArgs) (*mcp.CallToolResult, error) {
			if err := pr.ready(); err != nil {
				return nil, err
			}
			files, err := projects.Files(a.InitialFiles, projects.FileLimits{MaxFiles: maxInitialFiles, MaxFileBytes: maxInitialFileBytes})
			if err != nil {
				return nil, err
			}
			rec, sb, err := pr.Manager.Create(ctx, p.ID, projects.CreateRequest{ProjectName: a.ProjectName, Template: a.Template, Files: files})
			if err != nil {
				return nil, err
			}
			out := map[string]any{"sandbox_id": rec.ID, "template": rec.Template, "provider": rec.Provider, "expires_at": rec.ExpiresAt}
			// The sandbox exists now, so a link that cannot be made (no
			// public URL over stdio) is explained, not reported as failure.
			if url, err := sb.PreviewURL(ctx); err == nil {
				out["preview_url"] = url
			} else if be := brokererr.As(err); be != nil {
				out["preview_unavailable"] = be.Message
			} else {
				out["preview_unavailable"] = "no preview link could be made; try get_sandbox_output with output_type preview_url"
			}
			return jsonResult(out)
		})
}

// WriteFilesArgs are write_files_to_sandbox's arguments.
type WriteFilesArgs struct {
	SandboxID string            `json:"sandbox_id" validate:"required,max=64,clean" audit:"clear" desc:"A sandbox of yours (list_sandboxes)."`
	Files     map[string]string `json:"files" validate:"required,min=1,max=10" audit:"keys" desc:"Relative path → content, at most 10 files of 500 KB."`
}

// WriteFilesToSandbox writes files into a project sandbox.
func (pr *Projects) WriteFilesToSandbox() ServerTool {
	return newTool("write_files_to_sandbox",
		"Write or replace files in one of your project sandboxes (at most 10 files of 500 KB per call).",
		6<<20, writeAnnotations("Write project files", true, true),
		func(ctx context.Context, p identity.Principal, a *WriteFilesArgs) (*mcp.CallToolResult, error) {
			if err := pr.ready(); err != nil {
				return nil, err
			}
			files, err := projects.Files(a.Files, projects.FileLimits{MaxFiles: maxWriteFiles, MaxFileBytes: maxWriteFileBytes})
			if err != nil {
				return nil, err
			}
			sb, err := pr.Manager.Get(ctx, p.ID, a.SandboxID)
			if err != nil {
				return nil, err
			}
			if err := sb.WriteFiles(ctx, files); err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"sandbox_id": a.SandboxID, "files_written": len(files)})
		})
}

// GetSandboxOutputArgs are get_sandbox_output's arguments.
type GetSandboxOutputArgs struct {
	SandboxID  string `json:"sandbox_id" validate:"required,max=64,clean" audit:"clear" desc:"A sandbox of yours."`
	OutputType string `json:"output_type" validate:"required,oneof=console_log build_output preview_url" audit:"clear" desc:"console_log (the app's log), build_output (runs the build and returns its output) or preview_url."`
}

// GetSandboxOutput returns a project's log, build output or preview URL.
func (pr *Projects) GetSandboxOutput() ServerTool {
	return newTool("get_sandbox_output",
		"Get a project sandbox's console log, build output (runs the project's build, up to 2 minutes) or preview URL. Output is filtered for secrets and cut to 50 KB.",
		0, writeAnnotations("Get project output", false, false),
		func(ctx context.Context, p identity.Principal, a *GetSandboxOutputArgs) (*mcp.CallToolResult, error) {
			if err := pr.ready(); err != nil {
				return nil, err
			}
			sb, err := pr.Manager.Get(ctx, p.ID, a.SandboxID)
			if err != nil {
				return nil, err
			}
			out := map[string]any{"sandbox_id": a.SandboxID, "output_type": a.OutputType}
			switch a.OutputType {
			case projects.OutputPreviewURL:
				url, err := sb.PreviewURL(ctx)
				if err != nil {
					return nil, err
				}
				out["preview_url"] = url
			case projects.OutputBuild:
				b, code, err := sb.Build(ctx)
				if err != nil {
					return nil, err
				}
				out["exit_code"], out["success"] = code, code == 0
				out["output"], out["truncated"] = tailOutput(b, maxProjectOutput)
			default:
				b, err := sb.ConsoleLog(ctx, maxProjectOutput)
				if err != nil {
					return nil, err
				}
				out["output"], out["truncated"] = tailOutput(b, maxProjectOutput)
			}
			return jsonResult(out)
		})
}

// tailOutput keeps the end of long output (where build errors are).
func tailOutput(b []byte, max int) (string, bool) {
	s, _ := cleanOutput(b, len(b)+1)
	if len(s) <= max {
		return s, false
	}
	cut := len(s) - max
	for cut < len(s) && (s[cut]&0xC0) == 0x80 {
		cut++
	}
	return "[output truncated: first bytes dropped]\n" + s[cut:], true
}

// ListSandboxesArgs are list_sandboxes' arguments (none).
type ListSandboxesArgs struct{}

// ListSandboxes lists the caller's project sandboxes.
func (pr *Projects) ListSandboxes() ServerTool {
	return newTool("list_sandboxes", "List your live project sandboxes.",
		0, readAnnotations("List project sandboxes"),
		func(ctx context.Context, p identity.Principal, _ *ListSandboxesArgs) (*mcp.CallToolResult, error) {
			if err := pr.ready(); err != nil {
				return nil, err
			}
			list, err := pr.Manager.List(ctx, p.ID)
			if err != nil {
				return nil, err
			}
			return jsonResult(map[string]any{"sandboxes": list})
		})
}
