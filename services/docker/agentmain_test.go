package docker

// When the real broker binary cannot be built (its other packages are
// developed concurrently), the test binary itself is bind-mounted as
// /opt/sandbox/broker and TestMain dispatches to testAgentMain when it is
// started as "agent": it runs the real services/agent server with the
// flags of `sandbox-broker agent`, so these tests always exercise the
// agent package they were built with.

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

func testAgentMain(args []string) int {
	if len(args) == 1 && args[0] == agent.SessionsCommand {
		if err := agent.ServeSessions(os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "agent:", err)
			return 1
		}
		return 0
	}
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	socket := fs.String("socket", agent.SocketDir+"/"+agent.SocketName, "")
	language := fs.String("language", "", "")
	workdir := fs.String("workdir", agent.WorkDir, "")
	tmpdir := fs.String("tmpdir", "/tmp", "")
	sweep := fs.String("sweep", "auto", "")
	noZygote := fs.Bool("no-zygote", false, "")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	mode, err := agent.ParseSweepMode(*sweep)
	if err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	err = agent.Serve(ctx, agent.Options{
		Socket: *socket, Language: *language, WorkDir: *workdir, TmpDir: *tmpdir,
		Sweep: mode, NoZygote: *noZygote, Log: os.Stderr,
	})
	if err != nil && ctx.Err() == nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		return 1
	}
	return 0
}
