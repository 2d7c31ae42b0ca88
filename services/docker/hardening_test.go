package docker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/mount"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// TestContainerConfig checks the created container against §1.2 field by field.
func TestContainerConfig(t *testing.T) { forRuntimes(t, testContainerConfig) }

func testContainerConfig(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "python")
	t.Logf("agent: %s (%s)", agentKind, agentBinary)
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	res := exec1(t, s, "python", "print('hi')", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "hi" || res.ExitCode != 0 {
		t.Fatalf("unexpected result: %+v stderr=%s", res, res.Stderr)
	}
	c := sessionContainer(t, s)
	ins, err := e.cli.ContainerInspect(context.Background(), c.dockerID)
	if err != nil {
		t.Fatal(err)
	}
	hc, cfg := ins.HostConfig, ins.Config
	check := func(name string, got, want any) {
		t.Helper()
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s = %#v, want %#v", name, got, want)
		}
	}
	check("NetworkMode", string(hc.NetworkMode), "none")
	check("NetworkDisabled", cfg.NetworkDisabled, true)
	check("ReadonlyRootfs", hc.ReadonlyRootfs, true)
	check("Privileged", hc.Privileged, false)
	check("CapDrop", []string(hc.CapDrop), []string{"ALL"})
	check("CapAdd", len(hc.CapAdd), 0)
	check("Runtime", hc.Runtime, rt)
	check("SecurityOpt", hc.SecurityOpt, []string{"no-new-privileges:true", "seccomp=" + SeccompProfileJSON(rt)})
	check("IpcMode", string(hc.IpcMode), "private")
	check("PidMode", string(hc.PidMode), "")
	check("UTSMode", string(hc.UTSMode), "")
	check("CgroupnsMode", string(hc.CgroupnsMode), "private")
	check("Init", hc.Init != nil && *hc.Init, true)
	check("ShmSize", hc.ShmSize, int64(16<<20))
	check("Tmpfs", hc.Tmpfs, map[string]string{"/tmp": "rw,noexec,nosuid,nodev,size=64m,mode=1777"})
	check("MaskedPaths", hc.MaskedPaths == nil || len(hc.MaskedPaths) >= 10, true) // Docker's defaults, not ours
	check("LogConfig", hc.LogConfig, container.LogConfig{Type: "json-file", Config: map[string]string{"max-size": "1m", "max-file": "1"}})
	check("Memory", hc.Memory, int64(512<<20))
	check("MemorySwap", hc.MemorySwap, int64(512<<20))
	check("NanoCPUs", hc.NanoCPUs, int64(1_000_000_000))
	wantUlimits := map[string][2]int64{"nofile": {1024, 1024}, "fsize": {256 << 20, 256 << 20}, "core": {0, 0}}
	if rt == RuntimeRunsc {
		// The Sentry counts RLIMIT_NPROC per sandbox; the pids cgroup,
		// which counts its host threads, is only a backstop above it.
		check("PidsLimit", hc.PidsLimit != nil && *hc.PidsLimit == 2*256+gvisorHostTasks, true)
		wantUlimits["nproc"] = [2]int64{256, 256}
	} else {
		check("PidsLimit", hc.PidsLimit != nil && *hc.PidsLimit == 256, true)
	}
	check("Devices", len(hc.Devices), 0)
	check("Binds", len(hc.Binds), 0)
	ul := map[string][2]int64{}
	for _, u := range hc.Ulimits {
		ul[u.Name] = [2]int64{u.Soft, u.Hard}
	}
	check("Ulimits", ul, wantUlimits)
	check("User", cfg.User, fmt.Sprintf("%d:%d", c.uid, c.uid))
	check("uid in the sandbox range", c.uid >= testUIDBase && c.uid < testUIDBase+testUIDs, true)
	check("Hostname", cfg.Hostname, "sandbox")
	check("StopSignal", cfg.StopSignal, "SIGKILL")
	check("Cmd", []string(cfg.Cmd), []string{"/opt/sandbox/broker", "agent", "--socket", "/run/sandbox/agent.sock", "--language", "python", "--warm-on-request", "--idle-release", "0s"})
	for _, env := range cfg.Env {
		k, _, _ := strings.Cut(env, "=")
		// PATH, HOME, LANG are ours; the rest comes from the image's ENV.
		if strings.Contains(strings.ToUpper(k), "TOKEN") || strings.Contains(strings.ToUpper(k), "SECRET") || strings.Contains(strings.ToUpper(k), "KEY") {
			t.Errorf("secret-looking env %s", k)
		}
	}
	check("HOME", slices.Contains(cfg.Env, "HOME=/tmp"), true)
	check("LANG", slices.Contains(cfg.Env, "LANG=C.UTF-8"), true)
	check("label broker", cfg.Labels[LabelBroker], "1")
	check("label instance", cfg.Labels[LabelInstance], e.o.InstanceID)
	check("label language", cfg.Labels[LabelLanguage], "python")
	check("label workspace", cfg.Labels[LabelWorkspace], s.(*Session).ref.WorkspaceID)
	byTarget := map[string]mount.Mount{}
	for _, m := range hc.Mounts {
		byTarget[m.Target] = m
	}
	ref := s.(*Session).ref
	for target, src := range map[string]string{"/mnt/data": ref.Dir, "/run/sandbox": c.runDir, "/opt/sandbox/broker": e.o.AgentBinary} {
		m, ok := byTarget[target]
		if !ok {
			t.Errorf("no mount at %s", target)
			continue
		}
		check("mount type "+target, m.Type, mount.TypeBind)
		check("mount source "+target, m.Source, src)
		check("mount ro "+target, m.ReadOnly, target == "/opt/sandbox/broker")
		check("mount propagation "+target, m.BindOptions != nil && m.BindOptions.Propagation == mount.PropagationRPrivate, true)
	}
	for _, m := range ins.Mounts {
		if strings.Contains(m.Source, "docker.sock") || strings.HasPrefix(m.Destination, "/var/run") {
			t.Errorf("forbidden mount %+v", m)
		}
	}
}

// probeScript runs inside the sandbox and prints one JSON object.
const probeScript = `
import ctypes, ctypes.util, errno, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def sc(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    return r, errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
out = {}
out["uid"] = os.getuid()
st = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
for k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp"):
    out[k] = st.get(k, "").strip()
try:
    open("/etc/x", "w"); out["etc_write"] = "OK"
except OSError as e:
    out["etc_write"] = errno.errorcode[e.errno]
try:
    open("/usr/bin/python3", "ab"); out["bin_write"] = "OK"
except OSError as e:
    out["bin_write"] = errno.errorcode[e.errno]
out["ifaces"] = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])
out["docker_sock"] = os.path.exists("/var/run/docker.sock") or os.path.exists("/run/docker.sock")
out["io_uring_setup"] = sc(425, 1, 0)[1]
out["io_uring_enter"] = sc(426, 0, 0, 0, 0, 0, 0)[1]
out["io_uring_register"] = sc(427, 0, 0, 0, 0)[1]
out["clone3"] = sc(435, 0, 0)[1]
out["root_ro"] = bool(os.statvfs("/").f_flag & os.ST_RDONLY)
out["release"] = os.uname().release
r = libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)
out["mount"] = errno.errorcode.get(ctypes.get_errno(), "?") if r != 0 else "OK"
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET = 0x10000000, 0x00020000, 0x40000000
out["unshare_user"] = sc(272, CLONE_NEWUSER)[1]
out["unshare_ns"] = sc(272, CLONE_NEWNS)[1]
out["unshare_net"] = sc(272, CLONE_NEWNET)[1]
out["clone_newuser"] = sc(56, CLONE_NEWUSER | 17, 0, 0, 0, 0)[1]
out["chroot"] = sc(161, b"/tmp")[1]
try:
    os.mknod("/tmp/null", 0o666 | 0o020000, os.makedev(1, 3)); out["mknod"] = "OK"
except OSError as e:
    out["mknod"] = errno.errorcode[e.errno]
import socket
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); out["raw_socket"] = "OK"
except OSError as e:
    out["raw_socket"] = errno.errorcode[e.errno]
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2); out["connect"] = "OK"
except OSError as e:
    out["connect"] = errno.errorcode.get(e.errno, str(e))
out["bpf"] = sc(321, 0, 0, 0)[1]
out["keyctl"] = sc(250, 0, 0, 0, 0, 0)[1]
out["setuid_files"] = subprocess.run(["find", "/", "-xdev", "-perm", "/6000"], capture_output=True, text=True).stdout.split()
out["hostname"] = open("/etc/hostname").read().strip() if os.path.exists("/etc/hostname") else os.uname().nodename
out["nodename"] = os.uname().nodename
out["cwd"] = os.getcwd()
out["data_same"] = os.path.samefile("/data", "/mnt/data")
open("/mnt/data/probe.txt", "w").write("from sandbox")
out["env"] = sorted(os.environ)
out["tmp_exec"] = "noexec" in [l for l in open("/proc/mounts").read().splitlines() if " /tmp " in l][0]
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps(out))
`

// TestHardeningProbes runs the §7.2 A/B probes through the engine.
func TestHardeningProbes(t *testing.T) { forRuntimes(t, testHardeningProbes) }

func testHardeningProbes(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "python")
	ref := newRef(e)
	s, err := e.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	res := exec1(t, s, "python", probeScript, 60*time.Second)
	if res.ExitCode != 0 {
		t.Fatalf("probe failed: exit %d stderr=%s", res.ExitCode, res.Stderr)
	}
	var p map[string]any
	if err := json.Unmarshal(res.Stdout, &p); err != nil {
		t.Fatalf("probe output: %v: %s", err, res.Stdout)
	}
	t.Logf("probe: %s", res.Stdout)
	want := map[string]any{
		"CapEff": "0000000000000000", "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
		"NoNewPrivs": "1", "Seccomp": "2",
		"etc_write": "EROFS", "root_ro": true, "docker_sock": false,
		// runsc runs with --oci-seccomp, so our profile's EPERM holds there too.
		"io_uring_setup": "EPERM", "io_uring_enter": "EPERM", "io_uring_register": "EPERM",
		"clone3": "ENOSYS", // libc falls back to clone, which is filtered
		"mount":  "EPERM", "unshare_user": "EPERM", "unshare_ns": "EPERM", "unshare_net": "EPERM",
		"clone_newuser": "EPERM", "chroot": "EPERM", "mknod": "EPERM", "raw_socket": "EPERM",
		"connect": "ENETUNREACH", "bpf": "EPERM", "keyctl": "EPERM",
		"nodename": "sandbox", "cwd": "/mnt/data", "data_same": true, "tmp_exec": true,
	}
	if rt == RuntimeRunsc {
		// gVisor checks permissions before the read-only mount (still
		// read-only: root_ro); clone3 is allowed (runsc would turn ENOSYS
		// into EPERM, and threads could not start), so the Sentry itself
		// refuses clone3(NULL, 0).
		want["etc_write"], want["clone3"] = "EACCES", "EINVAL"
	}
	if gvisor := strings.Contains(p["release"].(string), "gvisor"); gvisor != (rt == RuntimeRunsc) {
		t.Errorf("kernel release %q under %s", p["release"], rt)
	}
	for k, v := range want {
		if !reflect.DeepEqual(p[k], v) {
			t.Errorf("%s = %v, want %v", k, p[k], v)
		}
	}
	if uid, _ := p["uid"].(float64); uid == 0 {
		t.Errorf("runs as root")
	}
	if bw := p["bin_write"]; bw != "EROFS" && bw != "EACCES" {
		t.Errorf("bin_write = %v", bw)
	}
	if !reflect.DeepEqual(p["ifaces"], []any{"lo"}) {
		t.Errorf("network interfaces = %v, want only lo", p["ifaces"])
	}
	if l, _ := p["setuid_files"].([]any); len(l) != 0 {
		t.Errorf("setuid/setgid files present: %v", l)
	}
	if pids, _ := p["pids"].([]any); len(pids) > 10 {
		t.Errorf("too many visible pids (host PID namespace?): %v", pids)
	}
	for _, k := range p["env"].([]any) {
		if s := k.(string); strings.Contains(s, "TOKEN") || strings.Contains(s, "SECRET") || strings.Contains(s, "DOCKER") {
			t.Errorf("unexpected env %s", s)
		}
	}
	// The sandbox wrote through the bind mount.
	b, err := os.ReadFile(filepath.Join(ref.Dir, "probe.txt"))
	if err != nil || string(b) != "from sandbox" {
		t.Errorf("workspace file: %q %v", b, err)
	}
}

func TestForkBombContained(t *testing.T) { forRuntimes(t, testForkBombContained) }

func testForkBombContained(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) {
		o.Runtime, o.PidsLimit = rt, 64
		if rt == RuntimeRunsc {
			// Under gVisor each fork of the zygote's child costs several
			// MiB outside it (a systrap stub's page tables): with 512 MiB
			// this bomb ends at the memory limit, as an OOM kill of the
			// whole sandbox (TestMemoryBombOOMKilled). Here the process
			// limit is what is tested.
			o.Memory = 2 << 30
		}
	})
	needRunner(t, e, "python")
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	res := exec1(t, s, "python", `
import os, time, errno
n, err, kids = 0, None, []
try:
    while True:
        pid = os.fork()
        if pid == 0:
            time.sleep(1); os._exit(0)
        kids.append(pid); n += 1
except OSError as e:
    err = errno.errorcode[e.errno]
for k in kids: os.waitpid(k, 0)
print(n, err)
`, 30*time.Second)
	out := strings.Fields(string(res.Stdout))
	if len(out) != 2 || out[1] != "EAGAIN" {
		t.Fatalf("fork bomb: %+v stdout=%q stderr=%q", res, res.Stdout, res.Stderr)
	}
	t.Logf("forks before EAGAIN: %s (pids limit 64)", out[0])
	before := sessionContainer(t, s).dockerID
	res = exec1(t, s, "python", "print(6*7)", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "42" {
		t.Fatalf("container unusable after fork bomb: %+v %s", res, res.Stderr)
	}
	if after := sessionContainer(t, s).dockerID; after != before {
		t.Errorf("container was replaced after the fork bomb (%s → %s)", shortID(before), shortID(after))
	}
}

func TestMemoryBombOOMKilled(t *testing.T) { forRuntimes(t, testMemoryBombOOMKilled) }

func testMemoryBombOOMKilled(t *testing.T, rt string) {
	// 256 MiB: an idle gVisor sandbox with the Python zygote peaks near
	// 180 MiB (the Sentry and gofer count too).
	e := newEngine(t, func(o *Options) { o.Runtime, o.Memory = rt, 256<<20 })
	needRunner(t, e, "python")
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	res := exec1(t, s, "python", "x = []\nwhile True: x.append(bytearray(16 << 20))", 60*time.Second)
	if !res.OOMKilled || res.Signal != "SIGKILL" {
		t.Fatalf("memory bomb: OOMKilled=%v signal=%q exit=%d stderr=%q", res.OOMKilled, res.Signal, res.ExitCode, res.Stderr)
	}
	// The next run works (in a fresh container) and is not marked OOM.
	res = exec1(t, s, "python", "print('ok')", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "ok" || res.OOMKilled {
		t.Fatalf("after OOM: %+v", res)
	}
}

func TestWallClockTimeout(t *testing.T) { forRuntimes(t, testWallClockTimeout) }

func testWallClockTimeout(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "python")
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	// Warm first, so the bound below is about the kill, not a cold start.
	exec1(t, s, "python", "pass", 60*time.Second)
	start := time.Now()
	res := exec1(t, s, "python", "while True: pass", 2*time.Second)
	if !res.TimedOut {
		t.Fatalf("busy loop not timed out: %+v", res)
	}
	// Far below the 60 s this would take if only the agent's own deadline
	// or the test's fired; loose enough for a loaded 2-core CI machine.
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("timeout took %s", d)
	}
	res = exec1(t, s, "python", "print('alive')", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "alive" {
		t.Fatalf("after timeout: %+v", res)
	}
}

// TestHardStop: when the agent does not answer by timeout+5s, the engine
// kills the container and reports SANDBOX_TIMEOUT.
func TestHardStop(t *testing.T) { forRuntimes(t, testHardStop) }

func testHardStop(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "python")
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	exec1(t, s, "python", "pass", 20*time.Second)
	c := sessionContainer(t, s)
	orig := agentRun
	agentRun = func(ctx context.Context, sock string, req agent.Request) (agent.Response, error) {
		<-ctx.Done() // a hung agent
		return agent.Response{}, ctx.Err()
	}
	defer func() { agentRun = orig }()
	start := time.Now()
	res, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "python", Code: "pass", Timeout: time.Second})
	d := time.Since(start)
	if brokererr.CodeOf(err) != brokererr.SandboxTimeout || !res.TimedOut {
		t.Fatalf("err = %v, res = %+v", err, res)
	}
	if d < time.Second+hardStopMargin || d > time.Second+hardStopMargin+3*time.Second {
		t.Errorf("hard stop after %s", d)
	}
	waitFor(t, 30*time.Second, "hung container removed", func() bool {
		_, err := e.cli.ContainerInspect(context.Background(), c.dockerID)
		return isNotFound(err)
	})
}

func TestUnknownLanguage(t *testing.T) {
	e := newEngine(t, nil)
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Exec(context.Background(), sandbox.ExecRequest{Language: "cobol", Code: "x"})
	var be *brokererr.Error
	if !errors.As(err, &be) || be.Code != brokererr.UnknownLanguage || !strings.Contains(be.Message, "available:") {
		t.Fatalf("err = %v", err)
	}
	rs, err := e.Runners(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if !strings.Contains(be.Message, r.Language) {
			t.Errorf("message %q does not list %s", be.Message, r.Language)
		}
	}
}
