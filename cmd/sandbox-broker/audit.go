package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
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
	db := fs.String("db", "", "audit database (default DATABASE_URL, else <root>/audit.db)")
	checkpoints := fs.String("checkpoints", "", "checkpoint file (default <root>/audit.checkpoints)")
	n := fs.Int("n", 20, "rows to show (tail)")
	format := fs.String("format", "jsonl", "export format (jsonl)")
	follow := fs.Bool("follow", false, "export: keep streaming rows as they are committed, until interrupted")
	since := fs.Int64("since", 0, "export: only rows after this sequence number (resume where a previous export stopped)")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if *checkpoints == "" {
		dir := *root
		if *db != "" && !statedb.IsPostgresURL(*db) {
			dir = filepath.Dir(*db)
		}
		*checkpoints = filepath.Join(dir, "audit.checkpoints")
	}
	if *db == "" {
		*db = config.Config{Root: *root, DatabaseURL: config.Secret(getenv("DATABASE_URL"))}.AuditPath()
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
		if *follow || *since > 0 {
			return exportFrom(ctx, *db, *format, *since, *follow, stdout, stderr)
		}
		if err := audit.Export(ctx, *db, *format, stdout); err != nil {
			fmt.Fprintln(stderr, "audit export:", err)
			return 1
		}
		return 0
	}
	fmt.Fprintf(stderr, "unknown audit command %q\n%s", sub, usage)
	return 2
}

// exportFrom writes the rows after seq since as JSON lines and, with
// follow, every row committed after them until ctx ends (SIGINT, SIGTERM):
// a SIEM shipper restarts it with the last seq it stored.
func exportFrom(ctx context.Context, db, format string, since int64, follow bool, stdout, stderr io.Writer) int {
	if format != "jsonl" {
		fmt.Fprintf(stderr, "audit export: unknown format %q (want jsonl)\n", format)
		return 2
	}
	if since < 0 {
		fmt.Fprintln(stderr, "audit export: --since must be 0 or more")
		return 2
	}
	enc := json.NewEncoder(stdout)
	emit := func(e audit.Entry) error { return enc.Encode(e) }
	f := audit.Filter{AfterSeq: since}
	var err error
	if follow {
		err = audit.Follow(ctx, db, f, 250*time.Millisecond, emit)
	} else {
		err = audit.Each(ctx, db, f, emit)
	}
	if err != nil {
		fmt.Fprintln(stderr, "audit export:", err)
		return 1
	}
	return 0
}

func firstNonEmpty(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}
