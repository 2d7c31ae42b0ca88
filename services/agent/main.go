package agent

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Main runs the in-sandbox agent: `sandbox-broker agent [--socket path
// | --listen addr] [--language lang] [--workdir dir] [--sweep
// auto|container|descendants] [--no-zygote] [--allow-sandbox-clients]
// [--warm-on-request] [--idle-release duration]`. It is the sandbox
// container's main process. `sandbox-broker agent sessions` instead answers
// each line on stdin with the live session IDs in its PID namespace (the
// Docker engine's stray check under gVisor); `sandbox-broker agent install
// <path>` copies the agent binary (see Binary) to path (a Kubernetes pod's
// init container: pods get the agent from the broker's image, not a host
// mount). `sandbox-agent agent …` (cmd/sandbox-agent) is the same command.
func Main(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 2 && args[0] == "install" {
		exe, err := os.Executable()
		if err == nil {
			err = Install(Binary(exe), args[1])
		}
		if err != nil {
			fmt.Fprintln(stderr, "agent: install:", err)
			return 1
		}
		return 0
	}
	if len(args) == 1 && args[0] == SessionsCommand {
		if err := ServeSessions(stdin, stdout); err != nil {
			fmt.Fprintln(stderr, "agent:", err)
			return 1
		}
		return 0
	}
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", filepath.Join(SocketDir, SocketName), "unix socket to listen on")
	language := fs.String("language", "", "sandbox language: python, typescript, javascript or bash")
	workdir := fs.String("workdir", WorkDir, "working directory of every run")
	tmpdir := fs.String("tmpdir", "/tmp", "directory for the per-run code directories")
	sweep := fs.String("sweep", "auto", "which processes are killed after every run: container (all but the agent, PID 1 and the zygote), descendants (the agent's descendants only), auto (container when the agent is PID 1 or a child of PID 1 and not root)")
	noZygote := fs.Bool("no-zygote", false, "do not start the Python zygote")
	allowLocal := fs.Bool("allow-sandbox-clients", false, "in container sweep mode, also accept requests from processes inside the sandbox's PID namespace (refused by default)")
	listen := fs.String("listen", "", "pod mode: listen on this TCP address with mutual TLS instead of the socket (the broker CA comes from $"+CAEnv+")")
	warmOnRequest := fs.Bool("warm-on-request", false, "start the language's runtime (Python zygote, Node resident) only when a ping asks for it")
	idleRelease := fs.Duration("idle-release", 0, "stop the language's runtime after this long without a run (0: never)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "agent: unexpected arguments %q\n", fs.Args())
		return 2
	}
	mode, err := ParseSweepMode(*sweep)
	if err != nil {
		fmt.Fprintln(stderr, "agent:", err)
		return 2
	}
	opts := Options{
		Socket:          *socket,
		Language:        *language,
		WorkDir:         *workdir,
		TmpDir:          *tmpdir,
		Sweep:           mode,
		NoZygote:        *noZygote,
		Log:             stderr,
		AllowLocalPeers: *allowLocal,
		WarmOnRequest:   *warmOnRequest,
		IdleRelease:     *idleRelease,
	}
	if *listen != "" {
		// A pod's agent lives as long as its pod: on SIGTERM (deletion,
		// eviction) it keeps going until the SIGKILL after the grace
		// period, so that a run under way ends with a lost connection the
		// broker reads as a lost pod, not with a result of a killed run.
		// The signals stay caught, not ignored: an ignored signal would
		// stay ignored in every run and job the agent starts.
		ctx = context.WithoutCancel(ctx)
		if err = SetPodLimits(); err == nil {
			opts.Pod, opts.Listener, err = StartPod(*listen, []byte(os.Getenv(CAEnv)), stdout)
		}
		if err != nil {
			fmt.Fprintln(stderr, "agent:", err)
			return 1
		}
	}
	err = Serve(ctx, opts)
	if err != nil && ctx.Err() == nil {
		fmt.Fprintln(stderr, err)
		return 1
	}
	return 0
}
