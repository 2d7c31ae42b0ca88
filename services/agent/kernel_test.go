package agent

import (
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// requireHostPython fails in CI and skips elsewhere when Debian's
// /usr/bin/python3 lacks a module the test needs (.ci/run installs
// python3-ipykernel and python3-matplotlib).
func requireHostPython(t testing.TB, modules ...string) {
	t.Helper()
	for _, m := range modules {
		if err := exec.Command("/usr/bin/python3", "-c", "import "+m).Run(); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("/usr/bin/python3 cannot import %s (required in CI: .ci/run installs it): %v", m, err)
			}
			t.Skipf("/usr/bin/python3 cannot import %s: %v", m, err)
		}
	}
}

// notebookAgent is an agent that runs Debian's python3 (the one with
// ipykernel's IPython), without a zygote.
func notebookAgent(t testing.TB) *testAgent {
	requireHostPython(t, "IPython", "matplotlib_inline")
	env := BaseEnv(func(k string) string {
		if k == "PATH" {
			return "/usr/bin:/bin"
		}
		return ""
	})
	return startAgent(t, Options{Language: LangPython, NoZygote: true, Env: env})
}

func cellReq(code string) Request {
	return Request{Language: LangPython, Code: code, TimeoutMS: 30_000, Mode: ModeNotebook}
}

func TestNotebookKeepsStateAndShowsResults(t *testing.T) {
	ta := notebookAgent(t)
	r := ta.run(t, cellReq("x = 42"))
	if r.Error != "" || r.ExitCode != 0 || r.Kernel == nil || !r.Kernel.Started || r.Kernel.Lost != "" || r.Kernel.ExecutionCount != 1 {
		t.Fatalf("first cell: %+v %+v", r, r.Kernel)
	}
	r = ta.run(t, cellReq("print(x)\nx + 1"))
	if string(r.Stdout) != "42\n" || r.Kernel.Started || r.Kernel.ExecutionCount != 2 || len(r.Displays) != 1 ||
		r.Displays[0].Kind != DisplayResult || r.Displays[0].Data["text/plain"] != "43" {
		t.Fatalf("second cell: %+v %+v", r, r.Kernel)
	}
	r = ta.run(t, cellReq("def f():\n    raise ValueError('boom')\nf()"))
	if r.ExitCode != 1 || r.Exception == nil || r.Exception.Name != "ValueError" || r.Exception.Value != "boom" ||
		!strings.Contains(string(r.Stderr), "ValueError: boom") || strings.Contains(string(r.Stderr), "\x1b[") {
		t.Fatalf("error cell: %+v %+v stderr %q", r, r.Exception, r.Stderr)
	}
}

func TestNotebookTimeoutKillsKernelAndNextCellSaysStateLost(t *testing.T) {
	ta := notebookAgent(t)
	ta.run(t, cellReq("x = 1"))
	req := cellReq("print('before', flush=True)\nimport time\nwhile True: time.sleep(0.01)")
	req.TimeoutMS = 1500
	r := ta.run(t, req)
	if !r.TimedOut || r.ExitCode != -1 || r.Kernel == nil || r.Kernel.Ended == "" || string(r.Stdout) != "before\n" {
		t.Fatalf("timed-out cell: %+v %+v", r, r.Kernel)
	}
	r = ta.run(t, cellReq("'x' in globals()"))
	if r.Kernel == nil || !r.Kernel.Started || !strings.Contains(r.Kernel.Lost, "timed out") ||
		len(r.Displays) != 1 || r.Displays[0].Data["text/plain"] != "False" {
		t.Fatalf("after the timeout: %+v %+v", r, r.Kernel)
	}
}

func TestNotebookKernelKilledBetweenCellsIsReported(t *testing.T) {
	ta := notebookAgent(t)
	r := ta.run(t, cellReq("import os\nos.getpid()"))
	pid := r.Displays[0].Data["text/plain"]
	// A fresh run of the same session kills it.
	r = ta.run(t, Request{Language: LangPython, Code: "import os, signal\nos.kill(" + pid + ", signal.SIGKILL)", TimeoutMS: 10_000})
	if r.ExitCode != 0 {
		t.Fatalf("kill run: %+v", r)
	}
	r = ta.run(t, cellReq("1"))
	if r.Kernel == nil || !r.Kernel.Started || r.Kernel.Lost != "the kernel was killed by SIGKILL" {
		t.Fatalf("after the kill: %+v %+v", r, r.Kernel)
	}
}

func TestNotebookSweepSparesKernelOnly(t *testing.T) {
	ta := notebookAgent(t)
	r := ta.run(t, cellReq("import subprocess\np = subprocess.Popen(['sleep', '1000'])\np.pid"))
	child := r.Displays[0].Data["text/plain"]
	// Fresh runs and cells alike are followed by the sweep: the kernel
	// lives on, the sleep it started does not.
	ta.run(t, Request{Language: LangPython, Code: "print(1)", TimeoutMS: 10_000})
	r = ta.run(t, cellReq("import os\nprint(p.poll(), os.path.exists('/proc/"+child+"'))"))
	if r.Kernel.Started || strings.TrimSpace(string(r.Stdout)) != "-9 False" {
		t.Fatalf("after the sweep: %+v %+v %q", r, r.Kernel, r.Stderr)
	}
}

func TestNotebookRichDisplays(t *testing.T) {
	ta := notebookAgent(t)
	code := `
import base64
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
class Pic:
    def _repr_png_(self): return PNG
class Table:
    def _repr_html_(self): return "<table><tr><td>1</td></tr></table>"
    def __repr__(self): return "Table(1)"
from IPython.display import display, clear_output
print("gone")
display("gone too")
clear_output()
display(Pic())
Table()
`
	r := ta.run(t, cellReq(code))
	if r.ExitCode != 0 || len(r.Stdout) != 0 || len(r.Displays) != 2 {
		t.Fatalf("displays: %+v", r)
	}
	if d := r.Displays[0]; d.Kind != DisplayData || d.Data["image/png"] == "" {
		t.Fatalf("png display: %+v", d)
	}
	if d := r.Displays[1]; d.Kind != DisplayResult || d.Data["text/html"] != "<table><tr><td>1</td></tr></table>" || d.Data["text/plain"] != "Table(1)" {
		t.Fatalf("html result: %+v", d)
	}
}

func TestNotebookMatplotlibShowAndOpenFigures(t *testing.T) {
	ta := notebookAgent(t)
	requireHostPython(t, "matplotlib")
	r := ta.run(t, cellReq("import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()\nplt.figure(); plt.plot([2, 1])"))
	var pngs int
	for _, d := range r.Displays {
		if d.Data["image/png"] != "" {
			pngs++
		}
	}
	if r.ExitCode != 0 || pngs != 2 {
		t.Fatalf("figures: %d PNGs in %+v (stderr %q)", pngs, r.Displays, r.Stderr)
	}
}

func TestFreshRunFiguresComeBack(t *testing.T) {
	requireHostPython(t, "matplotlib")
	for _, zyg := range []bool{false, true} {
		env := BaseEnv(func(k string) string {
			if k == "PATH" {
				return "/usr/bin:/bin"
			}
			return ""
		})
		ta := startAgent(t, Options{Language: LangPython, NoZygote: !zyg, Env: env})
		if zyg {
			ta.zygotePID(t)
		}
		for _, code := range []string{
			"import matplotlib.pyplot as plt\nplt.plot([1, 2]); plt.show()\nplt.figure(); plt.plot([2, 1])",
			// A backend the code picks itself still leaves figures open at exit.
			"import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.figure(); plt.plot([2, 1])",
		} {
			r := ta.run(t, py(code))
			if r.ExitCode != 0 || r.Zygote != zyg {
				t.Fatalf("zygote %v: %+v", zyg, r)
			}
			if zyg || !strings.Contains(code, "Agg") {
				if len(r.Displays) != 2 || r.Displays[0].Data["image/png"] == "" || r.Displays[1].Data["text/plain"] != "<Figure 2>" {
					t.Fatalf("zygote %v, %q: displays %+v, stderr %q", zyg, code, r.Displays, r.Stderr)
				}
			}
		}
	}
}

// Between runs the kernel is stopped, so threads a cell started do not run
// while no call is in progress; a run that resumes it is undone.
func TestNotebookKernelIsStoppedBetweenRuns(t *testing.T) {
	ta := notebookAgent(t)
	r := ta.run(t, cellReq("import os, threading, time\nticks = 0\ndef tick():\n    global ticks\n    while True:\n        ticks += 1\n        time.sleep(0.001)\nthreading.Thread(target=tick, daemon=True).start()\nos.getpid()"))
	pid := r.Displays[0].Data["text/plain"]
	state := "print(open('/proc/" + pid + "/stat').read().rsplit(')', 1)[1].split()[0])"
	if r := ta.run(t, py(state)); strings.TrimSpace(string(r.Stdout)) != "T" {
		t.Fatalf("kernel state between runs: %+v", r)
	}
	r = ta.run(t, py("import os, signal\nos.kill("+pid+", signal.SIGCONT)\n"+state))
	if strings.TrimSpace(string(r.Stdout)) == "T" {
		t.Fatalf("SIGCONT did not resume the kernel: %q", r.Stdout)
	}
	if r := ta.run(t, py(state)); strings.TrimSpace(string(r.Stdout)) != "T" {
		t.Fatalf("kernel not stopped again after a run resumed it: %+v", r)
	}
	// The next cell runs (thawed), with its state and its thread.
	r = ta.run(t, cellReq("a = ticks; time.sleep(0.05); ticks > a"))
	if r.Kernel.Started || r.Displays[0].Data["text/plain"] != "True" {
		t.Fatalf("cell after the freeze: %+v %+v", r, r.Displays)
	}
}

// TestNotebookCellOutputsAndKernelSocket: a cell's output is what it
// wrote, from Python and from its subprocesses alike, within the cap
// (the rest marked truncated); input() is refused as in Jupyter; a cell
// that closes the kernel's socket ends the kernel, and the next cell says
// why.
func TestNotebookCellOutputsAndKernelSocket(t *testing.T) {
	ta := notebookAgent(t)
	r := ta.run(t, cellReq("import os, sys\nprint('py')\nos.system('echo sub; echo err >&2')\nprint('py-err', file=sys.stderr)\n!echo bang"))
	// `!` commands run in a pty, as under ipykernel: their lines end in \r\n.
	if r.ExitCode != 0 || string(r.Stdout) != "py\nsub\nbang\r\n" || string(r.Stderr) != "err\npy-err\n" {
		t.Fatalf("outputs: %+v stdout %q stderr %q", r, r.Stdout, r.Stderr)
	}
	req := cellReq("print('x' * 100000)")
	req.MaxOutputBytes = 1000
	if r = ta.run(t, req); len(r.Stdout) != 1000 || !r.Truncated {
		t.Fatalf("capped output: %d bytes, truncated %v", len(r.Stdout), r.Truncated)
	}
	if r = ta.run(t, cellReq("input()")); r.Exception == nil || r.Exception.Name != "StdinNotImplementedError" {
		t.Fatalf("input(): %+v %+v", r, r.Exception)
	}
	// Without its socket the kernel cannot answer: it exits.
	r = ta.run(t, cellReq("import os\nos.close(3)"))
	if r.Kernel == nil || r.Kernel.Ended == "" || r.ExitCode != -1 {
		t.Fatalf("socket closed: %+v %+v", r, r.Kernel)
	}
	ended := r.Kernel.Ended
	r = ta.run(t, cellReq("'os' in globals()"))
	if r.Kernel == nil || !r.Kernel.Started || r.Kernel.Lost != ended || r.Displays[0].Data["text/plain"] != "False" {
		t.Fatalf("after the socket closed: %+v %+v", r, r.Kernel)
	}
}

// BenchmarkNotebookCell is a warm cell through the agent alone (socket,
// kernel, sweep, freeze): what notebook mode adds below the broker.
func BenchmarkNotebookCell(b *testing.B) {
	ta := notebookAgent(b)
	ta.run(b, cellReq("1"))
	for b.Loop() {
		if r := ta.run(b, cellReq("print(1)")); string(r.Stdout) != "1\n" || r.Kernel.Started {
			b.Fatalf("%+v", r)
		}
	}
}

// TestChildDyingBeforeItsWaiterNotices: a child killed, or already a
// zombie, counts as dying although nobody has collected it yet; a live
// one, running or stopped, does not.
func TestChildDyingBeforeItsWaiterNotices(t *testing.T) {
	for _, stopped := range []bool{false, true} {
		cmd := exec.Command("sleep", "1000")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		c := &child{pid: cmd.Process.Pid, done: make(chan struct{})} // no waiter yet
		if stopped {
			if err := syscall.Kill(c.pid, syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
		}
		if c.dying("/proc") {
			t.Fatalf("stopped=%v: a live child is dying", stopped)
		}
		if err := syscall.Kill(c.pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		// Pending or already a zombie: either way, dying at once.
		if !c.dying("/proc") {
			t.Fatalf("stopped=%v: a killed child is not dying", stopped)
		}
		_ = cmd.Wait()
		if !c.dying("/proc") {
			t.Fatalf("stopped=%v: a collected child is not dying", stopped)
		}
	}
}
