# sandbox-broker agent: the Python zygote's children. The agent appends
# this file to zygote.py (one script, see there for the protocol): an idle
# spare prepares itself, takes one job and runs it as `python3 main.py`
# would, and reports its exit status; once, a probe child shows the
# zygote which pages a run writes. The script ends here, starting the
# zygote.


# Signal masks as raw sigset_t bytes through libc: the signal module turns
# every set to and from Signals members, which costs a run a tenth of a
# millisecond. None where ctypes is missing (the signal module then).
_SIGSET_BYTES = 128  # glibc's sigset_t
_SIG_BLOCK, _SIG_SETMASK = 0, 2


def _block_signals():
    """Blocks every signal; returns the mask to restore (_restore_signals)."""
    c = _c()
    if c:
        import ctypes

        old = ctypes.create_string_buffer(_SIGSET_BYTES)
        if c.pthread_sigmask(_SIG_BLOCK, b"\xff" * _SIGSET_BYTES, old) == 0:
            return old
    import signal

    return signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())


def _restore_signals(mask):
    if isinstance(mask, set):
        import signal

        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    else:
        _libc.pthread_sigmask(_SIG_SETMASK, mask, None)


def _only_sigcont_pending(mask):
    """Whether no signal but SIGCONT is pending (with mask from
    _block_signals)."""
    import signal

    if isinstance(mask, set):
        return not signal.sigpending() - {signal.SIGCONT}
    import ctypes

    pending = ctypes.create_string_buffer(_SIGSET_BYTES)
    if _libc.sigpending(pending) != 0:
        return False
    bits = int.from_bytes(pending.raw, "little")
    return bits & ~(1 << (signal.SIGCONT - 1)) == 0


def _spare(chan, zygote_pid, mask):
    """Runs in a forked spare, born with every signal blocked (mask is the
    zygote's own, to restore for the run): prepares itself, waits for one
    job on chan, then runs it. Returns the SystemExit argument. Exits
    without running anything when the job never comes, the spare was
    tampered with while idle, or the zygote died first."""
    import signal

    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
    if os.getppid() != zygote_pid:
        os._exit(0)
    _idle()
    _populate()
    try:
        msg, fds, _flags, _addr = socket.recv_fds(chan, 65536, 8)
    except OSError:
        os._exit(0)
    job = _take(msg, fds, mask)
    if job is None:
        os._exit(0)  # not taken: the agent hands the job to another spare
    # A dying zygote's spares are killed (PR_SET_PDEATHSIG) when it is
    # nearly gone, well after its SIGKILL: stop that first, then check that
    # it is still the parent. Killed before the check, the spare has not
    # taken the job; past it, the run outlives the zygote.
    _prctl(1, 0)
    if os.getppid() != zygote_pid:
        os._exit(0)
    try:
        os.setsid()  # taken (see above)
    except OSError:
        os._exit(0)  # must not stay in the agent's session
    global _status_chan
    _status_chan = chan
    _dumpable(1)
    return _run(job, mask)


def _idle():
    """Installs what a fresh `python3 main.py` has, off the critical path
    (every signal blocked)."""
    import signal

    signal.set_wakeup_fd(-1)
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _prepare()


def _take(msg, fds, mask):
    """The job in msg with its stdio fds, or None when it is malformed or
    the spare was tampered with since the fork: a signal pending, or
    limits other than the zygote's at its start (the spare was born with
    those and every signal blocked, so no window is left open)."""
    try:
        req = json.loads(msg)
        job = (req["path"], req["cwd"], req.get("env") or {}, fds)
    except Exception:
        return None
    # The agent's SIGCONT (it wakes a stopped spare) is expected.
    if len(fds) != 3 or not _only_sigcont_pending(mask) or _limits() != _limits_at_start:
        return None
    return job


def _run(job, mask):
    """Runs the job as `python3 path` would; returns the exit status or
    SystemExit argument."""
    path, cwd, env, fds = job
    for i, fd in enumerate(fds[:3]):
        if fd != i:
            os.dup2(fd, i)
    for fd in fds:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass
    _restore_signals(mask)
    try:
        os.chdir(cwd)
    except OSError as e:
        print("sandbox agent: chdir %s: %s" % (cwd, e), file=sys.stderr)
        return 1
    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)
    _user_site()
    _use_env(env)
    try:
        _run_main(path)
    except SystemExit as e:
        return e.code
    except BaseException as e:
        tb = e.__traceback__
        t = tb
        while t is not None and t.tb_frame.f_code.co_filename != path:
            t = t.tb_next
        # As the interpreter reports an uncaught exception: through
        # sys.excepthook, from the script's own frames (none for a syntax
        # error, which then shows without a traceback).
        sys.excepthook(type(e), e.with_traceback(t), t)
        return 1
    return 0


def _run_main(path):
    """Runs the script at path as `python3 path` does."""
    with open(path, "rb") as f:
        source = f.read()
    _exec_main(source, path)


def _exec_main(source, path):
    """Runs source as the script at path: compiled on its own (no future
    flags of this file), in a new __main__ module with the attributes the
    interpreter gives one."""
    import builtins
    import types
    from importlib.machinery import SourceFileLoader

    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __loader__=SourceFileLoader("__main__", path),
        __annotations__={},
        __builtins__=builtins,
        __file__=path,
        __cached__=None,
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


# The dry run of an idle spare: a script that prints, run like a job's.
_DRY_RUN = b"print(0)\n"


def _prepare():
    """The start of every run, done by an idle spare ahead of its job.
    Reseeding: the zygote seeded the global RNGs once, and runs must not
    share random sequences (each spare runs one job). Then a dry run of
    what a job goes through (its message decoded, the environment set, a
    script run as __main__ with output to the zygote's stdout, /dev/null),
    so that the pages it writes are copied from the zygote now and not in
    the run (a fork's copy-on-write faults cost most of a short run; see
    also _populate)."""
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
    json.loads(b'{"path": "", "cwd": "", "env": {"MPLBACKEND": "", "PYTHONPATH": ""}}')
    os.environ["SANDBOX_SPARE"] = ""
    del os.environ["SANDBOX_SPARE"]
    if _user_site_path:
        os.path.isdir(_user_site_path)
    saved = sys.modules.get("__main__")
    try:
        with open(os.devnull, "rb") as f:
            f.read()
        _exec_main(_DRY_RUN, "<dry run>")
        sys.stdout.flush()
    except BaseException:
        pass
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _user_site():
    if not _user_site_path:
        return
    try:
        if os.path.isdir(_user_site_path):
            import site

            site.addsitedir(_user_site_path)
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
    backend = env.get("MPLBACKEND")
    mpl = sys.modules.get("matplotlib")
    if mpl is None or backend == _figures_backend:
        return
    try:
        # Not the backend the zygote set (a run without the figure
        # module): what a fresh interpreter would choose.
        mpl.rcParams["backend"] = backend or _preload_backend
    except Exception:
        pass


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


def _finish(code):
    """Leave the child like the interpreter's shutdown would, but without a
    full Py_Finalize: its garbage collection touches every object inherited
    from the zygote, copying all those pages (tens of milliseconds)."""
    status = _exit_steps(code)
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


def _exit_steps(code):
    """The interpreter's exit steps; returns the exit status."""
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
    return status


# Copy-on-write. A run writes a few hundred pages it shares with the
# zygote (reference counts, caches, buffers): each first write copies the
# page in a fault, a few microseconds apiece, most of a short run. The
# zygote learns once which pages those are (_learn) and each idle spare
# copies them ahead with MADV_POPULATE_WRITE (_populate), which leaves
# their contents as they are. To learn them, a probe child goes through
# a run of print(0) as a spare would; every page it writes stops being
# shared, so the zygote's own pagemap then shows it as mapped by the
# zygote alone (bit 56). The zygote opens its pagemap before it makes
# itself non-dumpable (which would deny it the file); no other process
# is ever dumpable for this. Where the kernel or the sandbox has neither,
# nothing changes.
_MADV_POPULATE_WRITE = 23
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MAX_HOT_PAGES = 4096  # a bound on what each spare copies (16 MiB)
_hot = ()  # (start, length) ranges


def _writable_ranges():
    """The private writable mappings of this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 2 and fields[1][:2] == "rw" and fields[1][3] == "p":
                lo, hi = fields[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def _own_pages(pagemap, ranges):
    """The pages in ranges that are present and mapped by this process
    alone (pagemap bits 63 and 56), at most _MAX_HOT_PAGES, as merged
    (start, length) ranges (one madvise each)."""
    import struct

    out, n = [], 0
    for lo, hi in ranges:
        data = os.pread(pagemap, (hi - lo) // _PAGE * 8, lo // _PAGE * 8)
        for i, (e,) in enumerate(struct.iter_unpack("<Q", data)):
            if not (e >> 63 & 1 and e >> 56 & 1):
                continue
            if n == _MAX_HOT_PAGES:
                return out
            n += 1
            addr = lo + i * _PAGE
            if out and out[-1][0] + out[-1][1] == addr:
                out[-1] = (out[-1][0], out[-1][1] + _PAGE)
            else:
                out.append((addr, _PAGE))
    return out


def _probe(done):
    """In a child of the zygote (in the agent's session, as idle spares
    are): a spare's way through a run of print(0), output to /dev/null;
    then says so on done and waits to be killed, its pages still its own."""
    path = "/tmp/.sandbox-probe-%d.py" % os.getpid()
    try:
        null = os.open(os.devnull, os.O_RDWR)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, _DRY_RUN)
        os.close(fd)
        mask = _block_signals()
        _idle()
        msg = json.dumps({"path": path, "cwd": "/", "env": {"MPLBACKEND": _figures_backend or "", "PYTHONPATH": "/nonexistent"}})
        job = _take(msg.encode(), [null, null, null], mask)
        if job is not None:
            _exit_steps(_run(job, mask))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    os.write(done, b"d")
    while True:
        os.pause() if hasattr(os, "pause") else __import__("time").sleep(60)


def _learn(pagemap, timeout_s=10):
    """Learns the pages a run writes (see above) into _hot."""
    global _hot
    import select

    ranges = _writable_ranges()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.close(pagemap)
            os.close(CTRL_FD)
            _probe(w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        poller = select.poll()
        poller.register(r, select.POLLIN)
        if poller.poll(timeout_s * 1000) and os.read(r, 1) == b"d":
            _hot = tuple(_own_pages(pagemap, ranges))
    finally:
        os.close(r)
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def _populate():
    """Copies the pages runs write ahead (see above)."""
    c = _c()
    if not c or not _hot:
        return
    import ctypes

    madvise = c.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for start, length in _hot:
        # ENOMEM (no longer mapped) skips a range; EINVAL (no such advice)
        # ends it all.
        if madvise(start, length, _MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == 22:
            return


_serve()
os._exit(0)
