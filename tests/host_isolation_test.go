package tests

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// sandboxBackends are the backends the tests run on: the process
// backend twice, on the host's /usr and on the runner file systems.
var sandboxBackends = []string{"docker", "process", "process_rootfs"}

// startBackend starts a broker on one of sandboxBackends (or on
// docker-runsc, the Docker backend under gVisor) with o
// (SANDBOX_BACKEND, no warm pool and the test token added), skipping
// (failing in CI) when the backend is not available.
func startBackend(t *testing.T, name string, o BrokerOpts) *Broker {
	t.Helper()
	backend := name
	switch name {
	case "docker":
		requireDocker(t)
	case "docker-runsc":
		requireRunsc(t)
		backend = "docker"
	case "process":
		requireBwrap(t)
	case "process_rootfs":
		requireBwrap(t)
		backend = "process"
		if o.Root == "" {
			o.Root = rootfsRoot(t)
		}
	}
	env := map[string]string{"SANDBOX_BACKEND": backend, "SANDBOX_POOL_SIZE": "0"}
	if name == "docker-runsc" {
		env["SANDBOX_RUNTIME"] = "runsc"
	}
	for k, v := range o.Env {
		env[k] = v
	}
	o.Env, o.Token = env, testToken
	b := StartHTTP(t, o)
	if name == "process_rootfs" {
		requireRootfsRunners(t, b)
	}
	return b
}

// eachBackend runs fn once per sandbox backend; start starts that
// backend's broker with o.
func eachBackend(t *testing.T, fn func(t *testing.T, start func(o BrokerOpts) *Broker)) {
	for _, name := range sandboxBackends {
		t.Run(name, func(t *testing.T) {
			fn(t, func(o BrokerOpts) *Broker { return startBackend(t, name, o) })
		})
	}
}

// TestInheritedDescriptorsNeverReachSandboxes is issue 15's first defect:
// a broker started with a host directory on fd 7 and a file on fd 8 (as
// `exec 7</hostdir 8</hostdir/secret; sandbox-broker serve` leaves them)
// must not hand either to sandbox code, on any path: its own fds, the
// descriptors of every process it can see, or a write through one.
func TestInheritedDescriptorsNeverReachSandboxes(t *testing.T) {
	eachBackend(t, func(t *testing.T, start func(BrokerOpts) *Broker) {
		hostDir := t.TempDir()
		if err := os.Chmod(hostDir, 0o777); err != nil { // only the descriptor may stop the sandbox
			t.Fatal(err)
		}
		var raw [12]byte
		_, _ = rand.Read(raw[:])
		name := "secret-" + hex.EncodeToString(raw[:4])
		secret := "inherited-canary-" + hex.EncodeToString(raw[4:])
		if err := os.WriteFile(filepath.Join(hostDir, name), []byte(secret), 0o644); err != nil {
			t.Fatal(err)
		}
		dir, err := os.Open(hostDir)
		if err != nil {
			t.Fatal(err)
		}
		defer dir.Close()
		file, err := os.Open(filepath.Join(hostDir, name))
		if err != nil {
			t.Fatal(err)
		}
		defer file.Close()
		b := start(BrokerOpts{ExtraFiles: []*os.File{nil, nil, nil, nil, dir, file}}) // fds 7 and 8
		c := b.Client(t, testToken)

		code := `cat /proc/self/fd/7/` + name + ` | base64 -w0; echo
cat <&8 | base64 -w0; echo
touch /proc/self/fd/7/ESCAPED
ls /proc/$$/fd >/tmp/own-fds
echo "own: $(sort -n /tmp/own-fds | tr '\n' ' ')"
for f in /proc/[0-9]*/fd/*; do
  if [ -d "$f" ]; then
    ls "$f" 2>/dev/null | grep -q '^` + name + `$' && echo "host dir via $f"
  elif [ -f "$f" ]; then
    echo "file $f $(sha256sum < "$f" 2>/dev/null | cut -c1-64)"
  fi
done
true`
		r, _ := run(t, c, map[string]any{"language": "bash", "code": code})
		out := r.Stdout + r.Stderr
		t.Logf("sandbox said:\n%s", out)
		sum := sha256.Sum256([]byte(secret))
		for _, leak := range []string{secret, base64.StdEncoding.EncodeToString([]byte(secret)), hex.EncodeToString(sum[:]), "host dir via"} {
			if strings.Contains(out, leak) {
				t.Errorf("the sandbox reached the inherited descriptors: output holds %q", leak)
			}
		}
		if _, err := os.Lstat(filepath.Join(hostDir, "ESCAPED")); err == nil {
			t.Error("the sandbox created a file in the host directory through fd 7")
		}
		own := ""
		for _, l := range strings.Split(r.Stdout, "\n") {
			if v, ok := strings.CutPrefix(l, "own: "); ok {
				own = strings.TrimSpace(v)
			}
		}
		if own != "0 1 2 255" { // 255: bash's handle on the script it runs
			t.Errorf("the run's shell holds descriptors %q, want only 0 1 2 255", own)
		}
	})
}

// TestHostLayoutInvisibleInSandbox is issue 15's second defect: a
// sandbox must not learn where SANDBOX_ROOT lies on the host. Output
// redaction hides the path in plain text only, so the probe encodes the
// mount tables (every visible process's mountinfo and mounts, and
// mountstats) as base64 and the test looks for the host path in the
// decoded text.
func TestHostLayoutInvisibleInSandbox(t *testing.T) {
	eachBackend(t, func(t *testing.T, start func(BrokerOpts) *Broker) {
		b := start(BrokerOpts{})
		c := b.Client(t, testToken)
		r, _ := run(t, c, map[string]any{"language": "bash", "code": `cat /proc/self/mountinfo /proc/self/mountstats /proc/[0-9]*/mountinfo /proc/[0-9]*/mounts 2>/dev/null | sort -u | base64 -w0`})
		raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(r.Stdout))
		if err != nil {
			t.Fatalf("probe output %q (stderr %q): %v", r.Stdout, r.Stderr, err)
		}
		tables := string(raw)
		if !strings.Contains(tables, " /mnt/data ") {
			t.Fatalf("the probe did not read the mount table:\n%s", tables)
		}
		// The kernel prints a bind mount's source relative to its
		// filesystem, so look for the root's own unique directory name too.
		unique := filepath.Base(filepath.Dir(b.Root))
		leaks := []string{b.Root, unique}
		// Nor where the prebuilt runner file systems lie.
		for _, d := range []string{os.Getenv("SANDBOX_TEST_RUNNERS_DIR"), filepath.Join("..", "data", "runners")} {
			if abs, err := filepath.Abs(d); err == nil && d != "" {
				leaks = append(leaks, abs)
			}
		}
		for _, leak := range leaks {
			if strings.Contains(tables, leak) {
				t.Errorf("the sandbox can read the host path %q:\n%s", leak, grepLines(tables, leak))
			}
		}
	})
}
