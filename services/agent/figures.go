package agent

import (
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// figuresModule is the matplotlib backend of fresh Python runs (see
// figures.py). The agent writes it into every Python run's directory.
//
//go:embed figures.py
var figuresModule []byte

const (
	// figuresBackend selects figures.py as matplotlib's backend.
	figuresBackend = "module://sandbox_figures"
	// maxFigureBytes bounds one figure's PNG; larger ones are dropped.
	maxFigureBytes = 1 << 20
)

// prepareFigures installs the figure backend in a Python run's directory
// and returns the variables that select it. A subprocess that plots gets
// them too, and its figures come back as well.
func prepareFigures(dir string) (map[string]string, error) {
	lib := filepath.Join(dir, "lib")
	if err := os.Mkdir(lib, 0o700); err != nil {
		return nil, err
	}
	if err := os.Mkdir(filepath.Join(dir, "figures"), 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(lib, "sandbox_figures.py"), figuresModule, 0o600); err != nil {
		return nil, err
	}
	return map[string]string{"MPLBACKEND": figuresBackend, "PYTHONPATH": lib}, nil
}

// withEnv returns env with vars set, replacing earlier values.
func withEnv(env []string, vars map[string]string) []string {
	if len(vars) == 0 {
		return env
	}
	out := make([]string, 0, len(env)+len(vars))
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if _, ok := vars[k]; !ok {
			out = append(out, kv)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(vars)) {
		out = append(out, k+"="+vars[k])
	}
	return out
}

// collectFigures adds the PNGs a run left in its figures/ directory to d,
// in the order they were made. The run could have put anything there, so
// only regular files are read (workspace.ReadFile: no symlinks, FIFOs or
// devices), each at most maxFigureBytes and starting with the PNG magic.
func collectFigures(dir string, d *displays) {
	figDir := filepath.Join(dir, "figures")
	entries, err := os.ReadDir(figDir)
	if err != nil {
		return
	}
	n := 0
	for _, e := range entries { // sorted by name: fig-001.png, fig-002.png, …
		name := e.Name()
		if !strings.HasSuffix(name, ".png") || !e.Type().IsRegular() {
			continue
		}
		f, err := workspace.ReadFile(figDir, workspace.Limits{}, name, 0, maxFigureBytes)
		if err != nil || f.Size > maxFigureBytes || !isPNG(f.Data) {
			d.dropped++
			continue
		}
		n++
		d.add(Display{Kind: DisplayData, Data: map[string]string{
			"image/png":  base64.StdEncoding.EncodeToString(f.Data),
			"text/plain": fmt.Sprintf("<Figure %d>", n),
		}})
	}
}

func isPNG(b []byte) bool {
	return len(b) > 8 && string(b[:8]) == "\x89PNG\r\n\x1a\n"
}

// displays collects a response's Displays within MaxDisplays and
// MaxDisplayBytes, keeping only the DisplayMIMETypes.
type displays struct {
	list    []Display
	bytes   int
	dropped int
}

func (d *displays) add(x Display) {
	data := make(map[string]string, len(x.Data))
	for _, m := range DisplayMIMETypes {
		if v, ok := x.Data[m]; ok {
			data[m] = v
		}
	}
	if len(data) == 0 {
		d.dropped++
		return
	}
	x.Data = data
	b, err := json.Marshal(x)
	if err != nil || len(d.list) >= MaxDisplays || d.bytes+len(b) > MaxDisplayBytes {
		d.dropped++
		return
	}
	d.list = append(d.list, x)
	d.bytes += len(b)
}

func (d *displays) reset() { *d = displays{} }
