# sandbox-broker agent: Python zygote.
#
# Started by the agent as `python3 -c <this file>` with a SOCK_SEQPACKET
# socket on fd 3, in the agent's session (services/agent/infra.go). Imports
# the heavy modules once, then keeps one forked spare child idle (in that
# session, signals blocked, non-dumpable)
# and hands each request to it, forking the next spare off the critical
# path: right after a short run's status, or while a longer run (over
# SPARE_DELAY_MS) is still going. The agent's sweep spares a zygote's
# children that are still in the agent's session (see sweep.go). Messages are
# single JSON objects, one per packet:
#
#   zygote -> agent  {"sealed": true}             (it is non-dumpable now)
#   zygote -> agent  {"ready": true, "pid": N, "preloaded": [...]}
#   agent  -> zygote {"path": "/tmp/run-1/main.py", "cwd": "/mnt/data",
#                     "env": {"MPLBACKEND": ..., "PYTHONPATH": ...} | null}
#                    + SCM_RIGHTS [stdin, stdout, stderr]
#   zygote -> agent  {"pid": CHILD}            (or {"error": "..."})
#   zygote -> agent  {"pid": CHILD, "exit": CODE} | {"pid": CHILD, "signal": SIG}
#
# The exit status is normally reported by the run itself (_finish, over a
# per-child socketpair, just before os._exit) so that the teardown of the
# inherited address space is off the critical path; otherwise (signals,
# os._exit) it comes from waitid. A spare that finds it was tampered with
# while idle (pending signals, changed rlimits/nice/affinity) exits without
# acknowledging the job and the zygote forks a fresh child instead.
#
# The zygote exits when fd 3 reaches EOF (the agent went away); spares die
# with it (PR_SET_PDEATHSIG). Children leave through _finish (os._exit after
# the interpreter's exit steps), not a full interpreter shutdown.
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


def _prctl(option, arg):
    global _libc
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(option, arg, 0, 0, 0)
    except Exception:
        return -1


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
    for name in ("runpy", "pkgutil", "traceback", "json", "socket", "signal", "atexit", "threading", "resource", "select", "random"):
        try:
            __import__(name)
        except Exception:
            pass
    return loaded


def _limits():
    """What a run inherits that other code of the same uid could change in
    an idle spare (rlimits, nice, affinity)."""
    import resource

    out = []
    for name in sorted(dir(resource)):
        if name.startswith("RLIMIT_"):
            try:
                out.append(resource.getrlimit(getattr(resource, name)))
            except (OSError, ValueError):
                out.append(None)
    try:
        out.append(os.getpriority(os.PRIO_PROCESS, 0))
        out.append(sorted(os.sched_getaffinity(0)))
    except OSError:
        pass
    return out


def _spare(chan, zygote_pid):
    """Runs in a forked spare: waits for one job on chan, then runs it.
    Returns the SystemExit argument. Exits without running anything when
    the job never comes or the spare was tampered with while idle."""
    import signal

    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
    if os.getppid() != zygote_pid:
        os._exit(0)
    # Idle with every signal blocked; what a fresh `python3 main.py` has
    # is installed now, off the critical path.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    limits = _limits()
    try:
        msg, fds, _flags, _addr = socket.recv_fds(chan, 65536, 8)
        req = json.loads(msg)
        path = req["path"]
        cwd = req["cwd"]
        env = req.get("env") or {}
    except Exception:
        os._exit(0)
    # The zygote's own SIGCONT (it wakes a stopped spare) is expected.
    if len(fds) != 3 or signal.sigpending() - {signal.SIGCONT} or _limits() != limits:
        os._exit(0)  # no ack: the zygote forks a fresh child instead
    try:
        os.setsid()
    except OSError:
        os._exit(0)  # must not stay in the agent's session
    _prctl(1, 0)  # the run outlives a dying zygote
    try:
        chan.send(b"ok")
        # Run nothing until the agent knows this pid: if the zygote dies
        # first, the agent falls back to running the code itself, and the
        # code must not have started here too.
        if chan.recv(1) != b"g":
            os._exit(0)
    except OSError:
        os._exit(0)
    for i, fd in enumerate(fds[:3]):
        if fd != i:
            os.dup2(fd, i)
    for fd in fds:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    global _status_chan
    _status_chan = chan
    _dumpable(1)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        os.chdir(cwd)
    except OSError as e:
        print("sandbox agent: chdir %s: %s" % (cwd, e), file=sys.stderr)
        return 1
    # The zygote seeded the global RNGs once; reseed so that runs do not
    # share random sequences.
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:
            pass
    rnd = sys.modules.get("random")
    if rnd is not None:
        try:
            rnd.seed()
        except Exception:
            pass
    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)
    _user_site()
    if env:
        _use_env(env)
    import runpy
    import traceback

    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return e.code
    except BaseException as e:
        tb = e.__traceback__
        t = tb
        while t is not None and t.tb_frame.f_code.co_filename != path:
            t = t.tb_next
        traceback.print_exception(type(e), e, t if t is not None else tb)
        return 1
    return 0


def _user_site():
    """The zygote runs with -s (its user site directory is the runs' to
    write); a run gets it as `python3 main.py` would."""
    try:
        import site

        site.ENABLE_USER_SITE = True
        user = site.getusersitepackages()
        if os.path.isdir(user):
            site.addsitedir(user)
    except Exception:
        pass


def _use_env(env):
    """Applies the run's own variables as a fresh interpreter would have
    read them at start: the figure backend (see figures.py) and the
    PYTHONPATH entry that holds it."""
    os.environ.update(env)
    lib = env.get("PYTHONPATH")
    if lib:
        sys.path.insert(1, lib)
    mpl = sys.modules.get("matplotlib")
    backend = env.get("MPLBACKEND")
    if mpl is None or not backend:
        return
    try:
        # The preload chose Agg but left pyplot's backend unresolved, so
        # the first figure loads this one.
        mpl.rcParams["backend"] = backend
    except Exception:
        return
    import atexit

    atexit.register(_save_open_figures)


def _save_open_figures():
    # Figures left open under a backend the run chose itself (say
    # matplotlib.use("Agg")) come back too.
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None or not plt.get_fignums():
        return
    try:
        import sandbox_figures

        sandbox_figures.save_open_figures()
    except Exception:
        pass


# The run's end of its status channel: _finish reports the exit status on
# it before the (slow) teardown of the inherited address space.
_status_chan = None

# A short run's exit is reported before the next spare is forked; a longer
# one gets its successor forked while it runs.
SPARE_DELAY_MS = 10


class _Zygote:
    def __init__(self, ctrl):
        self.ctrl = ctrl
        self.pid = os.getpid()
        self.spare = None  # (pid, chan)
        self.held = []  # sockets / fds a forked spare must close
        self.unreaped = set()

    def fork_spare(self):
        """Forks an idle child; in the child, runs it and never returns."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        try:
            pid = os.fork()
        except OSError:
            a.close()
            b.close()
            raise
        if pid == 0:
            a.close()
            self.ctrl.close()
            if self.spare is not None:
                self.spare[1].close()
            for h in self.held:
                if isinstance(h, int):
                    os.close(h)
                else:
                    h.close()
            _finish(_spare(b, self.pid))
        b.close()
        self.spare = (pid, a)

    def kill(self, pid, chan):
        chan.close()
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except OSError:
            pass

    def dispatch(self, msg, fds):
        """Hands the job to the spare; returns (pid, chan) or None."""
        pid, chan = self.spare
        self.spare = None
        try:
            os.kill(pid, 18)  # SIGCONT, in case it was stopped
            socket.send_fds(chan, [msg], fds)
            chan.settimeout(1.0)
            ack = chan.recv(16)
            chan.settimeout(None)
        except OSError:
            ack = b""
        if ack != b"ok":
            self.kill(pid, chan)
            return None
        return pid, chan

    def reap(self):
        for pid in list(self.unreaped):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            except ChildProcessError:
                pass
            self.unreaped.discard(pid)

    def wait(self, pid, chan):
        """Waits for the run's status: early from _finish, else waitid.
        Returns (message, reaped_later)."""
        import select

        try:
            pfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pfd = -1
        poller = select.poll()
        poller.register(chan, select.POLLIN)
        if pfd >= 0:
            poller.register(pfd, select.POLLIN)
        timeout = SPARE_DELAY_MS if self.spare is None else None
        try:
            while pfd >= 0:
                events = poller.poll(timeout)
                if not events:
                    if timeout is not None:
                        timeout = None
                        self.held = [chan, pfd]
                        try:
                            self.fork_spare()
                        except OSError:
                            pass
                        self.held = []
                    continue
                if any(fd == pfd for fd, _ev in events):
                    break  # exited without reporting: ask waitid
                try:
                    data = chan.recv(64)
                    code = int(data[1:]) if data[:1] == b"x" else -1
                except (OSError, ValueError):
                    code = -1
                if 0 <= code <= 255:
                    return {"pid": pid, "exit": code}, True
                poller.unregister(chan)  # EOF or garbage
        finally:
            if pfd >= 0:
                os.close(pfd)
        # Wait without reaping (WNOWAIT), report, then reap: if the zygote
        # is killed in between, the zombie is re-parented to the agent,
        # which then collects the status itself.
        res = {"pid": pid, "exit": -1}
        while True:
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            except InterruptedError:
                continue
            except ChildProcessError:
                break
            if info is None:
                continue
            if info.si_code == os.CLD_EXITED:
                res = {"pid": pid, "exit": info.si_status}
            else:
                res = {"pid": pid, "signal": info.si_status}
            break
        return res, False


def _serve():
    ctrl = socket.socket(fileno=CTRL_FD)
    _dumpable(0)
    ctrl.send(b'{"sealed": true}')
    preloaded = _preload()
    import gc

    # Keep the preloaded objects out of the children's garbage collections,
    # which would otherwise copy every page they touch.
    gc.collect()
    gc.freeze()
    z = _Zygote(ctrl)
    ctrl.send(json.dumps({"ready": True, "pid": os.getpid(), "preloaded": preloaded}).encode())
    try:
        z.fork_spare()
    except OSError:
        pass
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctrl, 65536, 8)
        except OSError:
            return
        if not msg:
            for fd in fds:
                os.close(fd)
            return
        z.reap()
        try:
            req = json.loads(msg)
            req["path"], req["cwd"]
            if len(fds) != 3:
                raise ValueError("want 3 fds, got %d" % len(fds))
        except Exception as e:
            for fd in fds:
                os.close(fd)
            ctrl.send(json.dumps({"error": "bad request: %s" % e}).encode())
            continue
        child = None
        err = "no spare"
        for _attempt in range(2):
            if z.spare is None:
                try:
                    z.fork_spare()
                except OSError as e:
                    err = "fork: %s" % e
                    break
            child = z.dispatch(msg, fds)
            if child is not None:
                break
            err = "spare did not take the job"
        for fd in fds:
            os.close(fd)
        if child is None:
            ctrl.send(json.dumps({"error": err}).encode())
            continue
        pid, chan = child
        try:
            ctrl.send(json.dumps({"pid": pid}).encode())
        except OSError:
            z.kill(pid, chan)  # the agent is gone: the job must not run
            return
        try:
            chan.send(b"g")  # the agent has the pid: the child may run
        except OSError:
            pass  # the child died; wait() reports it
        res, early = z.wait(pid, chan)
        chan.close()
        try:
            ctrl.send(json.dumps(res).encode())
        except OSError:
            return
        if early:
            z.unreaped.add(pid)
        else:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        if z.spare is None:
            try:
                z.fork_spare()
            except OSError:
                pass


def _finish(code):
    """Leave the child like the interpreter's shutdown would, but without a
    full Py_Finalize: its garbage collection touches every object inherited
    from the zygote, copying all those pages (tens of milliseconds)."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        status = 1
    try:
        import threading

        threading._shutdown()  # join non-daemon threads
    except BaseException:
        pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        pass
    for f in (sys.stdout, sys.stderr):
        try:
            if f is not None:
                f.flush()
        except Exception:
            if status == 0:
                status = 120
    if _status_chan is not None:
        # Report now: tearing down the address space inherited from the
        # zygote takes milliseconds. Closing stdio first lets the agent see
        # the output's end without waiting for that either.
        os.closerange(0, 3)
        try:
            _status_chan.send(b"x%d" % (status & 0xFF))
        except OSError:
            pass
    os._exit(status & 0xFF)


_serve()
os._exit(0)
