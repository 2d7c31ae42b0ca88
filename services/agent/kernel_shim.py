# sandbox-broker agent: the notebook kernel's client.
#
# Started by the agent as `python3 -c <this file> CONNECTION_FILE
# READY_TIMEOUT_S` beside the ipykernel it started with that connection file. It drives the kernel
# with jupyter_client's BlockingKernelClient (the Jupyter messaging
# protocol, over ipc sockets in a private directory) and speaks JSON lines
# with the agent on stdin/stdout:
#
#   shim  -> agent  {"t": "ready"} | {"t": "fatal", "error": "..."}
#   agent -> shim   {"code": "..."}
#   shim  -> agent  the cell's outputs as they come, one per line:
#                   {"t": "stream", "name": "stdout"|"stderr", "text": "..."}
#                   {"t": "display", "kind": "result"|"display", "data": {mime: ...}}
#                   {"t": "error", "ename": "...", "evalue": "...", "traceback": "..."}
#                   {"t": "clear", "wait": bool}
#                   {"t": "dropped"}  (an output over MAX_ITEM)
#                   then {"t": "done", "status": "ok"|"error"|"aborted", "execution_count": N}
#
# The agent enforces every cap and deadline and kills the kernel and this
# process when a cell runs too long; nothing here is trusted by it.
import json
import sys

MAX_ITEM = 1 << 20  # one MIME value or stream chunk, in characters
CHUNK = 64 << 10
MIME_TYPES = ("text/plain", "text/html", "image/png", "image/jpeg")  # agent.DisplayMIMETypes

_out = sys.stdout
sys.stdout = sys.stderr  # only send() writes to the agent


def send(msg):
    _out.write(json.dumps(msg, separators=(",", ":")) + "\n")
    _out.flush()


def display(kind, content):
    data = {}
    for mime in MIME_TYPES:
        v = content.get("data", {}).get(mime)
        if isinstance(v, list):  # a multi-line string, as in a notebook file
            v = "".join(v)
        if not isinstance(v, str):
            continue
        if len(v) > MAX_ITEM:
            send({"t": "dropped"})
            continue
        data[mime] = v
    if data:
        send({"t": "display", "kind": kind, "data": data})


def output(msg):
    t = msg["msg_type"]
    c = msg["content"]
    if t == "stream":
        text = c.get("text", "")
        for i in range(0, len(text), CHUNK):
            send({"t": "stream", "name": c.get("name"), "text": text[i : i + CHUNK]})
    elif t == "execute_result":
        display("result", c)
    elif t in ("display_data", "update_display_data"):
        display("display", c)
    elif t == "error":
        tb = "\n".join(c.get("traceback") or [])
        send({"t": "error", "ename": c.get("ename", ""), "evalue": c.get("evalue", "")[:MAX_ITEM], "traceback": tb[:MAX_ITEM]})
    elif t == "clear_output":
        send({"t": "clear", "wait": bool(c.get("wait"))})


def run(kc, code):
    msg_id = kc.execute(code, silent=False, store_history=True, allow_stdin=False, stop_on_error=True)
    # Outputs end with the kernel's idle status for this request; the
    # reply carries the status and the execution count.
    while True:
        msg = kc.get_iopub_msg(timeout=None)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status":
            if msg["content"].get("execution_state") == "idle":
                break
            continue
        output(msg)
    while True:
        reply = kc.get_shell_msg(timeout=None)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    c = reply["content"]
    send({"t": "done", "status": c.get("status", "error"), "execution_count": c.get("execution_count") or 0})


def main():
    try:
        from jupyter_client.blocking import BlockingKernelClient

        kc = BlockingKernelClient(connection_file=sys.argv[1])
        kc.load_connection_file()
        kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
        kc.wait_for_ready(timeout=float(sys.argv[2]))
    except Exception as e:
        send({"t": "fatal", "error": "%s: %s" % (type(e).__name__, e)})
        return
    send({"t": "ready"})
    for line in sys.stdin:
        run(kc, json.loads(line)["code"])


main()
