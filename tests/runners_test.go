package tests

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// prebuiltRunners is where `make runners` left the runner file systems
// for the process backend: $SANDBOX_TEST_RUNNERS_DIR, else the
// repository's data/runners (SANDBOX_ROOT=./data's default). CI builds
// them (.ci/run); elsewhere the tests that need them are skipped.
func prebuiltRunners(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("SANDBOX_TEST_RUNNERS_DIR")
	if dir == "" {
		dir = filepath.Join("..", "data", "runners")
	}
	out, err := exec.Command(brokerBin, "runners", "verify", "--dir", dir).CombinedOutput()
	if err == nil && strings.Count(string(out), "OK: ") < 3 {
		err = os.ErrNotExist
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but the runner file systems are missing or invalid in %s (runners/rootfs.sh builds them): %v\n%s", dir, err, out)
		}
		t.Skipf("no runner file systems in %s (run make runners): %s", dir, out)
	}
	return dir
}

// rootfsRoot is a fresh SANDBOX_ROOT holding the prebuilt runners at
// runners/, the broker's default SANDBOX_RUNNERS_DIR, as hard links:
// inside the root, so its overlay hides their host path from sandboxes.
func rootfsRoot(t testing.TB) string {
	t.Helper()
	src := prebuiltRunners(t)
	root := brokerRoot(t)
	if err := copyRunners(src, filepath.Join(root, "runners")); err != nil {
		t.Fatal(err)
	}
	return root
}

// requireRootfsRunners fails unless every language of b runs on a runner
// file system (not on the host's interpreters).
func requireRootfsRunners(t *testing.T, b *Broker) {
	t.Helper()
	l := listRunners(t, b.Client(t, testToken))
	for _, r := range l.Runners {
		if !strings.HasPrefix(r.Source, "rootfs sha256:") {
			t.Fatalf("%s runs on %q, not on a runner file system", r.Language, r.Source)
		}
	}
	if len(l.Runners) != 3 {
		t.Fatalf("runners: %+v", l)
	}
}

type runnerList struct {
	Backend string `json:"backend"`
	Runners []struct {
		Language string `json:"language"`
		Image    string `json:"image"`
		Source   string `json:"source"`
	} `json:"runners"`
}

func listRunners(t *testing.T, c *client.Client) runnerList {
	t.Helper()
	var l runnerList
	resultJSON(t, callTool(t, c, "list_runners", nil), &l)
	return l
}

// runnerProbes print what code sees of its runner: versions, the
// environment, the layout. Nothing in them differs by backend except
// through a difference in the runner itself. (Docker adds /.dockerenv to
// every container: the one known difference, left out.)
var runnerProbes = []struct{ lang, code string }{
	{"python", `import os, sys, platform, locale, shutil
import pandas, numpy, scipy, matplotlib, seaborn, openpyxl, reportlab, sympy
print(pandas.__version__, sys.version)
print(numpy.__version__, scipy.__version__, matplotlib.__version__, seaborn.__version__, openpyxl.__version__, reportlab.Version, sympy.__version__)
print(matplotlib.get_backend(), matplotlib.matplotlib_fname(), platform.libc_ver(), locale.getpreferredencoding())
print(os.getcwd(), sorted(os.environ.items()))
print(open('/etc/os-release').read().splitlines()[0], open('/etc/debian_version').read().strip())
print([shutil.which(x) for x in ('python3', 'bash', 'node', 'tsx', 'jq')], sorted(n for n in os.listdir('/') if n[0] != '.'))`},
	{"typescript", `import { execFileSync } from 'child_process';
import { readdirSync } from 'fs';
const v: string = process.version;
console.log(v, process.cwd(), JSON.stringify(Object.entries(process.env).sort()));
console.log(execFileSync('tsc', ['--version']).toString().trim(), execFileSync('tsx', ['--version']).toString().trim().split('\n').join(' '));
console.log(readdirSync('/').filter(n => n[0] !== '.').sort().join(' '));`},
	{"bash", `bash --version | head -1; jq --version; pwd; env | sort; cat /etc/debian_version /proc/sys/kernel/hostname
command -v python3 node tsx || true; ls / | tr '\n' ' '`},
}

var runDir = regexp.MustCompile(`/tmp/run-[0-9]+-[0-9]+`)

// TestRunnersSameOnBothBackends: the process backend on the runner file
// systems lists the languages and images the Docker backend lists, from
// the images Docker has now, and every probe prints the same on both (the
// pandas and Python versions line first among them).
func TestRunnersSameOnBothBackends(t *testing.T) {
	docker, proc := startBackend(t, "docker", BrokerOpts{}), startBackend(t, "process_rootfs", BrokerOpts{})
	dc, pc := docker.Client(t, testToken), proc.Client(t, testToken)

	dl, pl := listRunners(t, dc), listRunners(t, pc)
	if dl.Backend != "docker" || pl.Backend != "process" || len(dl.Runners) != 3 || len(pl.Runners) != len(dl.Runners) {
		t.Fatalf("list_runners:\ndocker  %+v\nprocess %+v", dl, pl)
	}
	imageID := func(ref string) string {
		id, err := exec.Command("docker", "image", "inspect", "-f", "{{.Id}}", ref).Output()
		if err != nil {
			t.Fatalf("docker image inspect %s: %v", ref, err)
		}
		return strings.TrimSpace(string(id))
	}
	for i, d := range dl.Runners {
		// The same image (Docker may name it by another of its tags),
		// exported as it is now.
		p := pl.Runners[i]
		id := imageID(d.Image)
		if p.Language != d.Language || imageID(p.Image) != id {
			t.Errorf("runner %d: docker %s=%s, process %s=%s", i, d.Language, d.Image, p.Language, p.Image)
		}
		if want := "rootfs " + id[:19]; p.Source != want {
			t.Errorf("%s: process source %q, want %q (the rootfs is stale: make runners)", p.Language, p.Source, want)
		}
	}

	sessions := map[*client.Client]map[string]string{dc: {}, pc: {}}
	for _, p := range runnerProbes {
		out := map[*client.Client]string{}
		for _, c := range []*client.Client{dc, pc} {
			args := map[string]any{"language": p.lang, "code": p.code}
			if id := sessions[c][p.lang]; id != "" {
				args["session_id"] = id
			}
			r, _ := run(t, c, args)
			sessions[c][p.lang] = r.SessionID
			if !r.Success {
				t.Fatalf("%s probe failed: exit %d\n%s\n%s", p.lang, r.ExitCode, r.Stdout, r.Stderr)
			}
			// Each run's directory is numbered by the agent's count of runs.
			out[c] = runDir.ReplaceAllString(r.Stdout+r.Stderr, "/tmp/run-N")
		}
		if out[dc] != out[pc] {
			t.Errorf("%s probe differs:\ndocker:\n%s\nprocess:\n%s", p.lang, out[dc], out[pc])
		} else {
			t.Logf("%s probe, both backends:\n%s", p.lang, out[dc])
		}
	}
}

// TestRunnersEndToEnd: a pandas and matplotlib chart, TypeScript with a
// type error (tsc's diagnostic, and a TypeError at run time) and a Bash
// pipeline give the same results on Docker and on the process backend's
// runner file systems, through MCP.
func TestRunnersEndToEnd(t *testing.T) {
	for _, backend := range []string{"docker", "process_rootfs"} {
		t.Run(backend, func(t *testing.T) {
			c := startBackend(t, backend, BrokerOpts{}).Client(t, testToken)

			r, res := run(t, c, map[string]any{"language": "python", "code": `import pandas as pd, matplotlib.pyplot as plt
df = pd.DataFrame({"x": range(10), "y": [v * v for v in range(10)]})
df.plot(x="x", y="y"); plt.savefig("chart.png")
print(df.y.sum(), df.y.describe()["max"])`})
			if !r.Success || r.Stdout != "285 81.0\n" || len(r.Files) != 1 || r.Files[0].Name != "chart.png" || r.Files[0].MIME != "image/png" {
				t.Fatalf("pandas chart: %+v", r)
			}
			image := false
			for _, ct := range res.Content {
				if im, ok := ct.(mcp.ImageContent); ok && im.MIMEType == "image/png" && len(im.Data) > 1000 {
					image = true
				}
			}
			if !image {
				t.Error("the chart did not come back as an image")
			}

			r, _ = run(t, c, map[string]any{"session_id": r.SessionID, "language": "typescript", "code": `import { spawnSync } from 'child_process';
import { writeFileSync } from 'fs';
writeFileSync('/tmp/bad.ts', 'const n: number = "one";\n');
const tsc = spawnSync('tsc', ['--noEmit', '/tmp/bad.ts'], { encoding: 'utf8' });
console.log(tsc.status, tsc.stdout.trim());
const o: any = undefined;
console.log(o.field);`})
			if r.Success || r.ExitCode != 1 ||
				r.Stdout != "2 ../../tmp/bad.ts(1,7): error TS2322: Type 'string' is not assignable to type 'number'.\n" ||
				!strings.Contains(r.Stderr, "TypeError: Cannot read properties of undefined (reading 'field')") {
				t.Fatalf("typescript type errors: %+v", r)
			}

			r, _ = run(t, c, map[string]any{"session_id": r.SessionID, "language": "bash", "code": `printf '%s\n' 3 1 2 | sort -n | paste -sd+ | bc
echo '{"files":["chart.png"]}' | jq -r '.files[]' | xargs file -b --mime-type`})
			if !r.Success || r.Stdout != "6\nimage/png\n" {
				t.Fatalf("bash: %+v", r)
			}
		})
	}
}

// copyRunners copies the runners in src to dst: as hard links when both
// are on one filesystem, else in full.
func copyRunners(src, dst string) error {
	if exec.Command("cp", "-a", "-l", src, dst).Run() == nil {
		return nil
	}
	_ = os.RemoveAll(dst)
	if out, err := exec.Command("cp", "-a", src, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("copy the runners: %v: %s", err, out)
	}
	return nil
}
