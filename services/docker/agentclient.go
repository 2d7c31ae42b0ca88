package docker

import (
	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// agentRun and agentWaitReady talk to a container's agent over its socket
// (services/agent). They are variables so that tests can simulate a hung
// agent. The engine's own deadline (timeout + hardStopMargin) is tighter
// than agent.Run's (timeout + agent.ClientMargin), so the hard stop is ours.
var (
	agentRun       = agent.Run
	agentWaitReady = agent.WaitReady
)
