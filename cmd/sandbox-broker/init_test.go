package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/config"
)

func runInit(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(append([]string{"init"}, args...), strings.NewReader(""), &out, &errb, func(string) string { return "" })
	return code, out.String(), errb.String()
}

func envFile(t *testing.T, path string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(k, "#") {
			env[k] = v
		}
	}
	return env
}

// init writes fresh secrets the broker accepts into a 0600 .env, never
// prints the token unless asked, and keeps an existing .env unless --force.
func TestInitWritesEnv(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runInit(t, "--dir", dir)
	if code != 0 {
		t.Fatalf("init: %d %s", code, stderr)
	}
	path := filepath.Join(dir, ".env")
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf(".env: %v %v", fi, err)
	}
	env := envFile(t, path)
	if len(env) != 3 {
		t.Fatalf(".env holds %v", env)
	}
	for _, v := range env {
		if strings.Contains(stdout, v) || strings.Contains(stderr, v) {
			t.Fatalf("init printed a secret:\n%s%s", stdout, stderr)
		}
	}
	if !strings.Contains(stdout, "grep '^MCP_API_TOKEN=' ") || !strings.Contains(stdout, "docker-compose up -d") {
		t.Errorf("init does not say how to read the token and start:\n%s", stdout)
	}
	// The broker takes them as they are.
	if _, err := config.Load(nil, func(k string) string { return env[k] }); err != nil {
		t.Fatalf("the broker refuses the generated settings: %v", err)
	}
	if _, err := audit.LoadKeys(audit.KeyConfig{Root: t.TempDir(), HMACKey: env["AUDIT_HMAC_KEY"]}); err != nil {
		t.Fatalf("AUDIT_HMAC_KEY: %v", err)
	}

	// An existing .env is kept...
	if code, _, stderr := runInit(t, "--dir", dir); code == 0 || !strings.Contains(stderr, "--force") {
		t.Fatalf("second init: %d %s", code, stderr)
	}
	if got := envFile(t, path); got["MCP_API_TOKEN"] != env["MCP_API_TOKEN"] {
		t.Fatal("an existing .env was changed without --force")
	}
	// ...unless --force, which writes new secrets, still 0600.
	code, stdout, _ = runInit(t, "--dir", dir, "--force", "--show-token")
	got := envFile(t, path)
	if code != 0 || got["MCP_API_TOKEN"] == env["MCP_API_TOKEN"] || got["FILE_SECRET"] == env["FILE_SECRET"] {
		t.Fatalf("--force: %d %v", code, got)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Fatalf("--force left mode %o", fi.Mode().Perm())
	}
	if !strings.Contains(stdout, "MCP_API_TOKEN="+got["MCP_API_TOKEN"]) {
		t.Fatalf("--show-token did not print the token:\n%s", stdout)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".env.tmp-*")); len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
}

// Without --dir, init writes only beside a compose file.
func TestInitNeedsTheComposeDirectory(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	if code, _, stderr := runInit(t); code != 2 || !strings.Contains(stderr, "docker-compose.yml") {
		t.Fatalf("init without a compose file: %d %s", code, stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, ".env")); !os.IsNotExist(err) {
		t.Fatal(".env written without a compose file")
	}
	if err := os.WriteFile(filepath.Join(dir, "docker-compose.yml"), []byte("services: {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, _, stderr := runInit(t); code != 0 {
		t.Fatalf("init beside a compose file: %d %s", code, stderr)
	}
	envFile(t, filepath.Join(dir, ".env"))
}
