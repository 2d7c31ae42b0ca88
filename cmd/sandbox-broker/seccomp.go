package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/sandbox-broker/sandbox-broker/services/docker"
)

// seccompCmd prints the sandboxes' seccomp profile (the Docker engine's,
// services/docker/seccomp.go) for a Kubernetes node's kubelet seccomp
// directory: SANDBOX_K8S_SECCOMP=Localhost/<file> then applies it to pods.
func seccompCmd(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("seccomp-profile", flag.ContinueOnError)
	fs.SetOutput(stderr)
	runtime := fs.String("runtime", "runc", "the node's runtime: runc, or runsc (gVisor) which needs clone3")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 || (*runtime != "runc" && *runtime != docker.RuntimeRunsc) {
		fmt.Fprintln(stderr, "usage: sandbox-broker seccomp-profile [--runtime runc|runsc]")
		return 2
	}
	fmt.Fprintln(stdout, docker.SeccompProfileJSON(*runtime))
	return 0
}
