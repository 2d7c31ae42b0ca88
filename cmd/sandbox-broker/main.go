// Command sandbox-broker is an MCP server that runs untrusted code in
// hardened sandboxes on behalf of LLM clients.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/inherited"
)

// version is set with -ldflags "-X main.version=…".
var version = "dev"

const usage = `usage:
  sandbox-broker serve [--transport stdio|http] [--addr host:port] [--root dir] [--toolsets a,b] [--read-only] [--log-level lvl]
  sandbox-broker audit verify [--root dir | --db file]
  sandbox-broker audit tail [-n N] [--root dir | --db file]
  sandbox-broker audit export --format jsonl [--since seq] [--follow] [--root dir | --db file]
  sandbox-broker init [--dir dir] [--force] [--show-token]   (writes .env with fresh secrets for docker compose)
  sandbox-broker docs [--readme README.md] [--check]
  sandbox-broker runners verify [--root dir | --dir runners-dir]
  sandbox-broker runners seal --dir generation --language lang --image name [--image-id id] [--built-by how] [--env K=V ...]
  sandbox-broker version
  sandbox-broker agent [--socket path] [--language lang]   (runs inside sandbox containers)
  sandbox-broker seccomp-profile [--runtime runc|runsc]   (the sandboxes' seccomp profile, for Kubernetes nodes)
`

func main() {
	if err := dropInherited(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "sandbox-broker: inherited descriptors:", err)
		os.Exit(1)
	}
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr, os.Getenv))
}

// dropInherited keeps descriptors this process inherited from reaching
// anything it starts: the agent (the sandbox's first program) closes
// them; every other command marks them close-on-exec.
func dropInherited(args []string) error {
	if len(args) > 0 && args[0] == "agent" {
		return inherited.Close()
	}
	return inherited.CloseOnExec()
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer, getenv func(string) string) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	switch args[0] {
	case "serve":
		return serve(ctx, args[1:], stdin, stdout, stderr, getenv)
	case "audit":
		return auditCmd(ctx, args[1:], stdout, stderr, getenv)
	case "agent":
		return agent.Main(ctx, args[1:], stdin, stdout, stderr)
	case "docs":
		return docsCmd(args[1:], stdout, stderr)
	case "seccomp-profile":
		return seccompCmd(args[1:], stdout, stderr)
	case "runners":
		return runnersCmd(args[1:], stdout, stderr, getenv)
	case "init":
		return initCmd(args[1:], stdout, stderr)
	case "version":
		fmt.Fprintln(stdout, "sandbox-broker", version)
		return 0
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "unknown command %q\n%s", args[0], usage)
	return 2
}
