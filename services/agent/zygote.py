# sandbox-broker agent: Python zygote.
#
# Started by the agent as `python3 -c <this file>` with a SOCK_SEQPACKET
# socket on fd 3. Imports the heavy modules once, then forks one child per
# request. Messages are single JSON objects, one per packet:
#
#   zygote -> agent  {"ready": true, "pid": N, "preloaded": [...]}
#   agent  -> zygote {"path": "/tmp/run-1/main.py", "cwd": "/mnt/data"}
#                    + SCM_RIGHTS [stdin, stdout, stderr]
#   zygote -> agent  {"pid": CHILD}            (or {"error": "..."})
#   zygote -> agent  {"pid": CHILD, "exit": CODE} | {"pid": CHILD, "signal": SIG}
#
# The zygote exits when fd 3 reaches EOF (the agent went away). Children
# leave through _finish (os._exit after the interpreter's exit steps), not a
# full interpreter shutdown.
import os
import sys

# `python3 -c` puts the current directory first on sys.path; a fresh
# `python3 main.py` has the script's directory there instead (set per run).
if sys.path and sys.path[0] in ("", "."):
    del sys.path[0]

CTRL_FD = 3


def _dumpable(flag):
    # A non-dumpable zygote cannot be ptrace'd or have /proc/<pid>/mem
    # opened by code of the same uid. Children switch it back on.
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, flag, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass


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
    for name in ("runpy", "pkgutil", "traceback", "json", "socket", "signal", "atexit", "threading"):
        try:
            __import__(name)
        except Exception:
            pass
    return loaded


def _child(ctrl, fds, path, cwd):
    """Runs in the forked child. Returns the SystemExit argument."""
    import signal

    try:
        os.setsid()
    except OSError:
        pass
    ctrl.close()
    for i, fd in enumerate(fds[:3]):
        if fd != i:
            os.dup2(fd, i)
    for fd in fds:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    _dumpable(1)
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    # What a fresh `python3 main.py` has.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        os.chdir(cwd)
    except OSError as e:
        print("sandbox agent: chdir %s: %s" % (cwd, e), file=sys.stderr)
        return 1
    # The zygote seeded numpy's global RNG once; reseed so that runs do not
    # share random sequences (random reseeds itself at fork).
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:
            pass
    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)
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


def _serve():
    import json
    import socket

    ctrl = socket.socket(fileno=CTRL_FD)
    _dumpable(0)
    preloaded = _preload()
    import gc

    # Keep the preloaded objects out of the children's garbage collections,
    # which would otherwise copy every page they touch.
    gc.collect()
    gc.freeze()
    ctrl.send(json.dumps({"ready": True, "pid": os.getpid(), "preloaded": preloaded}).encode())
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctrl, 65536, 8)
        except OSError:
            return ("quit", 0)
        if not msg:
            for fd in fds:
                os.close(fd)
            return ("quit", 0)
        try:
            req = json.loads(msg)
            path = req["path"]
            cwd = req["cwd"]
            if len(fds) != 3:
                raise ValueError("want 3 fds, got %d" % len(fds))
        except Exception as e:
            for fd in fds:
                os.close(fd)
            ctrl.send(json.dumps({"error": "bad request: %s" % e}).encode())
            continue
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            ctrl.send(json.dumps({"error": "fork: %s" % e}).encode())
            continue
        if pid == 0:
            return ("child", _child(ctrl, fds, path, cwd))
        for fd in fds:
            os.close(fd)
        try:
            ctrl.send(json.dumps({"pid": pid}).encode())
        except OSError:
            pass
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
        try:
            ctrl.send(json.dumps(res).encode())
        except OSError:
            return ("quit", 0)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
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
    os._exit(status & 0xFF)


_kind, _code = _serve()
if _kind == "quit":
    os._exit(0)
_finish(_code)
