package tests

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// privateDockerd is a Docker daemon of the test's own: its data, state,
// pid file and socket live under a temp dir, it has no bridge and leaves
// iptables alone, so a test can stop, crash and restart it without
// touching the machine's shared daemon.
//
// containerd runs beside it, as distributions run it (a service of its
// own): a crashed dockerd then leaves the containers running, and the
// restarted one finds them through containerd, as in production.
type privateDockerd struct {
	dir        string
	Host       string // DOCKER_HOST for clients of this daemon
	containerd *daemonProc
	dockerd    *daemonProc
}

// daemonProc is a daemon the test started and waits for.
type daemonProc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func startDaemon(t *testing.T, logPath string, name string, args ...string) *daemonProc {
	t.Helper()
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	p := &daemonProc{cmd: exec.Command(name, args...), done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	// A network namespace of its own: dockerd started with --bridge=none
	// deletes the host's docker0 (moby's removeDefaultBridgeInterface),
	// which the shared daemon needs. The sockets are files, so the broker
	// reaches it all the same.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	return p
}

// stop signals the daemon and waits for it to exit (idempotent).
func (p *daemonProc) stop(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if p == nil {
		return
	}
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(60 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		t.Errorf("%s did not stop on %v", p.cmd.Path, sig)
	}
}

// containerdConfig keeps the private containerd's sockets and state under
// dir; CRI is off.
const containerdConfig = `version = 2
root = "%[1]s/containerd/root"
state = "%[1]s/containerd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "%[1]s/containerd.sock"
[debug]
  address = ""
[metrics]
  address = ""
`

// startPrivateDockerd starts a daemon and loads the given images into it
// from the shared daemon. It needs root and dockerd: their absence fails
// the test in CI and skips it elsewhere.
func startPrivateDockerd(t *testing.T, images ...string) *privateDockerd {
	t.Helper()
	requireDocker(t)
	miss := func(what string) {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s (required in CI: the fault tests run a private dockerd)", what)
		}
		t.Skip(what)
	}
	if os.Geteuid() != 0 {
		miss("a private dockerd needs root")
	}
	if _, err := exec.LookPath("dockerd"); err != nil {
		miss("dockerd is not installed")
	}
	// Short: the socket path must fit sun_path.
	dir, err := os.MkdirTemp("", "dockerd-")
	if err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"daemon.json": "{}\n", "containerd.toml": fmt.Sprintf(containerdConfig, dir)} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	d := &privateDockerd{dir: dir, Host: "unix://" + filepath.Join(dir, "docker.sock")}
	t.Cleanup(func() {
		d.Stop(t, syscall.SIGTERM)
		d.containerd.stop(t, syscall.SIGTERM)
		killShims(dir)
		unmountUnder(dir)
		_ = os.RemoveAll(dir)
	})
	d.containerd = startDaemon(t, filepath.Join(dir, "containerd.log"), "containerd", "--config", filepath.Join(dir, "containerd.toml"))
	d.Start(t)
	for _, img := range images {
		save := exec.Command("docker", "save", img)
		load := exec.Command("docker", "-H", d.Host, "load", "-q")
		pipe, err := save.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		load.Stdin = pipe
		if err := save.Start(); err != nil {
			t.Fatal(err)
		}
		out, err := load.CombinedOutput()
		if werr := save.Wait(); err != nil || werr != nil {
			t.Fatalf("load %s into the private daemon: %v %v %s", img, err, werr, out)
		}
	}
	return d
}

// Start runs dockerd and waits until it answers.
func (d *privateDockerd) Start(t *testing.T) {
	t.Helper()
	d.dockerd = startDaemon(t, filepath.Join(d.dir, "dockerd.log"), "dockerd",
		"--config-file", filepath.Join(d.dir, "daemon.json"),
		"--containerd", filepath.Join(d.dir, "containerd.sock"),
		"--data-root", filepath.Join(d.dir, "data"),
		"--exec-root", filepath.Join(d.dir, "exec"),
		"--pidfile", filepath.Join(d.dir, "docker.pid"),
		"-H", d.Host,
		"--bridge=none", "--iptables=false", "--ip-masq=false", "--userland-proxy=false",
		"--storage-driver=overlay2")
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if exec.Command("docker", "-H", d.Host, "version").Run() == nil {
			return
		}
		select {
		case <-d.dockerd.done:
			t.Fatalf("private dockerd exited:\n%s", d.logTail())
		case <-time.After(100 * time.Millisecond):
		}
	}
	t.Fatalf("private dockerd did not answer within 60s:\n%s", d.logTail())
}

// Stop signals dockerd (SIGTERM: a clean stop that kills its containers;
// SIGKILL: a crash that leaves them to the next start) and waits for it to
// exit.
func (d *privateDockerd) Stop(t *testing.T, sig syscall.Signal) {
	t.Helper()
	d.dockerd.stop(t, sig)
}

// Docker runs the docker CLI against this daemon.
func (d *privateDockerd) Docker(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("docker", append([]string{"-H", d.Host}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("docker %v: %v: %s", args, err, out)
	}
	return strings.TrimSpace(string(out))
}

func (d *privateDockerd) logTail() string {
	b, _ := os.ReadFile(filepath.Join(d.dir, "dockerd.log"))
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if !strings.Contains(l, "module=grpc") {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines[max(0, len(lines)-30):], "\n")
}

// killShims kills what a crashed daemon of dir left running: container
// shims (their command line names dir) and the containers under them.
func killShims(dir string) {
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(b), "containerd-shim") || !strings.Contains(string(b), dir+"/") {
			continue
		}
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		if err != nil {
			continue
		}
		if kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid)); err == nil {
			for _, f := range strings.Fields(string(kids)) {
				if kid, err := strconv.Atoi(f); err == nil {
					_ = syscall.Kill(kid, syscall.SIGKILL)
				}
			}
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// unmountUnder lazily unmounts whatever a stopped daemon left mounted
// below dir, deepest first, so the dir can be removed.
func unmountUnder(dir string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	defer f.Close()
	var mounts []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], dir+"/") {
			mounts = append(mounts, fields[4])
		}
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		_ = syscall.Unmount(mounts[i], syscall.MNT_DETACH)
	}
}
