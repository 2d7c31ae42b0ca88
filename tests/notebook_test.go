package tests

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// cellResult is run_code's result with the notebook fields.
type cellResult struct {
	runResult
	Result   string `json:"result"`
	Displays []struct {
		Kind      string   `json:"kind"`
		MIMETypes []string `json:"mime_types"`
		Text      string   `json:"text"`
	} `json:"displays"`
	Exception *struct {
		Name  string `json:"name"`
		Value string `json:"value"`
	} `json:"exception"`
	Kernel *struct {
		ExecutionCount int    `json:"execution_count"`
		New            bool   `json:"new"`
		StateLost      bool   `json:"state_lost"`
		Ended          bool   `json:"ended"`
		Note           string `json:"note"`
	} `json:"kernel"`
}

// cell runs code in the session's notebook kernel ("" starts a session).
func cell(t *testing.T, c *client.Client, session, code string, extra map[string]any) (cellResult, *mcp.CallToolResult) {
	t.Helper()
	args := map[string]any{"language": "python", "mode": "notebook", "code": code}
	if session != "" {
		args["session_id"] = session
	}
	for k, v := range extra {
		args[k] = v
	}
	res := callTool(t, c, "run_code", args)
	if res.IsError {
		t.Fatalf("run_code %q: %+v", code, res.Content)
	}
	var r cellResult
	resultJSON(t, res, &r)
	if r.Kernel == nil {
		t.Fatalf("notebook result without kernel status: %+v", r)
	}
	return r, res
}

// images returns the PNG images among a result's contents.
func images(t *testing.T, res *mcp.CallToolResult) [][]byte {
	t.Helper()
	var out [][]byte
	for _, c := range res.Content {
		if img, ok := c.(mcp.ImageContent); ok && img.MIMEType == "image/png" {
			b, err := base64.StdEncoding.DecodeString(img.Data)
			if err != nil || !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) {
				t.Fatalf("image content is no PNG: %v", err)
			}
			out = append(out, b)
		}
	}
	return out
}

// requireHostPlotting fails in CI and skips elsewhere when the host's
// Python, which the process backend runs, lacks the notebook stack.
func requireHostPlotting(t *testing.T, backend string) {
	t.Helper()
	if backend != "process" {
		return
	}
	for _, m := range []string{"ipykernel", "matplotlib"} {
		if _, err := os.Stat("/usr/lib/python3/dist-packages/" + m); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("host python3 lacks %s (required in CI: .ci/run installs python3-ipykernel and python3-matplotlib)", m)
			}
			t.Skipf("host python3 lacks %s", m)
		}
	}
}

func TestNotebookModeKeepsStateAndShowsOutputs(t *testing.T) {
	backendsAndGVisor(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		requireHostPlotting(t, backend)
		r, _ := cell(t, c, "", "x = 42", nil)
		s := r.SessionID
		if !r.Success || !r.Kernel.New || r.Kernel.StateLost || r.Kernel.ExecutionCount != 1 || r.Result != "" {
			t.Fatalf("first cell: %+v %+v", r, r.Kernel)
		}
		r, _ = cell(t, c, s, "print(x)", nil)
		if strings.TrimSpace(r.Stdout) != "42" || r.Kernel.New || r.Kernel.ExecutionCount != 2 {
			t.Fatalf("state did not persist: %+v %+v", r, r.Kernel)
		}
		// The last expression is displayed, as in Jupyter.
		r, _ = cell(t, c, s, "1 + 1", nil)
		if r.Result != "2" || len(r.Displays) != 1 || r.Displays[0].Kind != "result" {
			t.Fatalf("last expression: %+v", r)
		}
		// A fresh run in the same session has none of the kernel's state,
		// and does not disturb it.
		fr, _ := run(t, c, map[string]any{"session_id": s, "language": "python", "code": "print('x' in dir())"})
		if strings.TrimSpace(fr.Stdout) != "False" {
			t.Fatalf("fresh run saw kernel state: %+v", fr)
		}
		// Between calls the kernel is stopped: nothing of the session runs.
		fr, _ = run(t, c, map[string]any{"session_id": s, "language": "python", "code": `import os
for p in filter(str.isdigit, os.listdir('/proc')):
    if b'sandbox-kernel-' in open(f'/proc/{p}/cmdline', 'rb').read():
        print(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0])`})
		if strings.TrimSpace(fr.Stdout) != "T" {
			t.Fatalf("kernel state between calls: %+v", fr)
		}
		r, _ = cell(t, c, s, "x", nil)
		if r.Result != "42" || r.Kernel.New {
			t.Fatalf("kernel after a fresh run: %+v %+v", r, r.Kernel)
		}

		// plt.show() and figures left open come back as PNG images.
		r, res := cell(t, c, s, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]); plt.show()\nplt.figure(); plt.bar([1, 2], [3, 4])", nil)
		if n := len(images(t, res)); n != 2 || !r.Success {
			t.Fatalf("figures: %d images, %+v", n, r)
		}

		// Rich display: _repr_png_ inline, _repr_html_ as inert,
		// sanitized text/html resource content.
		r, res = cell(t, c, s, `
import base64
class Pic:
    def _repr_png_(self):
        return base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
class Table:
    def _repr_html_(self):
        return '<table onclick="steal()"><tr><td>cell-1</td></tr></table><script>steal()</script><img src="https://example.com/x?d=1">'
    def __repr__(self):
        return 'Table(1)'
display(Pic())
Table()`, nil)
		if n := len(images(t, res)); n != 1 || r.Result != "Table(1)" {
			t.Fatalf("rich display: %d images, %+v", n, r)
		}
		var html string
		for _, ct := range res.Content {
			if er, ok := ct.(mcp.EmbeddedResource); ok {
				if tr, ok := er.Resource.(mcp.TextResourceContents); ok && tr.MIMEType == "text/html" {
					html = tr.Text
					if !strings.HasPrefix(tr.URI, "sandbox-display://"+s+"/") {
						t.Fatalf("display URI %q", tr.URI)
					}
				}
			}
		}
		if !strings.Contains(html, "<td>cell-1</td>") || strings.Contains(html, "script") || strings.Contains(html, "onclick") || strings.Contains(html, "example.com") {
			t.Fatalf("html display: %q", html)
		}

		// Exceptions come back as clean tracebacks.
		r, _ = cell(t, c, s, "def f():\n    return 1 / 0\nf()", nil)
		if r.Success || r.ExitCode != 1 || r.Exception == nil || r.Exception.Name != "ZeroDivisionError" ||
			!strings.Contains(r.Stderr, "ZeroDivisionError: division by zero") || !strings.Contains(r.Stderr, "----> 2     return 1 / 0") ||
			strings.Contains(r.Stderr, "\x1b") {
			t.Fatalf("traceback: %+v %+v", r, r.Exception)
		}
		// The kernel survives its exceptions.
		if r, _ = cell(t, c, s, "x", nil); r.Result != "42" {
			t.Fatalf("after the exception: %+v", r)
		}

		// Bad modes are refused clearly.
		mustToolError(t, callTool(t, c, "run_code", map[string]any{"session_id": s, "language": "python", "mode": "repl", "code": "1"}), "INVALID_INPUT")
		e := mustToolError(t, callTool(t, c, "run_code", map[string]any{"session_id": s, "language": "bash", "mode": "notebook", "code": "ls"}), "INVALID_INPUT")
		if !strings.Contains(e.Message, "python only") {
			t.Fatalf("bash notebook refusal: %q", e.Message)
		}
	})
}

func TestNotebookTimeoutAndOOMKillKernelAndNextCallSaysStateLost(t *testing.T) {
	backendsAndGVisor(t, map[string]string{"SANDBOX_MEMORY_MB": "384"}, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		requireHostPlotting(t, backend)
		r, _ := cell(t, c, "", "x = 1", nil)
		s := r.SessionID
		start := time.Now()
		r, _ = cell(t, c, s, "print('started', flush=True)\nwhile True: pass", map[string]any{"timeout_s": 2})
		if !r.TimedOut || r.Success || !r.Kernel.Ended || !strings.Contains(r.Kernel.Note, "timed out") ||
			!strings.Contains(r.Stdout, "started") || time.Since(start) > 30*time.Second {
			t.Fatalf("timed-out cell: %+v %+v after %v", r, r.Kernel, time.Since(start))
		}
		r, _ = cell(t, c, s, "'x' in globals()", nil)
		if r.Result != "False" || !r.Kernel.New || !r.Kernel.StateLost || !strings.Contains(r.Kernel.Note, "timed out") {
			t.Fatalf("after the timeout: %+v %+v", r, r.Kernel)
		}

		cell(t, c, s, "y = 2", nil)
		r, _ = cell(t, c, s, "b = bytearray(2 << 30)\nprint('allocated')", nil)
		if !r.OOMKilled || r.Success || !r.Kernel.Ended || strings.Contains(r.Stdout, "allocated") || !strings.Contains(r.Kernel.Note, "out of memory") {
			t.Fatalf("memory bomb: %+v %+v", r, r.Kernel)
		}
		r, _ = cell(t, c, s, "'y' in globals()", nil)
		if r.Result != "False" || !r.Kernel.New || !r.Kernel.StateLost || !strings.Contains(r.Kernel.Note, "out of memory") {
			t.Fatalf("after the OOM kill: %+v %+v", r, r.Kernel)
		}
	})
}

// kernelRunning reports whether some host process has the kernel's ID in
// its command line (its last argument).
func kernelRunning(t *testing.T, id string) bool {
	t.Helper()
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && bytes.Contains(b, []byte(id)) {
			return true
		}
	}
	return false
}

func TestCloseSessionKillsKernel(t *testing.T) {
	backendsAndGVisor(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		requireHostPlotting(t, backend)
		r, _ := cell(t, c, "", "import sys\nsys.argv[-1]", nil)
		id := strings.Trim(r.Result, "'")
		// Under gVisor the sandbox's processes are not host processes:
		// there the kernel lives exactly as long as its sandbox.
		running := func() bool { return kernelRunning(t, id) }
		if backend == "docker-runsc" {
			running = func() bool { return len(containersLabelled(t, "sandbox.root="+b.Root)) > 0 }
		}
		if !strings.HasPrefix(id, "sandbox-kernel-") || !running() {
			t.Fatalf("kernel %q not found running", id)
		}
		if res := callTool(t, c, "close_session", map[string]any{"session_id": r.SessionID}); res.IsError {
			t.Fatalf("close_session: %+v", res.Content)
		}
		deadline := time.Now().Add(20 * time.Second)
		for running() {
			if time.Now().After(deadline) {
				t.Fatal("the kernel outlived close_session")
			}
			time.Sleep(50 * time.Millisecond)
		}
	})
}

func TestFreshRunFiguresComeBackAsImages(t *testing.T) {
	backendsAndGVisor(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		requireHostPlotting(t, backend)
		r, res := run(t, c, map[string]any{"language": "python",
			"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()\nplt.figure(); plt.plot([2, 1])\nprint('done')"})
		if n := len(images(t, res)); n != 2 || !r.Success || len(r.Files) != 0 {
			t.Fatalf("fresh figures: %d images, %+v", n, r)
		}
	})
}

func TestNotebookKernelGoesWithIdleSandboxAndNextCallSaysSo(t *testing.T) {
	backendsAndGVisor(t, map[string]string{"SANDBOX_IDLE_TIMEOUT_MS": "1000"}, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		requireHostPlotting(t, backend)
		r, _ := cell(t, c, "", "x = 1", nil)
		deadline := time.Now().Add(30 * time.Second)
		for !strings.Contains(b.Logs(), "session_idle_released") {
			if time.Now().After(deadline) {
				t.Fatal("the idle session was not released")
			}
			time.Sleep(50 * time.Millisecond)
		}
		r, _ = cell(t, c, r.SessionID, "'x' in globals()", nil)
		if r.Result != "False" || !r.Kernel.New || !r.Kernel.StateLost || !strings.Contains(r.Kernel.Note, "idle") {
			t.Fatalf("after the idle release: %+v %+v", r, r.Kernel)
		}
	})
}

func TestNotebookCallsInOneSessionAreSerialized(t *testing.T) {
	backendsAndGVisor(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		requireHostPlotting(t, backend)
		r, _ := cell(t, c, "", "import time\nspans = []", nil)
		errs := make(chan error, 3)
		for range 3 {
			go func() { // no t.Fatal off the test goroutine
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				var req mcp.CallToolRequest
				req.Params.Name = "run_code"
				req.Params.Arguments = map[string]any{"session_id": r.SessionID, "language": "python", "mode": "notebook",
					"code": "t0 = time.monotonic(); time.sleep(0.3); spans.append((t0, time.monotonic()))"}
				res, err := c.CallTool(ctx, req)
				if err == nil && res.IsError {
					err = fmt.Errorf("run_code: %+v", res.Content)
				}
				errs <- err
			}()
		}
		for range 3 {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		r, _ = cell(t, c, r.SessionID, "s = sorted(spans); len(s) == 3 and all(a[1] <= b[0] for a, b in zip(s, s[1:]))", nil)
		if r.Result != "True" {
			t.Fatalf("cells overlapped or went missing: %+v", r)
		}
	})
}

// A cell's child whose leader thread exits while another thread runs on
// looks like a zombie to the agent's sweep; the broker's host-side check
// must still find it, in the kernel's session as in any other.
func TestNotebookZombieLeaderThreadsDoNotSurvive(t *testing.T) {
	backendsAndGVisor(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		requireHostPlotting(t, backend)
		for i, setsid := range []string{"", "os.setsid()", "", "os.setsid()"} {
			session := ""
			if i >= 2 { // a clean cell first: the next cell's check starts from its
				r, _ := cell(t, c, "", "1", nil)
				session = r.SessionID
			}
			r, _ := cell(t, c, session, `
import ctypes, os, threading, time
libc = ctypes.CDLL(None)
if os.fork() == 0:
    `+setsid+`
    libc.prctl(15, b"zombieleader", 0, 0, 0)  # PR_SET_NAME, inherited by new threads
    threading.Thread(target=lambda: time.sleep(1000)).start()
    libc.pthread_exit(None)
time.sleep(0.3)
print("spawned")`, nil)
			if strings.TrimSpace(r.Stdout) != "spawned" {
				t.Fatalf("spawn: %+v", r)
			}
			r2, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "python", "code": zombieLeaderProbe})
			if strings.TrimSpace(r2.Stdout) != "0" {
				t.Fatalf("%q (session %q): threads of a zombie leader survived the cell: %+v", setsid, session, r2)
			}
		}
	})
}
