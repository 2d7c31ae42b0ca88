package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/sandbox-broker/sandbox-broker/services/console"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// docsCmd regenerates the README's tool table from the tool definitions,
// and its connect guides from the console's (services/console/guides.md);
// with --check it fails when the README is stale.
func docsCmd(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("docs", flag.ContinueOnError)
	fs.SetOutput(stderr)
	readme := fs.String("readme", "README.md", "README to update")
	check := fs.Bool("check", false, "exit 1 if the README is out of date")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	old, err := os.ReadFile(*readme)
	if err != nil {
		fmt.Fprintln(stderr, "docs:", err)
		return 2
	}
	updated, err := tools.ReplaceDocs(string(old), tools.DocsMarkdown(tools.DefaultGroup(tools.Deps{})))
	if err == nil {
		updated, err = console.ReplaceReadmeGuides(updated)
	}
	if err != nil {
		fmt.Fprintln(stderr, "docs:", err)
		return 2
	}
	if updated == string(old) {
		fmt.Fprintln(stdout, "docs: README is up to date")
		return 0
	}
	if *check {
		fmt.Fprintln(stderr, "docs: README tool table or connect guides are stale; run: go run ./cmd/sandbox-broker docs")
		return 1
	}
	if err := os.WriteFile(*readme, []byte(updated), 0o644); err != nil {
		fmt.Fprintln(stderr, "docs:", err)
		return 2
	}
	fmt.Fprintln(stdout, "docs: README updated")
	return 0
}
