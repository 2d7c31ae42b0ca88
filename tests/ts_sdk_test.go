package tests

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// tsRateLimit is RATE_LIMIT_PER_MINUTE for the TypeScript run; the test file
// exhausts it with the free token and budgets the pro tokens' calls under it.
const tsRateLimit = 5

// tsBuildWaitS is PROJECT_BUILD_WAIT_S for the TypeScript run: the slow
// build test's build outlasts it.
const tsBuildWaitS = 3

// TestTypeScriptSDK runs tests/ts (node's test runner, the official
// @modelcontextprotocol/sdk) against a fresh broker. Node and npm are
// required: CI must install them, so their absence is a failure, not a skip.
func TestTypeScriptSDK(t *testing.T) {
	requireNodeRunner(t) // run_code and execute_code need a sandbox backend, project builds the Node runner
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatalf("node is required for the TypeScript SDK tests (install Node.js >= 20 and put it on PATH): %v", err)
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Fatalf("npm is required for the TypeScript SDK tests (it ships with Node.js): %v", err)
	}
	dir, err := filepath.Abs("ts")
	if err != nil {
		t.Fatal(err)
	}
	ensureNodeModules(t, npm, dir)

	tokens := map[string]string{} // principal → token
	var entries []map[string]string
	for _, p := range []struct{ principal, tier string }{
		{"ts-pro", "pro"}, {"ts-pro-aux", "pro"}, {"ts-free", "free"}, {"ts-stream", "pro"},
		{"ts-files", "pro"}, {"ts-files-other", "pro"}, {"ts-build", "pro"},
	} {
		tok := randomToken(t)
		tokens[p.principal] = tok
		sum := sha256.Sum256([]byte(tok))
		entries = append(entries, map[string]string{"principal": p.principal, "tier": p.tier, "token_sha256": hex.EncodeToString(sum[:])})
	}
	raw, err := json.Marshal(entries)
	if err != nil {
		t.Fatal(err)
	}
	tokensFile := filepath.Join(t.TempDir(), "tokens.json")
	if err := os.WriteFile(tokensFile, raw, 0o600); err != nil {
		t.Fatal(err)
	}

	b := StartHTTP(t, BrokerOpts{Env: map[string]string{
		"MCP_TOKENS_FILE":       tokensFile,
		"RATE_LIMIT_PER_MINUTE": strconv.Itoa(tsRateLimit),
		"PROJECT_BUILD_WAIT_S":  strconv.Itoa(tsBuildWaitS),
	}})

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "--test", "--test-reporter=spec") // no paths: default discovery of *.test.mjs, skipping node_modules, on every Node version
	cmd.Dir = dir
	cmd.Env = append(os.Environ(),
		"BROKER_URL="+b.URL,
		"BROKER_TOKEN="+tokens["ts-pro"],
		"BROKER_AUX_TOKEN="+tokens["ts-pro-aux"],
		"BROKER_FREE_TOKEN="+tokens["ts-free"],
		"BROKER_STREAM_TOKEN="+tokens["ts-stream"],
		"BROKER_FILES_TOKEN="+tokens["ts-files"],
		"BROKER_FILES_OTHER_TOKEN="+tokens["ts-files-other"],
		"BROKER_BUILD_TOKEN="+tokens["ts-build"],
		"BROKER_BUILD_WAIT_S="+strconv.Itoa(tsBuildWaitS),
		"BROKER_RATE_LIMIT="+strconv.Itoa(tsRateLimit),
		"NO_COLOR=1",
	)
	cmd.WaitDelay = 10 * time.Second
	start := time.Now()
	out, err := cmd.CombinedOutput()
	elapsed := time.Since(start).Round(time.Millisecond)
	if ctx.Err() != nil {
		t.Fatalf("node --test did not finish within 3 minutes:\n%s\n--- broker logs ---\n%s", out, b.Logs())
	}
	if err != nil {
		t.Fatalf("node --test failed (%v) after %s:\n%s\n--- broker logs ---\n%s", err, elapsed, out, b.Logs())
	}
	t.Logf("node --test passed in %s:\n%s", elapsed, summary(string(out)))
}

// ensureNodeModules runs npm ci when a package of tests/ts/package.json
// (the SDK, the Inspector CLI, Claude Code) is not installed yet.
func ensureNodeModules(t *testing.T, npm, dir string) {
	t.Helper()
	missing := false
	for _, p := range []string{"@modelcontextprotocol/sdk/package.json", ".bin/mcp-inspector", ".bin/claude"} {
		_, err := os.Stat(filepath.Join(dir, "node_modules", p))
		if errors.Is(err, os.ErrNotExist) {
			missing = true
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if !missing {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund")
	cmd.Dir = dir
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("npm ci in %s failed (%v; context: %v):\n%s", dir, err, ctx.Err(), out)
	}
	t.Logf("npm ci installed the TypeScript SDK test dependencies")
}

func randomToken(t *testing.T) string {
	t.Helper()
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return "ts-" + hex.EncodeToString(b[:])
}

// summary keeps the spec reporter's per-test lines and totals.
func summary(out string) string {
	var keep []string
	for _, line := range strings.Split(out, "\n") {
		s := strings.TrimSpace(line)
		if strings.HasPrefix(s, "✔") || strings.HasPrefix(s, "✖") || strings.HasPrefix(s, "ℹ") {
			keep = append(keep, line)
		}
	}
	if len(keep) == 0 {
		return out
	}
	return strings.Join(keep, "\n")
}
