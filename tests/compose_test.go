package tests

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/client/transport"
)

// requireCompose fails in CI and skips elsewhere without Debian's
// docker-compose (v1), which .ci/run installs.
func requireCompose(t *testing.T) {
	t.Helper()
	if err := exec.Command("docker-compose", "version").Run(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("docker-compose is required in CI (.ci/run installs Debian's docker-compose): %v", err)
		}
		t.Skipf("docker-compose unavailable: %v", err)
	}
}

// composeDir is a directory holding the repository's docker-compose.yml
// and a .env written by `sandbox-broker init`; it returns the .env's
// settings.
func composeDir(t *testing.T) (string, map[string]string) {
	t.Helper()
	dir := t.TempDir()
	yml, err := os.ReadFile("../docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "docker-compose.yml"), yml, 0o644); err != nil {
		t.Fatal(err)
	}
	// The monitoring profile builds from deploy/, which compose checks
	// exists even when the profile is off.
	if err := os.CopyFS(filepath.Join(dir, "deploy"), os.DirFS("../deploy")); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(brokerBin, "init")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("init: %v\n%s", err, out)
	}
	env := readEnvFile(t, filepath.Join(dir, ".env"))
	if strings.Contains(string(out), env["MCP_API_TOKEN"]) || !strings.Contains(string(out), "grep '^MCP_API_TOKEN='") {
		t.Fatalf("init output shows the token or not how to read it:\n%s", out)
	}
	return dir, env
}

func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf(".env mode %o, want 0600", fi.Mode().Perm())
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			env[k] = v
		}
	}
	for _, k := range []string{"MCP_API_TOKEN", "FILE_SECRET", "AUDIT_HMAC_KEY"} {
		if len(env[k]) < 32 {
			t.Fatalf(".env %s = %q", k, env[k])
		}
	}
	return env
}

// compose runs Debian's docker-compose (v1) in dir with no broker secret
// in its environment: whatever it knows comes from .env.
func compose(dir string, args ...string) (string, error) {
	cmd := exec.Command("docker-compose", args...)
	cmd.Dir = dir
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestComposeReadsInitEnv: `docker-compose config` takes the secrets from
// the .env that init wrote, and without one says to run init.
func TestComposeReadsInitEnv(t *testing.T) {
	requireCompose(t)
	dir, env := composeDir(t)
	out, err := compose(dir, "config")
	if err != nil {
		t.Fatalf("docker-compose config: %v\n%s", err, out)
	}
	for _, k := range []string{"MCP_API_TOKEN", "FILE_SECRET", "AUDIT_HMAC_KEY"} {
		if !strings.Contains(out, k+": "+env[k]) {
			t.Errorf("config lacks %s from .env:\n%s", k, out)
		}
	}
	if err := os.Remove(filepath.Join(dir, ".env")); err != nil {
		t.Fatal(err)
	}
	if out, err := compose(dir, "config"); err == nil || !strings.Contains(out, "sandbox-broker init") {
		t.Fatalf("config without .env: %v\n%s", err, out)
	}
}

// TestComposeUpLogsDown starts the broker image with docker-compose (v1)
// and the generated .env: the token in .env is the one the broker accepts,
// and logs and down work later without it in the shell.
func TestComposeUpLogsDown(t *testing.T) {
	requireCompose(t)
	requireDocker(t)
	if err := exec.Command("docker", "image", "inspect", "sandbox-broker:latest").Run(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("sandbox-broker:latest is missing (.ci/run builds it with make image): %v", err)
		}
		t.Skip("sandbox-broker:latest is missing; run make image")
	}
	dir, env := composeDir(t)
	root := brokerRoot(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	f, err := os.OpenFile(filepath.Join(dir, ".env"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(f, "SANDBOX_ROOT=%s\nBROKER_PORT=%d\n", root, port)
	f.Close()
	project := fmt.Sprintf("sbtest%d", port)
	p := func(args ...string) []string { return append([]string{"-p", project}, args...) }
	t.Cleanup(func() {
		if out, err := compose(dir, p("down", "--timeout", "30")...); err != nil {
			t.Logf("down: %v\n%s", err, out)
		}
	})
	if out, err := compose(dir, p("up", "-d")...); err != nil {
		t.Fatalf("up: %v\n%s", err, out)
	}
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			out, _ := compose(dir, p("logs")...)
			t.Fatalf("the broker did not answer /healthz: %v\n%s", err, out)
		}
		time.Sleep(200 * time.Millisecond) // polling a process we do not control
	}
	c, err := client.NewStreamableHttpClient(base+"/mcp", transport.WithHTTPHeaders(map[string]string{"Authorization": "Bearer " + env["MCP_API_TOKEN"]}))
	if err != nil {
		t.Fatal(err)
	}
	initClient(t, c)
	var u usage
	resultJSON(t, callTool(t, c, "get_usage", nil), &u)
	if u.Principal != "default" {
		t.Fatalf("usage %+v", u)
	}
	c.Close()
	out, err := compose(dir, p("logs", "--no-color")...)
	if err != nil || !strings.Contains(out, "broker_ready") || strings.Contains(out, env["MCP_API_TOKEN"]) {
		t.Fatalf("logs: %v\n%s", err, out)
	}
	if out, err := compose(dir, p("down", "--timeout", "30")...); err != nil {
		t.Fatalf("down: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	left, err := exec.CommandContext(ctx, "docker", "ps", "-aq", "--filter", "label=sandbox.root="+root).Output()
	if err != nil || strings.TrimSpace(string(left)) != "" {
		t.Fatalf("containers left behind after down: %q %v", left, err)
	}
}
