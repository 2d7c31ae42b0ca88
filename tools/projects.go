package tools

import (
	"context"
	"sync"
	"time"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// Projects is what the project tools need.
type Projects struct {
	Manager *projects.Manager
	// Runs tracks builds as executions; without it (no sandbox backend,
	// so no job store) build_output waits for the build to end.
	Runs *Jobs
	// BuildWait is how long build_output waits before it returns a build
	// that goes on as an execution; 0 means maxInlineWait.
	BuildWait time.Duration
	Redact    func(string) string // for progress notifications

	mu     sync.Mutex
	builds map[string]liveBuild // sandbox ID → its last build
}

// liveBuild is a build running as an execution.
type liveBuild struct {
	principal, execID string
	runner            *projects.BuildRunner
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
		return brokererr.New(brokererr.NotConfigured, "no project sandbox provider is configured on this broker")
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
	OutputType string `json:"output_type" validate:"required,oneof=console_log build_output preview_url" audit:"clear" desc:"console_log (the app's log), build_output (runs the build and returns its output; a build still running after 50 s goes on as an execution) or preview_url."`
}

// GetSandboxOutput returns a project's log, build output or preview URL.
func (pr *Projects) GetSandboxOutput() ServerTool {
	return newTool("get_sandbox_output",
		"Get a project sandbox's console log, build output (runs the project's build, up to 2 minutes: after 50 s a running build is returned as an execution_id to read with get_execution_output) or preview URL. Output is filtered for secrets and cut to 50 KB.",
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
				if err := pr.build(ctx, p, a.SandboxID, sb, out); err != nil {
					return nil, err
				}
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

// build runs the sandbox's build into out. With a job store the build is
// an execution: the call follows it for BuildWait, streaming its output
// and progress, and a build still running then is returned by its
// execution_id (a second call while it runs follows the same one). The
// outcome audit row says which happened.
func (pr *Projects) build(ctx context.Context, p identity.Principal, id string, sb projects.Sandbox, out map[string]any) error {
	if pr.Runs == nil || pr.Runs.Jobs == nil {
		stop := newNotifier(ctx, pr.Redact).tick(ctx, "build", time.Second)
		b, code, err := sb.Build(ctx)
		stop()
		if err != nil {
			return err
		}
		out["exit_code"], out["success"] = code, code == 0
		out["output"], out["truncated"] = tailOutput(b, maxProjectOutput)
		return nil
	}
	lb, err := pr.startBuild(ctx, p, id, sb)
	if err != nil {
		return err
	}
	wait := pr.BuildWait
	if wait <= 0 {
		wait = maxInlineWait
	}
	res, err := pr.Runs.follow(ctx, p, lb.execID, "build", wait)
	out["execution_id"] = lb.execID
	middleware.OutcomeDetail(ctx, "execution_id", lb.execID)
	out["output"], out["truncated"] = tailOutput(lb.runner.Output(), maxProjectOutput)
	if err != nil || res.Status == jobs.StatusRunning {
		// It goes on: hiding that behind an error would make a retry
		// look like a new build.
		out["status"] = jobs.StatusRunning
		if info, err := pr.Runs.Jobs.Status(ctx, p.ID, lb.execID); err == nil {
			out["next_since"] = info.LastSeq
		}
		out["hint"] = "the build goes on as execution " + lb.execID + ": read the rest with get_execution_output (since=next_since, wait=true) or stop it with cancel_execution"
		middleware.OutcomeDetail(ctx, "build", "continuing as execution "+lb.execID)
		return nil
	}
	code := -1
	if res.ExitCode != nil {
		code = *res.ExitCode
	}
	out["status"], out["exit_code"], out["success"] = res.Status, code, res.Status == jobs.StatusCompleted
	middleware.OutcomeDetail(ctx, "build", res.Status)
	middleware.OutcomeDetail(ctx, "exit_code", code)
	return nil
}

// startBuild starts the sandbox's build as an execution, or returns the
// one still running (the caller owns the sandbox: Manager.Get said so).
// Ended builds are dropped from the table here.
func (pr *Projects) startBuild(ctx context.Context, p identity.Principal, id string, sb projects.Sandbox) (liveBuild, error) {
	pr.mu.Lock()
	for k, b := range pr.builds {
		if pr.Runs.Jobs.Done(b.principal, b.execID) == nil {
			delete(pr.builds, k)
		}
	}
	lb, running := pr.builds[id]
	pr.mu.Unlock()
	if running {
		return lb, nil
	}
	lb = liveBuild{principal: p.ID, runner: projects.NewBuildRunner(sb, 2*maxProjectOutput)}
	network := "none" // local project containers have no network interface
	if name := pr.Manager.Provider().Name(); name != "local" {
		network = "that of the " + name + " VM"
	}
	var err error
	if lb.execID, err = pr.Runs.Jobs.Start(ctx, jobs.StartRequest{
		Principal: p.ID, SessionID: id, SessionKey: "project:" + id, Runner: lb.runner, Network: network,
		Spec: sandbox.JobSpec{Command: projects.BuildCommand, Timeout: projects.CommandTimeout},
	}); err != nil {
		return liveBuild{}, err
	}
	pr.mu.Lock()
	if pr.builds == nil {
		pr.builds = map[string]liveBuild{}
	}
	pr.builds[id] = lb
	pr.mu.Unlock()
	return lb, nil
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
