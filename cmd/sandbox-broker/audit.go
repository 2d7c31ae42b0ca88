package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"path/filepath"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/config"
)

func auditCmd(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	sub := args[0]
	fs := flag.NewFlagSet("audit "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	root := fs.String("root", firstNonEmpty(getenv("SANDBOX_ROOT"), config.Defaults().Root), "state directory (SANDBOX_ROOT)")
	db := fs.String("db", "", "audit database (default <root>/audit.db)")
	checkpoints := fs.String("checkpoints", "", "checkpoint file (default <root>/audit.checkpoints)")
	n := fs.Int("n", 20, "rows to show (tail)")
	format := fs.String("format", "jsonl", "export format (jsonl)")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if *db == "" {
		*db = filepath.Join(*root, "audit.db")
	}
	if *checkpoints == "" {
		*checkpoints = filepath.Join(filepath.Dir(*db), "audit.checkpoints")
	}
	switch sub {
	case "verify":
		keys, err := audit.LoadVerifyKeys(audit.KeyConfig{Root: *root, HMACKey: getenv("AUDIT_HMAC_KEY"), HMACKeyFile: getenv("AUDIT_HMAC_KEY_FILE")})
		if err != nil {
			fmt.Fprintln(stderr, "audit verify: keys:", err)
			return 2
		}
		rep, err := audit.Verify(ctx, audit.VerifyOptions{Path: *db, CheckpointPath: *checkpoints, Keys: keys})
		if err != nil {
			fmt.Fprintln(stderr, "audit verify:", err)
			return 2
		}
		if !rep.OK {
			fmt.Fprintf(stdout, "FAIL: first bad sequence %d: %s (rows %d, checkpoints %d)\n", rep.FirstBadSeq, rep.Problem, rep.Rows, rep.Checkpoints)
			return 1
		}
		fmt.Fprintf(stdout, "OK: %d rows, %d checkpoints verified\n", rep.Rows, rep.Checkpoints)
		return 0
	case "tail":
		if err := audit.Tail(ctx, *db, *n, stdout); err != nil {
			fmt.Fprintln(stderr, "audit tail:", err)
			return 1
		}
		return 0
	case "export":
		if err := audit.Export(ctx, *db, *format, stdout); err != nil {
			fmt.Fprintln(stderr, "audit export:", err)
			return 1
		}
		return 0
	}
	fmt.Fprintf(stderr, "unknown audit command %q\n%s", sub, usage)
	return 2
}

func firstNonEmpty(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}
