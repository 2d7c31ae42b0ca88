# sandbox-broker agent: the notebook kernel.
#
# Started by the agent as `python3 -c <this file> KERNEL_ID` in a session
# of its own, with the agent's end of a Unix stream socket on fd 3 and
# stdin on /dev/null. It runs cells in IPython's InteractiveShell, the
# shell inside ipykernel, configured as ipykernel configures it: so a
# cell behaves as in Jupyter (the last expression shown through the
# display hook, display() and the inline matplotlib backend through the
# display publisher, IPython's tracebacks, magics, `!` commands piped into
# the output, no history database, no input()). What it leaves out is
# ipykernel's ZeroMQ transport and event loop, which cost a cell several
# milliseconds; cells come and go as JSON lines on fd 3 instead:
#
#   kernel -> agent  {"t": "ready"} | {"t": "fatal", "error": "..."}
#   agent  -> kernel {"code": "...", "limit": N}
#   kernel -> agent  the cell's outputs as they come, one per line:
#                    {"t": "stream", "name": "stdout"|"stderr", "text": "..."}
#                    {"t": "truncated"}  (a stream passed limit bytes)
#                    {"t": "display", "kind": "result"|"display", "data": {mime: ...}}
#                    {"t": "error", "ename": "...", "evalue": "...", "traceback": "..."}
#                    {"t": "clear", "wait": bool}
#                    {"t": "dropped"}  (an output over MAX_ITEM)
#                    then {"t": "done", "status": "ok"|"error", "execution_count": N}
#
# Output written to fds 1 and 2 (print, subprocesses, C libraries) goes
# through pipes that a thread of the kernel reads and sends on as it
# comes, so what a cell printed before the agent killed it still arrives.
# The agent enforces every cap and deadline and kills the kernel when a
# cell runs too long; nothing here is trusted by it (the cell's code runs
# in this process and can write to fd 3 itself).
import json
import os
import socket
import sys
import threading

CTRL_FD = 3
MAX_ITEM = 1 << 20  # one MIME value or stream chunk, in characters
CHUNK = 64 << 10
MIME_TYPES = ("text/plain", "text/html", "image/png", "image/jpeg")  # agent.DisplayMIMETypes
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"

_ctrl = socket.socket(fileno=CTRL_FD)
_send_lock = threading.Lock()


def send(msg):
    line = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
    with _send_lock:
        _ctrl.sendall(line)


class Capture:
    """Points fds 1 and 2 at pipes and sends what arrives on them as
    stream messages, at most limit bytes of each stream a cell."""

    def __init__(self):
        import codecs
        import select

        self.pipes = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.pipes[r] = name
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in self.pipes.values()}
        self.left = {name: 0 for name in self.pipes.values()}
        self.truncated = False
        self.lock = threading.Lock()  # the counters above
        self.read_lock = threading.Lock()  # one reader at a time
        self.poller = select.poll()
        for r in self.pipes:
            self.poller.register(r, select.POLLIN)
        threading.Thread(target=self.loop, name="sandbox-output", daemon=True).start()

    def start_cell(self, limit):
        with self.lock:
            for name in self.left:
                self.left[name] = limit
            self.truncated = False

    def loop(self):
        while True:
            try:
                self.poller.poll()
                self.read_all()
            except OSError:
                pass

    def read_all(self):
        with self.read_lock:
            self._read_all()

    def _read_all(self):
        for r, name in self.pipes.items():
            while True:
                try:
                    data = os.read(r, CHUNK)
                except BlockingIOError:
                    break
                if not data:
                    break
                with self.lock:
                    keep = data[: self.left[name]]
                    self.left[name] -= len(keep)
                    cut = len(keep) < len(data) and not self.truncated
                    self.truncated = self.truncated or cut
                text = self.decoders[name].decode(keep)
                if text:
                    send({"t": "stream", "name": name, "text": text})
                if cut:
                    send({"t": "truncated"})

    def sync(self):
        """Returns once everything written to fds 1 and 2 so far is sent:
        the pipes are read to their end here, after the thread's read if
        one is under way."""
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        self.read_all()


def display(kind, data):
    out = {}
    for mime in MIME_TYPES:
        v = data.get(mime)
        if isinstance(v, list):  # a multi-line string, as in a notebook file
            v = "".join(v)
        if isinstance(v, bytes) and mime.startswith("image/"):
            import base64  # as ipykernel encodes images for the wire

            v = base64.b64encode(v).decode("ascii")
        if not isinstance(v, str):
            continue
        if len(v) > MAX_ITEM:
            send({"t": "dropped"})
            continue
        out[mime] = v
    if out:
        send({"t": "display", "kind": kind, "data": out})


def no_input(*_args, **_kwargs):
    from IPython.core.error import StdinNotImplementedError

    raise StdinNotImplementedError("raw_input was called, but this frontend does not support input requests.")


def make_shell(capture):
    """An InteractiveShell with ipykernel's settings and its outputs
    turned into messages, as ipykernel's ZMQ display hook, display
    publisher and traceback do."""
    import builtins
    import getpass

    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    class Hook(DisplayHook):
        def start_displayhook(self):
            self.data = {}

        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            self.data = format_dict

        def finish_displayhook(self):
            capture.sync()
            display("result", self.data)
            self.data = {}

    class Publisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            capture.sync()
            display("display", data)

        def clear_output(self, wait=False):
            capture.sync()
            send({"t": "clear", "wait": bool(wait)})

    class Shell(InteractiveShell):
        system = InteractiveShell.system_piped  # `!cmd` output joins the cell's

        def _showtraceback(self, etype, evalue, stb):
            capture.sync()
            send({"t": "error", "ename": str(etype.__name__), "evalue": str(evalue)[:MAX_ITEM], "traceback": "\n".join(stb)[:MAX_ITEM]})

    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "NoColor"
    shell = Shell.instance(config=config, displayhook_class=Hook, display_pub_class=Publisher)
    shell.display_formatter.active_types = shell.display_formatter.format_types
    builtins.input = no_input
    getpass.getpass = no_input
    return shell


def main():
    try:
        os.environ.setdefault("MPLBACKEND", INLINE_BACKEND)
        capture = Capture()
        for f in (sys.stdout, sys.stderr):
            f.reconfigure(line_buffering=True)
        shell = make_shell(capture)
    except Exception as e:
        send({"t": "fatal", "error": "%s: %s" % (type(e).__name__, e)})
        return
    send({"t": "ready"})
    for line in _ctrl.makefile("rb"):
        req = json.loads(line)
        capture.start_cell(int(req.get("limit") or 0))
        result = shell.run_cell(req["code"], store_history=True)
        capture.sync()
        send({"t": "done", "status": "ok" if result.success else "error", "execution_count": shell.execution_count - 1})


main()
