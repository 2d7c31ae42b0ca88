package tools

import (
	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// Deps are what the tools need, injected by the broker.
type Deps struct {
	Usage    UsageReader
	Limits   func(identity.Principal) quota.Limits
	Engine   *Engine
	Jobs     *Jobs
	Projects *Projects
	// GitHub is nil when no repository allow-list is configured.
	GitHub       GitHubCommitter
	SessionFiles SessionFiles
	// Tasks is nil when agent tasks are not configured.
	Tasks *Tasks
}

// Toolset names, also accepted by MCP_TOOLSETS / --toolsets.
const (
	ToolsetAccount  = "account"
	ToolsetSandbox  = "sandbox"
	ToolsetFiles    = "files"
	ToolsetJobs     = "jobs"
	ToolsetProjects = "projects"
)

func init() {
	for _, n := range []string{ToolsetAccount, ToolsetSandbox, ToolsetFiles, ToolsetJobs, ToolsetProjects, ToolsetGitHub, ToolsetAgent} {
		config.KnownToolsets[n] = true
	}
}

// DefaultGroup assembles every toolset.
func DefaultGroup(d Deps) *Group {
	account := NewToolset(ToolsetAccount, "Who you are and what you may still use").
		AddReadTools(GetUsage(d.Usage, d.Limits))
	// Both toolsets return links to session files, so both carry the
	// template that makes those links readable.
	fileResources := FileResources(d.Engine)
	sandbox := NewToolset(ToolsetSandbox, "Run code in hardened per-session sandboxes").Needs(ServiceSandbox).
		AddReadTools(ListRunners(d.Engine)).
		AddWriteTools(RunCode(d.Engine), CloseSession(d.Engine)).
		AddResourceTemplates(fileResources)
	files := NewToolset(ToolsetFiles, "Session files as resources, with signed download links").Needs(ServiceSandbox).
		AddReadTools(ListArtifacts(d.Engine), ReadArtifact(d.Engine)).
		AddWriteTools(UploadFile(d.Engine), CreateUploadURL(d.Engine)).
		AddResourceTemplates(fileResources)
	j := d.Jobs
	if j == nil {
		j = &Jobs{Engine: d.Engine}
	}
	jobsSet := NewToolset(ToolsetJobs, "Long-running commands with streaming output, stdin and cancellation").Needs(ServiceSandbox).
		AddReadTools(j.GetExecutionOutput(), j.GetExecutionStatus(), j.ListExecutions()).
		AddWriteTools(j.ExecuteCode(), j.ExecuteCodeAsync(), j.SendStdin(), j.CancelExecution())
	projectsSet := NewToolset(ToolsetProjects, "Web projects in hosted CodeSandbox VMs or local containers, with previews").Needs(ServiceProjects).
		AddReadTools(d.Projects.ListSandboxes()).
		AddWriteTools(d.Projects.CreateSandboxForProject(), d.Projects.WriteFilesToSandbox(), d.Projects.GetSandboxOutput())
	tasks := d.Tasks
	if tasks == nil {
		tasks = &Tasks{Jobs: j}
	}
	agentSet := NewToolset(ToolsetAgent, "Whole tasks for a coding agent that works unattended in your sandbox, reaching models only through the broker").
		Needs(ServiceSandbox, ServiceModels).
		AddReadTools(tasks.GetFiles()).
		AddWriteTools(tasks.ExecuteTask(), CleanupSession(d.Engine))
	return &Group{sets: []*Toolset{account, sandbox, files, jobsSet, projectsSet, GitHubToolset(d.GitHub, d.SessionFiles), agentSet}}
}
