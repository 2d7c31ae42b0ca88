package tools

import (
	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// Deps are what the tools need, injected by the broker.
type Deps struct {
	Usage  UsageReader
	Limits func(identity.Principal) quota.Limits
	Engine *Engine
}

// Toolset names, also accepted by MCP_TOOLSETS / --toolsets.
const (
	ToolsetAccount = "account"
	ToolsetSandbox = "sandbox"
	ToolsetFiles   = "files"
)

func init() {
	for _, n := range []string{ToolsetAccount, ToolsetSandbox, ToolsetFiles} {
		config.KnownToolsets[n] = true
	}
}

// DefaultGroup assembles every toolset.
func DefaultGroup(d Deps) *Group {
	account := NewToolset(ToolsetAccount, "Who you are and what you may still use").
		AddReadTools(GetUsage(d.Usage, d.Limits))
	sandbox := NewToolset(ToolsetSandbox, "Run code in hardened per-session sandboxes").
		AddReadTools(ListRunners(d.Engine)).
		AddWriteTools(RunCode(d.Engine), CloseSession(d.Engine))
	files := NewToolset(ToolsetFiles, "Session files and signed download links").
		AddReadTools(ListArtifacts(d.Engine), ReadArtifact(d.Engine)).
		AddWriteTools(UploadFile(d.Engine))
	return &Group{sets: []*Toolset{account, sandbox, files}}
}
