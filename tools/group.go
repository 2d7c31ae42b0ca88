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
}

// Toolset names, also accepted by MCP_TOOLSETS / --toolsets.
const (
	ToolsetAccount = "account"
)

func init() {
	config.KnownToolsets[ToolsetAccount] = true
}

// DefaultGroup assembles every toolset.
func DefaultGroup(d Deps) *Group {
	account := NewToolset(ToolsetAccount, "Who you are and what you may still use").
		AddReadTools(GetUsage(d.Usage, d.Limits))
	return &Group{sets: []*Toolset{account}}
}
