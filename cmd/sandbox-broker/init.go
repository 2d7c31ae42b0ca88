package main

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// composeFiles are the names docker compose (v2) and docker-compose (v1)
// look for; init writes .env beside one of them.
var composeFiles = []string{"compose.yaml", "compose.yml", "docker-compose.yml", "docker-compose.yaml"}

// initCmd writes a .env with fresh secrets beside the compose file, so
// that every docker compose command (up, logs, down) reads the same token.
// It never prints a secret unless asked to.
func initCmd(args []string, stdout, stderr io.Writer) int {
	flags := flag.NewFlagSet("init", flag.ContinueOnError)
	flags.SetOutput(stderr)
	dir := flags.String("dir", "", "directory to write .env in (default: this directory, which must hold the compose file)")
	force := flags.Bool("force", false, "replace an existing .env (its secrets are lost)")
	showToken := flags.Bool("show-token", false, "also print the API token")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	if flags.NArg() > 0 {
		fmt.Fprintf(stderr, "init: unexpected argument %q\n", flags.Arg(0))
		return 2
	}
	if *dir == "" {
		*dir = "."
		if composeFile(*dir) == "" {
			fmt.Fprintf(stderr, "init: no compose file (%s) here; run init beside docker-compose.yml or pass --dir\n", strings.Join(composeFiles, ", "))
			return 2
		}
	}
	path := filepath.Join(*dir, ".env")
	token := identity.NewToken()
	env := fmt.Sprintf(`# Written by sandbox-broker init. Keep it private (mode 0600): it holds the
# broker's secrets. docker compose and docker-compose read it for every
# command run in this directory (up, logs, down).
MCP_API_TOKEN=%s
FILE_SECRET=%s
AUDIT_HMAC_KEY=%s
`, token, randomHex(32), randomHex(32))
	if err := writeEnv(path, env, *force); err != nil {
		if errors.Is(err, fs.ErrExist) {
			fmt.Fprintf(stderr, "init: %s exists; keep it, or pass --force to replace it (its secrets are lost: clients need the new token)\n", path)
			return 1
		}
		fmt.Fprintln(stderr, "init:", err)
		return 1
	}
	abs, _ := filepath.Abs(path)
	fmt.Fprintf(stdout, "init: wrote %s (mode 0600) with MCP_API_TOKEN, FILE_SECRET and AUDIT_HMAC_KEY.\n", abs)
	fmt.Fprintf(stdout, "Read the API token with:  grep '^MCP_API_TOKEN=' %s | cut -d= -f2-\n", shellQuote(abs))
	fmt.Fprintln(stdout, "Start the broker with:    docker compose up -d    (Debian's v1: docker-compose up -d)")
	if *showToken {
		fmt.Fprintln(stdout, "MCP_API_TOKEN="+token)
	}
	return 0
}

// composeFile returns the compose file in dir, or "".
func composeFile(dir string) string {
	for _, name := range composeFiles {
		if fi, err := os.Stat(filepath.Join(dir, name)); err == nil && fi.Mode().IsRegular() {
			return name
		}
	}
	return ""
}

// writeEnv creates path with mode 0600, refusing an existing file unless
// force. A replacement is written beside it and renamed over it, so the
// old file stays whole if writing fails.
func writeEnv(path, content string, force bool) error {
	if !force {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		if _, err := f.WriteString(content); err != nil {
			f.Close()
			os.Remove(path)
			return err
		}
		return f.Close()
	}
	if fi, err := os.Lstat(path); err == nil && !fi.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file", path)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".env.tmp-*") // mode 0600
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(content); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// randomHex is n random bytes in hex: the form the broker generates its own
// audit key in, accepted for FILE_SECRET and AUDIT_HMAC_KEY alike.
func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b)
}

// shellQuote quotes a path for a command line the operator copies.
func shellQuote(s string) string {
	if !strings.ContainsAny(s, " '\"\\$`!*?[]{}()<>|&;#~") {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
