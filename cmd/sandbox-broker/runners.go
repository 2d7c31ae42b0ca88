package main

import (
	"flag"
	"fmt"
	"io"
	"path/filepath"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/process"
	"github.com/sandbox-broker/sandbox-broker/services/runnerfs"
)

// stringList is a repeatable flag.
type stringList []string

func (l *stringList) String() string     { return fmt.Sprint(*l) }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

// runnersCmd seals a freshly exported runner file system (runners/build.sh
// calls it) or verifies the runners the process backend would use.
func runnersCmd(args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	sub := args[0]
	fs := flag.NewFlagSet("runners "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	switch sub {
	case "seal":
		var m runnerfs.Manifest
		var env stringList
		dir := fs.String("dir", "", "generation directory holding rootfs/ (required)")
		fs.StringVar(&m.Language, "language", "", "runner language (required)")
		fs.StringVar(&m.Image, "image", "", "runner image name, e.g. sandbox-broker/runner-python:latest (required)")
		fs.StringVar(&m.ImageID, "image-id", "", "ID of the exported image (sha256:…)")
		fs.StringVar(&m.BuiltBy, "built-by", "docker-export", "docker-export or debootstrap")
		fs.Var(&env, "env", "the image's environment, KEY=value (repeatable)")
		if err := fs.Parse(args[1:]); err != nil {
			return 2
		}
		if *dir == "" {
			fmt.Fprintln(stderr, "runners seal: --dir is required")
			return 2
		}
		m.Env = env
		got, err := runnerfs.Seal(*dir, m, process.Layout())
		if err != nil {
			fmt.Fprintln(stderr, "runners seal:", err)
			return 1
		}
		fmt.Fprintf(stdout, "sealed %s (%s): %d entries, %d MB, tree %s\n", got.Language, got.Short(), got.Entries, got.Bytes>>20, got.Tree[:19])
		return 0
	case "verify":
		root := fs.String("root", firstNonEmpty(getenv("SANDBOX_ROOT"), config.Defaults().Root), "state directory (SANDBOX_ROOT)")
		dir := fs.String("dir", getenv("SANDBOX_RUNNERS_DIR"), "runners directory (default <root>/runners)")
		if err := fs.Parse(args[1:]); err != nil {
			return 2
		}
		if *dir == "" {
			*dir = filepath.Join(*root, "runners")
		}
		list, err := runnerfs.Open(*dir, process.Layout())
		if err != nil {
			fmt.Fprintln(stdout, "FAIL:", err)
			return 1
		}
		if len(list) == 0 {
			fmt.Fprintln(stdout, "no runners: the process backend uses the host's interpreters (build them with make runners)")
			return 1
		}
		for _, r := range list {
			fmt.Fprintf(stdout, "OK: %-10s %s %s (%s, %d entries, %d MB)\n", r.Language, r.Image, r.Short(), r.BuiltBy, r.Entries, r.Bytes>>20)
		}
		return 0
	}
	fmt.Fprintf(stderr, "unknown runners command %q\n%s", sub, usage)
	return 2
}
