package tests

import (
	"encoding/json"
	"strings"
	"testing"
)

// catalogueProbe runs security-cases §7.2 A/B/D probes not covered by the
// engine's own hardening test, through the real MCP path, and prints JSON.
const catalogueProbe = `
import ctypes, errno, json, os, threading, glob
libc = ctypes.CDLL(None, use_errno=True)
def sc(nr, *a):
    ctypes.set_errno(0); r = libc.syscall(nr, *a)
    return "OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
out = {}
# 8: kernel surface
out["finit_module"] = sc(313, -1, 0, 0)
out["perf_event_open"] = sc(298, 0, 0, -1, -1, 0)
out["userfaultfd"] = sc(323, 0)
# 10: /proc
for p in ["/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern"]:
    try: open(p, "w").write("x"); out[p] = "written"
    except OSError as e: out[p] = errno.errorcode[e.errno]
for p in ["/proc/kcore", "/proc/keys", "/proc/timer_list"]:
    try: out[p] = "read %d" % len(open(p, "rb").read(4096))
    except OSError as e: out[p] = errno.errorcode[e.errno]
# 11: cgroupfs
try: open("/sys/fs/cgroup/pids/pids.max", "w").write("max"); out["cgroup_write"] = "written"
except OSError as e: out["cgroup_write"] = errno.errorcode[e.errno]
out["release_agent_writable"] = [p for p in glob.glob("/sys/fs/cgroup/*/release_agent") if os.access(p, os.W_OK)]
# 12: sockets other than the agent's
socks = []
for root, dirs, files in os.walk("/", topdown=True):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/mnt/data", "/data")]
    for f in files:
        p = os.path.join(root, f)
        try:
            if os.path.stat.S_ISSOCK(os.lstat(p).st_mode): socks.append(p)
        except OSError: pass
out["sockets"] = sorted(socks)
# 15: devices; a TUN interface needs CAP_NET_ADMIN
out["dev"] = sorted(os.listdir("/dev"))
try:
    import fcntl, struct
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try: fcntl.ioctl(fd, 0x400454ca, struct.pack("16sH", b"x", 2)); out["tun"] = "OK"
    except OSError as e: out["tun"] = errno.errorcode[e.errno]
except OSError as e: out["tun"] = errno.errorcode[e.errno]
# 17: thread bomb
threads, ev = [], threading.Event()
try:
    for _ in range(5000):
        t = threading.Thread(target=ev.wait); t.start(); threads.append(t)
except RuntimeError: pass
out["threads"] = len(threads); ev.set()
for t in threads: t.join()
# 19: tmpfs and shm are bounded
for d, name in [("/tmp", "tmp_fill"), ("/dev/shm", "shm_fill")]:
    n = 0
    try:
        with open(d + "/fill", "wb") as f:
            for _ in range(512): f.write(b"\0" * (1 << 20)); f.flush(); n += 1
        out[name] = "no limit at %d MiB" % n
    except OSError as e: out[name] = "%s at %d MiB" % (errno.errorcode[e.errno], n)
    try: os.remove(d + "/fill")
    except OSError: pass
# 22: fd exhaustion
fds = []
try:
    while True: fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e: out["fds"] = "%s at %d" % (errno.errorcode[e.errno], len(fds))
for fd in fds: os.close(fd)
print(json.dumps(out))
`

func TestSecurityCatalogueContainerCases(t *testing.T) {
	forRuntimes(t, testSecurityCatalogueContainerCases)
}

func testSecurityCatalogueContainerCases(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "python", "code": catalogueProbe, "timeout_s": 120})
	var p map[string]any
	if err := json.Unmarshal([]byte(strings.TrimSpace(r.Stdout)), &p); err != nil {
		t.Fatalf("probe output %q (stderr %q): %v", r.Stdout, r.Stderr, err)
	}
	t.Logf("probe: %s", r.Stdout)
	for _, k := range []string{"finit_module", "perf_event_open", "userfaultfd"} {
		if p[k] == "OK" {
			t.Errorf("case 8: %s succeeded", k)
		}
	}
	for _, k := range []string{"/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern", "cgroup_write"} {
		if p[k] == "written" {
			t.Errorf("cases 10/11: %s was writable", k)
		}
	}
	for _, k := range []string{"/proc/kcore", "/proc/keys", "/proc/timer_list"} {
		if v, _ := p[k].(string); strings.HasPrefix(v, "read ") && v != "read 0" {
			t.Errorf("case 10: %s readable: %s", k, v)
		}
	}
	if l, _ := p["release_agent_writable"].([]any); len(l) != 0 {
		t.Errorf("case 11: writable release_agent: %v", l)
	}
	if l, _ := p["sockets"].([]any); len(l) > 1 || (len(l) == 1 && l[0] != "/run/sandbox/agent.sock") {
		t.Errorf("case 12: sockets visible: %v", l)
	}
	allowed := map[string]bool{"null": true, "zero": true, "full": true, "random": true, "urandom": true, "tty": true,
		"pts": true, "ptmx": true, "shm": true, "mqueue": true, "fd": true, "stdin": true, "stdout": true, "stderr": true, "core": true, "console": true}
	wantTun := "ENOENT"
	if rt == "runsc" {
		// gVisor's Sentry always adds its own emulated devices: FUSE
		// (mounting it needs mount, which seccomp refuses), TUN (needs
		// CAP_NET_ADMIN) and the /dev/char links. None is a host device.
		allowed["fuse"], allowed["net"], allowed["char"] = true, true, true
		wantTun = "EPERM"
	}
	for _, d := range p["dev"].([]any) {
		if !allowed[d.(string)] {
			t.Errorf("case 15: unexpected /dev entry %v", d)
		}
	}
	if p["tun"] != wantTun {
		t.Errorf("case 15: TUNSETIFF on /dev/net/tun: %v, want %s", p["tun"], wantTun)
	}
	if n, _ := p["threads"].(float64); n >= 256 || n < 10 {
		t.Errorf("case 17: %v threads started with a pids limit of 256", n)
	}
	for _, k := range []string{"tmp_fill", "shm_fill"} {
		if v, _ := p[k].(string); !strings.HasPrefix(v, "ENOSPC") {
			t.Errorf("case 19: %s = %q", k, v)
		}
	}
	if v, _ := p["fds"].(string); !strings.HasPrefix(v, "EMFILE at 10") {
		t.Errorf("case 22: fds = %q", v)
	}
}

// TestTokensPrintedBySandboxCodeAreRedacted is case 36 for the engine: code
// that prints token-shaped strings never returns them.
func TestTokensPrintedBySandboxCodeAreRedacted(t *testing.T) {
	b := engineBroker(t, nil)
	c := b.Client(t, testToken)
	code := "pat = 'github_pat_' + '11ABCDEFG0' + 'x' * 60\nprint(pat)\nimport sys\nprint('ghp_' + 'a' * 36, file=sys.stderr)\nprint('AKIA' + 'ABCDEFGHIJKLMNOP')\nprint(" + "'" + testToken + "'" + ")"
	res := callTool(t, c, "run_code", map[string]any{"language": "python", "code": code})
	j, _ := json.Marshal(res)
	for _, leak := range []string{"github_pat_11ABC", "ghp_aaaa", "AKIAABCDEFGHIJKLMNOP", testToken} {
		if strings.Contains(string(j), leak) {
			t.Errorf("result contains %q", leak)
		}
	}
	if !strings.Contains(string(j), "[REDACTED]") {
		t.Error("no redaction marker in the result")
	}
}

// TestHostPathsNeverReturned: under runc a sandbox can read its mount table,
// which names the host directories behind its bind mounts; the broker's root
// must not reach the client that way.
func TestHostPathsNeverReturned(t *testing.T) { forRuntimes(t, testHostPathsNeverReturned) }

func testHostPathsNeverReturned(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	res := callTool(t, c, "run_code", map[string]any{"language": "bash", "code": "cat /proc/self/mountinfo"})
	j, _ := json.Marshal(res)
	if !strings.Contains(string(j), "/mnt/data") {
		t.Fatalf("probe did not print the mount table: %.300s", j)
	}
	if strings.Contains(string(j), b.Root) {
		t.Fatalf("the broker's host root %q appears in a tool result", b.Root)
	}
}
