# sandbox-broker agent: Python zygote.
#
# Started by the agent as `python3 -c <this file>` with a SOCK_SEQPACKET
# socket on fd 3, in the agent's session (services/agent/infra.go). Imports
# the heavy modules once, then keeps one forked spare child idle (in that
# session, signals blocked, non-dumpable) whose channel it hands to the
# agent, so that a run goes from the agent to the spare and its status
# back without passing through the zygote. The agent's sweep spares a
# zygote's children that are still in the agent's session (see sweep.go).
# Messages are single JSON objects, one per packet:
#
#   zygote -> agent  {"sealed": true}             (it is non-dumpable now)
#   zygote -> agent  {"ready": true, "pid": N, "preloaded": [...],
#                     "hot_pages": N}  (what each spare copies ahead, see _learn)
#   zygote -> agent  {"spare": PID} + SCM_RIGHTS [channel]
#                    (a new idle spare and the agent's end of its channel;
#                    the first comes unasked, each next one on request)
#   agent  -> zygote {"fork": true}            (the spare was taken or lost)
#   zygote -> agent  {"pid": CHILD, "exit": CODE | "signal": SIG, "taken": BOOL}
#                    (a child ended, and whether it had taken a job; sent
#                    before it is reaped, so that a zygote killed in
#                    between leaves the zombie to the agent, its subreaper)
#
# and on a spare's channel:
#
#   agent  -> spare  {"path": "/tmp/run-1/main.py", "cwd": "/mnt/data",
#                     "env": {"MPLBACKEND": ..., "PYTHONPATH": ...} | null}
#                    + SCM_RIGHTS [stdin, stdout, stderr]
#   spare  -> agent  b"x" + CODE               (its exit status, see _finish)
#
# The agent knows a spare's pid before it hands it a job, so a spare runs
# the job as soon as it has taken it, with no round trip. Taking it is
# calling setsid: a process that leads its own session ran the job (no
# code of a run can leave the session it leads), one that does not never
# did, and the zygote says which in each child's exit report ("taken"). A
# spare that finds it was tampered with while idle (pending signals,
# changed rlimits/nice/affinity) exits without taking the job; the agent
# then hands the job to another. While idle, a spare does the work every
# run starts with (reseeding, a dry run through the run path) so that a
# run does not pay for the copy-on-write faults of that path.
#
# The zygote exits when fd 3 reaches EOF (the agent went away); spares die
# with it (PR_SET_PDEATHSIG). Children leave through _finish (os._exit after
# the interpreter's exit steps), not a full interpreter shutdown. What runs
# in the children is in spare.py, which the agent appends to this file.
import json
import os
import socket
import sys

# `python3 -c` puts the current directory first on sys.path; a fresh
# `python3 main.py` has the script's directory there instead (set per run).
if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]

CTRL_FD = 3


_libc = None


def _c():
    """libc through ctypes, loaded once; None where ctypes is missing."""
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
        except Exception:
            _libc = False
    return _libc or None


def _prctl(option, arg):
    c = _c()
    return c.prctl(option, arg, 0, 0, 0) if c else -1


def _dumpable(flag):
    # A non-dumpable zygote cannot be ptrace'd or have /proc/<pid>/mem
    # opened by code of the same uid. Children switch it back on.
    _prctl(4, flag)  # PR_SET_DUMPABLE


def _preload():
    loaded = []
    for name in ("numpy", "pandas", "matplotlib"):
        try:
            __import__(name)
            loaded.append(name)
        except Exception:
            pass
    if "matplotlib" in loaded:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401

            loaded.append("matplotlib.pyplot")
        except Exception:
            pass
    # Cheap modules every run imports anyway.
    for name in ("importlib.machinery", "types", "site", "traceback", "json", "socket", "signal", "atexit", "threading", "resource", "select", "random"):
        try:
            __import__(name)
        except Exception:
            pass
    return loaded


_RLIMITS = ()
# The zygote's _limits() once it is ready: every spare must have them (a
# run of the same uid can change another process's rlimits and nice).
_limits_at_start = None


def _limits():
    """What a run inherits that other code of the same uid could change in
    an idle spare (rlimits, nice, affinity)."""
    import resource

    global _RLIMITS
    if not _RLIMITS:
        _RLIMITS = tuple(getattr(resource, n) for n in sorted(dir(resource)) if n.startswith("RLIMIT_"))
    out = []
    for limit in _RLIMITS:
        try:
            out.append(resource.getrlimit(limit))
        except (OSError, ValueError):
            out.append(None)
    try:
        out.append(os.getpriority(os.PRIO_PROCESS, 0))
        out.append(sorted(os.sched_getaffinity(0)))
    except OSError:
        pass
    return out


# What every run sets the same way, set once by the zygote (_defaults) so
# that the pages stay shared rather than copied by each run.
_user_site_path = None
_preload_backend = None  # the backend the preload chose
_figures_backend = None  # the agent's, for runs (figures.py)


def _defaults(figures_backend):
    """The user site directory (the zygote runs with -s; its runs get it as
    `python3 main.py` would), the figure backend runs select, and the hook
    that saves the figures a run leaves open."""
    global _user_site_path, _preload_backend, _figures_backend
    try:
        import site

        site.ENABLE_USER_SITE = True
        _user_site_path = site.getusersitepackages()
    except Exception:
        pass
    mpl = sys.modules.get("matplotlib")
    if mpl is None or not figures_backend:
        return
    try:
        _preload_backend = dict.__getitem__(mpl.rcParams, "backend")
        # The preload chose Agg but left pyplot's backend unresolved, so
        # the first figure loads this one.
        mpl.rcParams["backend"] = figures_backend
        _figures_backend = figures_backend
    except Exception:
        return
    import atexit

    atexit.register(_save_open_figures)


class _Zygote:
    def __init__(self, ctrl):
        self.ctrl = ctrl
        self.pid = os.getpid()
        self.held = []  # fds a forked spare must close

    def fork_spare(self):
        """Forks an idle child and hands the agent its channel; in the
        child, runs it and never returns."""
        if _limits() != _limits_at_start:
            # Code of a run changed the zygote's limits: its spares would
            # all turn their jobs down. The agent starts another.
            print("sandbox agent: zygote %d: its limits were changed; exiting" % self.pid, file=sys.stderr)
            os._exit(1)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        # The spare is born with every signal blocked: one sent to it is
        # left pending from its first instruction on (see _take).
        mask = _block_signals()
        try:
            pid = os.fork()
        except OSError:
            _restore_signals(mask)
            a.close()
            b.close()
            raise
        if pid == 0:
            a.close()
            self.ctrl.close()
            for fd in self.held:
                os.close(fd)
            _finish(_spare(b, self.pid, mask))
        _restore_signals(mask)
        b.close()
        try:
            socket.send_fds(self.ctrl, [json.dumps({"spare": pid}).encode()], [a.fileno()])
        finally:
            a.close()

    def reap(self):
        """Reports every child that has ended to the agent, then reaps it
        (waitid WNOWAIT first: if the zygote dies in between, the zombie
        is the agent's to collect)."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            pid = info.si_pid
            if info.si_code == os.CLD_EXITED:
                res = {"pid": pid, "exit": info.si_status}
            else:
                res = {"pid": pid, "signal": info.si_status}
            try:
                res["taken"] = os.getsid(pid) == pid  # a zombie keeps its session
            except OSError:
                res["taken"] = True  # unknown: never run a job twice
            self.ctrl.send(json.dumps(res).encode())
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _serve():
    global _limits_at_start
    import select
    import signal

    ctrl = socket.socket(fileno=CTRL_FD)
    try:  # before the zygote seals itself: see _learn
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        pagemap = -1
    _dumpable(0)
    ctrl.send(b'{"sealed": true}')
    preloaded = _preload()
    _defaults(sys.argv[1] if len(sys.argv) > 1 else None)
    import gc

    # Keep the preloaded objects out of the children's garbage collections,
    # which would otherwise copy every page they touch.
    gc.collect()
    gc.freeze()
    _limits_at_start = _limits()
    if pagemap >= 0:
        try:
            _learn(pagemap)
        except Exception:
            pass
        os.close(pagemap)
    z = _Zygote(ctrl)
    # SIGCHLD wakes the loop through this pipe.
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    z.held = [wake_r, wake_w]
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    hot = sum(n for _start, n in _hot) // _PAGE
    ctrl.send(json.dumps({"ready": True, "pid": os.getpid(), "preloaded": preloaded, "hot_pages": hot}).encode())
    poller = select.poll()
    poller.register(ctrl, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    requests = 1  # the first spare comes unasked
    while True:
        if requests:
            requests = 0
            try:
                z.fork_spare()
            except OSError as e:
                try:
                    ctrl.send(json.dumps({"error": "fork: %s" % e}).encode())
                except OSError:
                    return
        for fd, _ev in poller.poll():
            if fd == wake_r:
                try:
                    while os.read(wake_r, 256):
                        pass
                except BlockingIOError:
                    pass
                continue
            try:
                msg, fds, _flags, _addr = socket.recv_fds(ctrl, 4096, 4)
            except OSError:
                return
            for extra in fds:
                os.close(extra)
            if not msg:
                return
            try:
                requests += bool(json.loads(msg).get("fork"))
            except Exception:
                pass
        try:
            z.reap()
        except OSError:
            return
