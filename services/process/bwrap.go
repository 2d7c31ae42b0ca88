package process

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// etcFiles is the synthetic /etc: the sandbox user and nothing of the
// host's accounts, resolver or configuration.
var etcFiles = map[string]string{
	"passwd": "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n" +
		"sandbox:x:" + strconv.Itoa(SandboxUID) + ":" + strconv.Itoa(SandboxGID) + ":sandbox:/tmp:/bin/bash\n" +
		"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
	"group":         "root:x:0:\nsandbox:x:" + strconv.Itoa(SandboxGID) + ":\nnogroup:x:65534:\n",
	"hosts":         "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
	"nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files\n",
	"hostname":      "sandbox\n",
}

// hostEtc is what the sandbox sees of the host's /etc, read-only: the
// loader cache, CA certificates, the alternatives symlinks /usr needs and
// matplotlib's defaults (Debian keeps them in /etc; matplotlib does not
// import without them). Everything else (shadow, ssh, sudoers,
// resolv.conf, …) is absent.
var hostEtc = []string{
	"/etc/ld.so.cache",
	"/etc/ssl/certs",
	"/etc/ssl/openssl.cnf",
	"/etc/alternatives",
	"/etc/localtime",
	"/etc/matplotlibrc",
}

// writeEtc writes the synthetic /etc files into dir (root-owned, 0644).
func writeEtc(dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", err
	}
	for name, content := range etcFiles {
		p := filepath.Join(dir, name)
		tmp := p + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			return "", err
		}
		if err := os.Chmod(tmp, 0o644); err != nil {
			return "", err
		}
		if err := os.Rename(tmp, p); err != nil {
			return "", err
		}
	}
	return dir, nil
}

// usrLinks are the top-level directories merged-/usr hosts make symlinks
// into /usr; on other hosts the real directory is bound read-only.
var usrLinks = []string{"bin", "sbin", "lib", "lib32", "lib64", "libx32"}

// bwrapArgs is the complete sandbox: new user (uid/gid 1000 inside, no
// further user namespaces), pid, ipc, uts, net and cgroup namespaces; no
// capabilities; a read-only root
// (r's runner file system, or an empty one with the host's /usr), the
// synthetic /etc files, /proc, /dev, size-bounded /tmp and /dev/shm, and
// exactly three paths of the broker's: the workspace (rw), the run dir
// holding the agent and egress sockets (rw) and the agent binary (ro). No
// $HOME, no Root, no other session.
func (b *Backend) bwrapArgs(r *runner, workspaceDir, runDir string, command []string) []string {
	a := []string{
		"--unshare-user", "--uid", strconv.Itoa(SandboxUID), "--gid", strconv.Itoa(SandboxGID),
		// No nested user namespace: in one, code would hold every
		// capability again (a net namespace's nf_tables, mounts), the
		// kernel surface Docker's seccomp profile keeps closed.
		"--disable-userns",
		"--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--unshare-cgroup-try",
		"--hostname", "sandbox",
		"--die-with-parent", "--new-session", "--cap-drop", "ALL",
		"--clearenv",
	}
	if r.fs != nil {
		a = append(a, runnerRootArgs(r)...)
	} else {
		a = append(a, hostRootArgs()...)
	}
	for _, name := range slices.Sorted(maps.Keys(etcFiles)) {
		a = append(a, "--ro-bind", filepath.Join(b.etcDir, name), "/etc/"+name)
	}
	a = append(a,
		"--proc", "/proc",
		"--dev", "/dev",
		"--size", strconv.FormatInt(16<<20, 10), "--tmpfs", "/dev/shm",
		"--size", strconv.FormatInt(b.o.TmpBytes, 10), "--tmpfs", "/tmp",
		"--bind", workspaceDir, WorkspacePath,
	)
	if r.fs == nil { // a runner file system has it (runnerfs.Layout)
		a = append(a, "--symlink", WorkspacePath, DataAlias)
	}
	a = append(a,
		"--bind", runDir, agent.SocketDir,
		"--ro-bind", b.agent, AgentPath,
		// Only /mnt/data, /tmp and /dev/shm stay writable.
		"--remount-ro", "/dev",
		"--remount-ro", "/",
		"--chdir", WorkspacePath,
		"--",
	)
	return append(a, command...)
}

// runnerPath is the Docker engine's PATH for containers; sandboxPath the
// one on the host's /usr, where only /usr is mounted.
const (
	runnerPath  = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	sandboxPath = "/usr/local/bin:/usr/bin:/bin"
)

// runnerRootArgs mounts r's file system read-only as the root, as the
// image is a container's, with the image's environment and the PATH, HOME
// and LANG the Docker engine gives its containers.
func runnerRootArgs(r *runner) []string {
	var a []string
	for _, e := range r.fs.Env {
		k, v, _ := strings.Cut(e, "=")
		a = append(a, "--setenv", k, v)
	}
	return append(a,
		"--setenv", "PATH", runnerPath,
		"--setenv", "HOME", "/tmp",
		"--setenv", "TMPDIR", "/tmp",
		"--setenv", "LANG", "C.UTF-8",
		"--ro-bind", r.fs.Rootfs, "/",
	)
}

// hostRootArgs is the fallback without runner file systems: an empty root
// with the host's /usr and, of its /etc, only hostEtc.
func hostRootArgs() []string {
	a := []string{
		"--setenv", "PATH", sandboxPath,
		"--setenv", "HOME", "/tmp",
		"--setenv", "TMPDIR", "/tmp",
		"--setenv", "LANG", "C.UTF-8",
		"--ro-bind", "/usr", "/usr",
	}
	for _, d := range usrLinks {
		host := "/" + d
		fi, err := os.Lstat(host)
		switch {
		case err != nil:
		case fi.Mode()&os.ModeSymlink != 0:
			if t, err := os.Readlink(host); err == nil && (t == "usr/"+d || t == "/usr/"+d) {
				a = append(a, "--symlink", "usr/"+d, host)
			}
		case fi.IsDir():
			a = append(a, "--ro-bind", host, host)
		}
	}
	a = append(a, "--dir", "/etc")
	for _, p := range hostEtc {
		a = append(a, "--ro-bind-try", p, p)
	}
	return a
}

// agentCommand is the in-sandbox agent's command line. Its language is
// the default of requests without one; python keeps a warm zygote.
func (b *Backend) agentCommand(r *runner) []string {
	return []string{AgentPath, "agent",
		"--socket", agent.SocketDir + "/" + agent.SocketName,
		"--language", r.lang,
		"--workdir", WorkspacePath,
		"--tmpdir", "/tmp",
		// bwrap's init is PID 1 and the agent its child, not root.
		"--sweep", "container",
		"--warm-on-request", "--idle-release", b.o.IdleRelease.String(),
	}
}

// sysProcAttr is how the broker starts bwrap (or the wrapper that execs
// it): in a session of its own, killed with the broker, as the sandbox uid
// with no supplementary groups when the broker is root.
func (b *Backend) sysProcAttr(uid, gid int) *syscall.SysProcAttr {
	a := &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if os.Geteuid() == 0 {
		a.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	}
	return a
}
