package docker

import (
	"context"
	"time"

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

// agentPing reports whether the agent's zygote is warm.
var agentPing = agent.Ping

// waitWarm waits until the agent reports its zygote preloaded (languages
// without one report ready at once), polling every 20 ms within ctx.
func waitWarm(ctx context.Context, socket string) error {
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		warm, err := agentPing(pctx, socket)
		cancel()
		if err == nil && warm {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
