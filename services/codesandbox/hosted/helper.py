# sandbox-broker's helper in a CodeSandbox VM.
#
# The broker writes this file into the VM (fs/writeFile) and starts it in a
# terminal shell (shell/create) as
#
#   python3 HELPER run SPEC      one run_code run; the result goes to a file
#   python3 HELPER job SPEC      one job, streamed as frames on the terminal
#   python3 HELPER scan SPEC     the workspace's files with their SHA-256
#                                (when the broker must reconcile it)
#
# SPEC is a JSON file the broker wrote just before; the helper deletes it.
# A terminal mangles bytes (CRLF, escapes, echo) and merges stdout with
# stderr, so the program's output never goes to it: a run's output is
# captured through pipes, capped, and written with the run's outcome to
# SPEC["result"] (atomically: a result that exists is whole), which the
# broker reads with fs/readFile. That file is also how the broker learns a
# run's outcome after its connection dropped, instead of running it twice.
# A job's output goes to the terminal as base64 frames, one per line:
#
#   SBX1 S <b64 json {"pid"}>          started
#   SBX1 O <b64 bytes> / SBX1 E ...    stdout / stderr
#   SBX1 X <b64 json result>           ended (after its result file is written)
#
# A run or scan ends by sending its result the same way (SBX1 R), which
# spares the broker a read of the file.
#
# and the broker types control lines into the terminal (shell/in), which
# the helper puts in raw mode first: "D <b64>" stdin data, "C" close stdin,
# "K <signo>" signal the job's process group.
#
# Each result lists the workspace files the command created, changed or
# deleted (by size, mtime and inode, from a walk before and after that
# never follows a symlink), so the broker copies back only those. Nothing
# here is trusted: the VM is the user's, and the broker checks every path,
# size and field it reads.
import binascii
import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

HELPER = os.path.abspath(__file__)
MAX_DEPTH = 64
CHUNK = 32 << 10
KILL_GRACE = 2.0

try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:
    _libc = None


def die_with_parent():
    # PR_SET_PDEATHSIG: the command dies when the helper does (its
    # terminal terminated), so no run outlives the broker's view of it.
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL, 0, 0, 0)


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def which(name, path):
    """shutil.which without importing shutil (the helper starts often)."""
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    for d in (path or os.defpath).split(os.pathsep):
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def valid_name(rel):
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# The VM's own configuration (tasks.json, the template's setup) in the
# workspace is not the session's data: never listed, so never synced.
VM_CONFIG = ".codesandbox"


def manifest(ws, cap):
    """Regular files under ws: rel -> [size, mtime_ns, ino]; other entries."""
    files, other, seen, truncated = {}, set(), 0, False
    stack = [("", 0)]
    while stack and not truncated:
        rel, depth = stack.pop()
        try:
            it = os.scandir(os.path.join(ws, rel) if rel else ws)
        except OSError:
            continue
        with it:
            for e in it:
                seen += 1
                if seen > cap:
                    truncated = True
                    break
                p = e.name if not rel else rel + "/" + e.name
                if p == VM_CONFIG:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if depth + 1 < MAX_DEPTH:
                        stack.append((p, depth + 1))
                elif stat.S_ISREG(st.st_mode) and valid_name(p):
                    files[p] = [st.st_size, st.st_mtime_ns, st.st_ino]
                elif valid_name(p):
                    other.add(p)
    return files, other, truncated


def diff(before, after):
    b_files, b_other, _ = before
    a_files, a_other, truncated = after
    changed = [{"path": p, "size": s[0], "mtime_ns": s[1]} for p, s in sorted(a_files.items()) if b_files.get(p) != s]
    deleted = sorted(p for p in b_files if p not in a_files and p not in a_other) if not truncated else []
    skipped = sorted(p for p in a_other if p not in b_other)
    return {"changed": changed, "deleted": deleted, "skipped": skipped, "manifest_truncated": truncated}


def write_result(path, res, announce=False):
    data = json.dumps(res)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.replace(tmp, path)
    if announce:
        Frames().send("R", data.encode())


CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000


def isolate():
    """In the command's process, before exec: a network namespace of its
    own, holding only loopback (up). Without the privilege to make one, a
    user namespace of its own first (same uid inside)."""
    if _libc is None:
        raise OSError(errno.ENOSYS, "no libc")
    if _libc.unshare(CLONE_NEWNET) != 0:
        uid, gid = os.getuid(), os.getgid()
        if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "unshare: " + os.strerror(e))
        # Keep the uid inside; unmapped (overflow uid) is no less isolated,
        # and is what a uid 0 without capabilities gets.
        for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
            try:
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
            except OSError:
                pass
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # SIOCSIFFLAGS, IFF_UP
    finally:
        s.close()


def data_aliases(ws):
    # run_code documents /mnt/data (and /data) as the workspace.
    for alias in ("/mnt/data", "/data"):
        try:
            if os.path.realpath(alias) != os.path.realpath(ws):
                os.makedirs(os.path.dirname(alias), exist_ok=True)
                os.symlink(ws, alias)
        except OSError:
            pass


def spawn(spec, argv, stdin):
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    env.setdefault("LANG", "C.UTF-8")
    env.setdefault("MPLBACKEND", "Agg")  # no display in a VM
    if which(argv[0], env.get("PATH")) is None:
        raise RuntimeError("%s is not installed in the VM (the runner template must provide it)" % argv[0])
    deny = spec.get("network") != "allow"

    def child():
        die_with_parent()
        if deny:
            isolate()

    try:
        return subprocess.Popen(argv, cwd=spec["cwd"], env=env, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=child)
    except subprocess.SubprocessError:
        # preexec_fn failed: only isolate() can.
        raise RuntimeError("this VM cannot take the network away from a command (no network or user namespace); "
                           "the operator must use a template where it works, or allow the VM's network")


def killpg(pid, sig=signal.SIGKILL):
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


def outcome(rc):
    if rc is None:
        return -1, ""
    if rc < 0:
        try:
            return -1, signal.Signals(-rc).name
        except ValueError:
            return -1, "SIG%d" % -rc
    return rc, ""


def wait(proc, timeout_s):
    """Waits for the command; kills its process group at the deadline."""
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        killpg(proc.pid)
        try:
            proc.wait(timeout=KILL_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    killpg(proc.pid)  # what it left behind in its group goes too
    return timed_out


def on_hangup(proc_ref):
    def handler(signum, frame):
        if proc_ref:
            killpg(proc_ref[0].pid)
        os._exit(129)
    for s in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(s, handler)


def run(spec):
    res = {"v": 1, "id": spec["id"]}
    limit = int(spec["max_output"])
    cap = int(spec["max_entries"])
    ws = spec["workspace"]
    data_aliases(ws)
    proc_ref = []
    on_hangup(proc_ref)
    code_dir = os.path.join(os.path.dirname(HELPER), "run-" + spec["id"])
    os.makedirs(code_dir, mode=0o700, exist_ok=True)
    code_path = os.path.join(code_dir, spec["code_name"])
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(spec["code"])
    before = manifest(ws, cap)
    start = time.monotonic()
    try:
        proc = spawn(spec, list(spec["argv"]) + [code_path], subprocess.DEVNULL)
    except (OSError, RuntimeError) as e:
        res["error"] = str(e)[:300]
        write_result(spec["result"], res, announce=True)
        return
    proc_ref.append(proc)
    captured = {}

    def drain(name, pipe):
        out, truncated = bytearray(), False
        while True:
            b = pipe.read1(CHUNK) if hasattr(pipe, "read1") else os.read(pipe.fileno(), CHUNK)
            if not b:
                break
            keep = max(0, min(len(b), limit - len(out)))
            out += b[:keep]
            truncated = truncated or keep < len(b)
        captured[name] = (bytes(out), truncated)

    threads = [threading.Thread(target=drain, args=(n, p), daemon=True) for n, p in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for t in threads:
        t.start()
    timed_out = wait(proc, int(spec["timeout_ms"]) / 1000.0)
    duration = time.monotonic() - start
    for t in threads:
        t.join(KILL_GRACE)
    res["exit_code"], res["signal"] = outcome(proc.returncode)
    res["timed_out"] = timed_out
    res["duration_ms"] = int(duration * 1000)
    out, t1 = captured.get("stdout", (b"", True))
    err, t2 = captured.get("stderr", (b"", True))
    res["stdout"], res["stderr"], res["truncated"] = b64(out), b64(err), t1 or t2
    res.update(diff(before, manifest(ws, cap)))
    try:
        os.unlink(code_path)
        os.rmdir(code_dir)
    except OSError:
        pass
    write_result(spec["result"], res, announce=True)


def scan(spec):
    """Every regular file with its hash (files over max_hash_bytes without)."""
    import hashlib
    files, other, truncated = manifest(spec["workspace"], int(spec["max_entries"]))
    limit = int(spec["max_hash_bytes"])
    out = []
    for p, st in sorted(files.items()):
        entry = {"path": p, "size": st[0], "mtime_ns": st[1]}
        if st[0] <= limit:
            h = hashlib.sha256()
            try:
                fd = os.open(os.path.join(spec["workspace"], p), os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                entry["sha256"] = h.hexdigest()
            except OSError:
                continue
        out.append(entry)
    write_result(spec["result"], {"v": 1, "id": spec["id"], "changed": out, "skipped": sorted(other),
                                  "manifest_truncated": truncated}, announce=True)


class Frames:
    def __init__(self):
        self.lock = threading.Lock()

    def send(self, kind, data):
        line = ("SBX1 %s %s\n" % (kind, b64(data))).encode("ascii")
        with self.lock:
            view = memoryview(line)
            while view:
                try:
                    n = os.write(1, view)
                except InterruptedError:
                    continue
                view = view[n:]


def job(spec):
    cap = int(spec["max_entries"])
    ws = spec["workspace"]
    data_aliases(ws)
    frames = Frames()
    if os.isatty(0):
        import tty
        tty.setraw(0)  # no echo, no line editing, no signals from input
    proc_ref = []
    on_hangup(proc_ref)
    before = manifest(ws, cap)
    start = time.monotonic()
    res = {"v": 1, "id": spec["id"]}
    interactive = bool(spec.get("interactive"))
    try:
        proc = spawn(spec, list(spec["argv"]), subprocess.PIPE if interactive else subprocess.DEVNULL)
    except (OSError, RuntimeError) as e:
        res["error"] = str(e)[:300]
        write_result(spec["result"], res)
        frames.send("X", json.dumps(res).encode())
        return
    proc_ref.append(proc)
    frames.send("S", json.dumps({"pid": proc.pid}).encode())

    def pump(kind, pipe):
        while True:
            b = pipe.read1(CHUNK) if hasattr(pipe, "read1") else os.read(pipe.fileno(), CHUNK)
            if not b:
                return
            frames.send(kind, b)

    pumps = [threading.Thread(target=pump, args=(k, p), daemon=True) for k, p in (("O", proc.stdout), ("E", proc.stderr))]
    for t in pumps:
        t.start()
    stdin_q, stdin_cv = [], threading.Condition()

    def feed():
        # Writes stdin apart from the control reader, so a job that does
        # not read its stdin cannot keep a signal from being delivered.
        while True:
            with stdin_cv:
                while not stdin_q:
                    stdin_cv.wait()
                item = stdin_q.pop(0)
            try:
                if item is None:
                    proc.stdin.close()
                    return
                proc.stdin.write(item)
                proc.stdin.flush()
            except (OSError, ValueError):
                return

    def control():
        buf = b""
        while True:
            try:
                b = os.read(0, 65536)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                return
            if not b:
                return
            buf += b.replace(b"\r", b"\n")
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                parts = line.strip().split(b" ")
                if parts[0] == b"D" and len(parts) == 2 and interactive:
                    try:
                        data = binascii.a2b_base64(parts[1])
                    except (binascii.Error, ValueError):
                        continue
                    with stdin_cv:
                        stdin_q.append(data)
                        stdin_cv.notify()
                elif parts[0] == b"C" and interactive:
                    with stdin_cv:
                        stdin_q.append(None)
                        stdin_cv.notify()
                elif parts[0] == b"K" and len(parts) == 2 and parts[1].isdigit():
                    killpg(proc.pid, int(parts[1]))

    if interactive:
        threading.Thread(target=feed, daemon=True).start()
    threading.Thread(target=control, daemon=True).start()
    timed_out = wait(proc, int(spec["timeout_ms"]) / 1000.0)
    duration = time.monotonic() - start
    for t in pumps:
        t.join(KILL_GRACE)
    res["exit_code"], res["signal"] = outcome(proc.returncode)
    res["timed_out"] = timed_out
    res["duration_ms"] = int(duration * 1000)
    res.update(diff(before, manifest(ws, cap)))
    write_result(spec["result"], res)
    frames.send("X", json.dumps(res).encode())


def main():
    modes = {"run": run, "job": job, "scan": scan}
    if len(sys.argv) != 3 or sys.argv[1] not in modes:
        sys.stderr.write("usage: helper.py run|job|scan SPEC\n")
        sys.exit(2)
    with open(sys.argv[2], encoding="utf-8") as f:
        spec = json.load(f)
    os.unlink(sys.argv[2])
    modes[sys.argv[1]](spec)


if __name__ == "__main__":
    main()
