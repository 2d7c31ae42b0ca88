// Command sandbox-agent is sandbox-broker's in-sandbox agent built alone:
// `sandbox-agent agent [flags]` is `sandbox-broker agent [flags]` (see
// agent.Main). The broker puts it in its sandboxes when it finds it beside
// its own executable (agent.Binary): it links only the agent, so it starts
// in milliseconds, where the broker's binary spends tens of them running
// the initialisers of everything the broker links.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/inherited"
)

const usage = "usage: sandbox-agent agent [--socket path] [--language lang] ...   (runs inside sandboxes; the flags are sandbox-broker agent's)\n"

func main() {
	if len(os.Args) < 2 || os.Args[1] != "agent" {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	// The sandbox's first program: what it inherited reaches nothing it
	// starts (as in sandbox-broker agent).
	if err := inherited.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "sandbox-agent: inherited descriptors:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := agent.Main(ctx, os.Args[2:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
