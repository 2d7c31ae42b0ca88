package docker

import (
	"encoding/json"
	"sync"
)

// Seccomp profile for sandbox containers.
//
// Docker 20.10's built-in default profile still allows io_uring_setup,
// io_uring_enter and io_uring_register (security-cases.md §1.1), and the
// module in go.mod (github.com/docker/docker v28.5.2+incompatible) no longer
// ships DefaultProfile(): profiles/seccomp there is only a set of deprecated
// type aliases to github.com/moby/profiles/seccomp, which is not a dependency
// of this module. So the profile is written here, in Go, following the same
// policy as moby's current default (an allowlist with default action ERRNO)
// but tightened for containers that never hold any capability:
//
//   - no capability-conditional rules at all (CapDrop ALL adds nothing back),
//     so mount, umount2, unshare, setns, chroot, pivot_root, ptrace,
//     process_vm_*, kcmp, bpf, perf_event_open, keyctl, add_key, request_key,
//     userfaultfd, *_module, kexec_*, reboot, swapon/off, quotactl, acct,
//     open_by_handle_at, fanotify_init, lookup_dcookie, nfsservctl, sethostname,
//     setdomainname, settimeofday, clock_settime, syslog, vhangup, iopl, ioperm,
//     mbind/set_mempolicy/move_pages, the new mount API (fsopen, fsmount,
//     open_tree, move_mount, mount_setattr) and pidfd_getfd all fall to the
//     default action (EPERM);
//   - clone is allowed only without any CLONE_NEW* namespace flag (so
//     clone(CLONE_NEWUSER) stays blocked, exactly as unshare is), and clone3,
//     whose flags live in memory seccomp cannot inspect, fails with ENOSYS so
//     libc falls back to clone;
//   - under gVisor (runsc, which must run with --oci-seccomp for this profile
//     to apply at all) clone3 is allowed instead: runsc turns every ERRNO
//     rule into EPERM, and glibc falls back to clone only on ENOSYS, so
//     threads could not start. The Sentry implements clone3 and its
//     namespaces itself; the host kernel never sees them;
//   - io_uring_setup, io_uring_enter and io_uring_register get an explicit
//     ERRNO(EPERM) rule, so a later edit of the allowlist cannot let them in.
//
// Syscall names unknown to the host's libseccomp are ignored by runc, so the
// list can name syscalls of every supported architecture.

const (
	errnoEPERM  = 1
	errnoENOSYS = 38
	// cloneNamespaceFlags is CLONE_NEWNS|CLONE_NEWCGROUP|CLONE_NEWUTS|
	// CLONE_NEWIPC|CLONE_NEWUSER|CLONE_NEWPID|CLONE_NEWNET (0x7E020000).
	cloneNamespaceFlags = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
)

// seccompProfile is the JSON shape the Docker daemon accepts in
// SecurityOpt "seccomp=<json>" (API 1.41).
type seccompProfile struct {
	DefaultAction   string           `json:"defaultAction"`
	DefaultErrnoRet *uint            `json:"defaultErrnoRet,omitempty"`
	ArchMap         []seccompArchMap `json:"archMap"`
	Syscalls        []seccompSyscall `json:"syscalls"`
}

type seccompArchMap struct {
	Arch    string   `json:"architecture"`
	SubArch []string `json:"subArchitectures"`
}

type seccompSyscall struct {
	Names    []string       `json:"names"`
	Action   string         `json:"action"`
	ErrnoRet *uint          `json:"errnoRet,omitempty"`
	Args     []seccompArg   `json:"args,omitempty"`
	Comment  string         `json:"comment,omitempty"`
	Excludes *seccompFilter `json:"excludes,omitempty"`
}

type seccompArg struct {
	Index    uint   `json:"index"`
	Value    uint64 `json:"value"`
	ValueTwo uint64 `json:"valueTwo"`
	Op       string `json:"op"`
}

type seccompFilter struct {
	Arches []string `json:"arches,omitempty"`
}

func errno(n uint) *uint { return &n }

// allowedSyscalls is allowed unconditionally.
var allowedSyscalls = []string{
	"accept", "accept4", "access", "adjtimex", "alarm", "bind", "brk", "cachestat",
	"capget", "capset", "chdir", "chmod", "chown", "chown32",
	"clock_adjtime", "clock_adjtime64", "clock_getres", "clock_getres_time64",
	"clock_gettime", "clock_gettime64", "clock_nanosleep", "clock_nanosleep_time64",
	"close", "close_range", "connect", "copy_file_range", "creat",
	"dup", "dup2", "dup3",
	"epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait", "epoll_pwait2",
	"epoll_wait", "epoll_wait_old", "eventfd", "eventfd2",
	"execve", "execveat", "exit", "exit_group",
	"faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate",
	"fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat",
	"fcntl", "fcntl64", "fdatasync", "fgetxattr", "flistxattr", "flock", "fork",
	"fremovexattr", "fsetxattr", "fstat", "fstat64", "fstatat64", "fstatfs", "fstatfs64",
	"fsync", "ftruncate", "ftruncate64",
	"futex", "futex_requeue", "futex_time64", "futex_wait", "futex_waitv", "futex_wake", "futimesat",
	"getcpu", "getcwd", "getdents", "getdents64",
	"getegid", "getegid32", "geteuid", "geteuid32", "getgid", "getgid32", "getgroups", "getgroups32",
	"getitimer", "getpeername", "getpgid", "getpgrp", "getpid", "getppid", "getpriority",
	"getrandom", "getresgid", "getresgid32", "getresuid", "getresuid32", "getrlimit",
	"get_robust_list", "getrusage", "getsid", "getsockname", "getsockopt", "get_thread_area",
	"gettid", "gettimeofday", "getuid", "getuid32", "getxattr",
	"inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch",
	"io_cancel", "ioctl", "io_destroy", "io_getevents", "io_pgetevents", "io_pgetevents_time64",
	"ioprio_get", "ioprio_set", "io_setup", "io_submit", "ipc",
	"kill", "lchown", "lchown32", "lgetxattr", "link", "linkat", "listen", "listxattr", "llistxattr",
	"_llseek", "lremovexattr", "lseek", "lsetxattr", "lstat", "lstat64",
	"madvise", "membarrier", "memfd_create", "mincore", "mkdir", "mkdirat", "mknod", "mknodat",
	"mlock", "mlock2", "mlockall", "mmap", "mmap2", "mprotect",
	"mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedreceive_time64",
	"mq_timedsend", "mq_timedsend_time64", "mq_unlink", "mremap",
	"msgctl", "msgget", "msgrcv", "msgsnd", "msync", "munlock", "munlockall", "munmap",
	"nanosleep", "newfstatat", "_newselect", "open", "openat", "openat2",
	"pause", "pidfd_open", "pidfd_send_signal", "pipe", "pipe2",
	"pkey_alloc", "pkey_free", "pkey_mprotect", "poll", "ppoll", "ppoll_time64", "prctl",
	"pread64", "preadv", "preadv2", "prlimit64", "pselect6", "pselect6_time64",
	"pwrite64", "pwritev", "pwritev2",
	"read", "readahead", "readlink", "readlinkat", "readv",
	"recv", "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "remap_file_pages",
	"removexattr", "rename", "renameat", "renameat2", "restart_syscall", "rmdir", "rseq",
	"rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn",
	"rt_sigsuspend", "rt_sigtimedwait", "rt_sigtimedwait_time64", "rt_tgsigqueueinfo",
	"sched_getaffinity", "sched_getattr", "sched_getparam", "sched_get_priority_max",
	"sched_get_priority_min", "sched_getscheduler", "sched_rr_get_interval",
	"sched_rr_get_interval_time64", "sched_setaffinity", "sched_setattr", "sched_setparam",
	"sched_setscheduler", "sched_yield", "seccomp", "select",
	"semctl", "semget", "semop", "semtimedop", "semtimedop_time64",
	"send", "sendfile", "sendfile64", "sendmmsg", "sendmsg", "sendto",
	"setfsgid", "setfsgid32", "setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups", "setgroups32",
	"setitimer", "setpgid", "setpriority", "setregid", "setregid32", "setresgid", "setresgid32",
	"setresuid", "setresuid32", "setreuid", "setreuid32", "setrlimit", "set_robust_list",
	"setsid", "setsockopt", "set_thread_area", "set_tid_address", "setuid", "setuid32", "setxattr",
	"shmat", "shmctl", "shmdt", "shmget", "shutdown", "sigaltstack", "signalfd", "signalfd4",
	"sigprocmask", "sigreturn", "socket", "socketcall", "socketpair", "splice",
	"stat", "stat64", "statfs", "statfs64", "statx", "symlink", "symlinkat",
	"sync", "sync_file_range", "syncfs", "sysinfo",
	"tee", "tgkill", "time", "timer_create", "timer_delete", "timer_getoverrun",
	"timer_gettime", "timer_gettime64", "timer_settime", "timer_settime64",
	"timerfd_create", "timerfd_gettime", "timerfd_gettime64", "timerfd_settime", "timerfd_settime64",
	"times", "tkill", "truncate", "truncate64", "ugetrlimit", "umask", "uname",
	"unlink", "unlinkat", "utime", "utimensat", "utimensat_time64", "utimes",
	"vfork", "vmsplice", "wait4", "waitid", "waitpid", "write", "writev",
	// Architecture-specific helpers (ignored where unknown).
	"arch_prctl", "modify_ldt", // x86
	"arm_fadvise64_64", "arm_sync_file_range", "sync_file_range2", "breakpoint", "cacheflush", "set_tls", // arm
}

// ioUringSyscalls must never be allowed.
var ioUringSyscalls = []string{"io_uring_setup", "io_uring_enter", "io_uring_register"}

// forbiddenSyscalls are never in the allowlist; the profile test checks it.
var forbiddenSyscalls = []string{
	"unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot",
	"ptrace", "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd",
	"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
	"open_by_handle_at", "fsopen", "fsmount", "fsconfig", "open_tree", "move_mount",
	"mount_setattr", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "reboot",
	"swapon", "swapoff", "syslog", "acct", "quotactl", "sethostname", "setdomainname",
	"clone3", "personality", "clone",
}

func buildSeccompProfile(gvisor bool) seccompProfile {
	p := seccompProfile{
		DefaultAction:   "SCMP_ACT_ERRNO",
		DefaultErrnoRet: errno(errnoEPERM),
		ArchMap: []seccompArchMap{
			{Arch: "SCMP_ARCH_X86_64", SubArch: []string{"SCMP_ARCH_X86", "SCMP_ARCH_X32"}},
			{Arch: "SCMP_ARCH_AARCH64", SubArch: []string{"SCMP_ARCH_ARM"}},
		},
	}
	p.Syscalls = append(p.Syscalls, seccompSyscall{
		Names:  append([]string(nil), allowedSyscalls...),
		Action: "SCMP_ACT_ALLOW",
	})
	// personality: only the harmless personas (as moby's default).
	for _, v := range []uint64{0x0, 0x8, 0x20000, 0x20008, 0xffffffff} {
		p.Syscalls = append(p.Syscalls, seccompSyscall{
			Names:  []string{"personality"},
			Action: "SCMP_ACT_ALLOW",
			Args:   []seccompArg{{Index: 0, Value: v, Op: "SCMP_CMP_EQ"}},
		})
	}
	// clone without any namespace flag (flags are argument 0 except on s390).
	p.Syscalls = append(p.Syscalls, seccompSyscall{
		Names:    []string{"clone"},
		Action:   "SCMP_ACT_ALLOW",
		Args:     []seccompArg{{Index: 0, Value: cloneNamespaceFlags, ValueTwo: 0, Op: "SCMP_CMP_MASKED_EQ"}},
		Comment:  "clone without CLONE_NEW* flags; namespaces (CLONE_NEWUSER included) stay blocked",
		Excludes: &seccompFilter{Arches: []string{"s390", "s390x"}},
	})
	if gvisor {
		p.Syscalls = append(p.Syscalls, seccompSyscall{
			Names:   []string{"clone3"},
			Action:  "SCMP_ACT_ALLOW",
			Comment: "runsc returns EPERM for every ERRNO rule, which stops libc's fallback to clone; the Sentry implements clone3",
		})
	} else {
		p.Syscalls = append(p.Syscalls, seccompSyscall{
			Names:    []string{"clone3"},
			Action:   "SCMP_ACT_ERRNO",
			ErrnoRet: errno(errnoENOSYS),
			Comment:  "clone3 flags cannot be inspected; ENOSYS makes libc fall back to clone",
		})
	}
	p.Syscalls = append(p.Syscalls, seccompSyscall{
		Names:    append([]string(nil), ioUringSyscalls...),
		Action:   "SCMP_ACT_ERRNO",
		ErrnoRet: errno(errnoEPERM),
		Comment:  "io_uring bypasses per-syscall filtering; Docker 20.10's default allows it",
	})
	return p
}

var (
	seccompOnce sync.Once
	seccompJSON map[bool]string
)

// SeccompProfileJSON returns the profile passed as SecurityOpt
// "seccomp=<json>" to every sandbox container of the OCI runtime.
func SeccompProfileJSON(runtime string) string {
	seccompOnce.Do(func() {
		seccompJSON = map[bool]string{}
		for _, gvisor := range []bool{false, true} {
			b, err := json.Marshal(buildSeccompProfile(gvisor))
			if err != nil {
				panic("docker: marshal seccomp profile: " + err.Error())
			}
			seccompJSON[gvisor] = string(b)
		}
	})
	return seccompJSON[runtime == RuntimeRunsc]
}
