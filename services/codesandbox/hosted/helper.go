package hosted

import (
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
)

// helperSource runs in the VM (see its header for the protocol).
//
//go:embed helper.py
var helperSource []byte

// stateDir holds, in the VM, the helper and the specs and results of runs
// and jobs. It is outside the workspace, so none of it is synced.
const stateDir = "/tmp/.sandbox-broker"

// helperPath names the helper by its content, so a VM never runs an older
// broker's helper.
var helperPath = func() string {
	sum := sha256.Sum256(helperSource)
	return stateDir + "/helper-" + hex.EncodeToString(sum[:6]) + ".py"
}()

func specPath(id string) string   { return stateDir + "/spec-" + id + ".json" }
func resultPath(id string) string { return stateDir + "/result-" + id + ".json" }

// helperCommand is what the terminal runs: fixed paths and a hex ID, no
// caller-supplied text (that travels in the spec file).
// The interpreter runs isolated from the VM's environment and without
// site packages (-I -S): the helper needs only the standard library, and
// starts several times faster.
func helperCommand(mode, id string) string {
	return "exec python3 -I -S " + helperPath + " " + mode + " " + specPath(id)
}

// language is how the VM runs one run_code language.
type language struct {
	argv []string
	file string
}

// languages are the runner template's interpreters; the template must
// provide them (README: "Hosted sessions").
var languages = map[string]language{
	agent.LangPython:     {[]string{"python3"}, "main.py"},
	agent.LangTypeScript: {[]string{"tsx"}, "main.ts"},
	agent.LangJavaScript: {[]string{"node"}, "main.js"},
	agent.LangBash:       {[]string{"bash"}, "main.sh"},
}

// spec is what the helper reads from its spec file.
type spec struct {
	ID          string            `json:"id"`
	Workspace   string            `json:"workspace"`
	Cwd         string            `json:"cwd"`
	Argv        []string          `json:"argv"`
	Code        string            `json:"code,omitempty"`
	CodeName    string            `json:"code_name,omitempty"`
	Env         map[string]string `json:"env,omitempty"`
	TimeoutMS   int64             `json:"timeout_ms"`
	MaxOutput   int               `json:"max_output,omitempty"`
	Interactive bool              `json:"interactive,omitempty"`
	Network     string            `json:"network,omitempty"`
	MaxEntries  int               `json:"max_entries"`
	MaxHash     int64             `json:"max_hash_bytes,omitempty"`
	Result      string            `json:"result"`
}

// changedFile is one workspace file a command created or changed (or,
// from a scan, any file, with its SHA-256 when not too big).
type changedFile struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	MtimeNS int64  `json:"mtime_ns"`
	SHA256  string `json:"sha256,omitempty"`
}

// result is the helper's report, from an untrusted VM: decoded strictly,
// bounded, and checked again where it is used.
type result struct {
	V          int    `json:"v"`
	ID         string `json:"id"`
	Error      string `json:"error"`
	ExitCode   int    `json:"exit_code"`
	Signal     string `json:"signal"`
	TimedOut   bool   `json:"timed_out"`
	DurationMS int64  `json:"duration_ms"`
	Stdout     []byte `json:"stdout"`
	Stderr     []byte `json:"stderr"`
	Truncated  bool   `json:"truncated"`
	fileChanges
}

// fileChanges is what a command did to the workspace.
type fileChanges struct {
	Changed           []changedFile `json:"changed"`
	Deleted           []string      `json:"deleted"`
	Skipped           []string      `json:"skipped"`
	ManifestTruncated bool          `json:"manifest_truncated"`
}

var signalRe = regexp.MustCompile(`^SIG[A-Z0-9+-]{1,12}$`)

// maxResultBytes bounds a result file: two streams at MaxOutputLimit in
// base64, and the file lists.
const maxResultBytes = 16 << 20

// decodeResult checks a result file for run or job id.
func decodeResult(b []byte, id string, maxOutput, maxEntries int) (*result, error) {
	if len(b) > maxResultBytes {
		return nil, fmt.Errorf("result of %d bytes", len(b))
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var r result
	if err := dec.Decode(&r); err != nil {
		return nil, fmt.Errorf("decode result: %w", err)
	}
	switch {
	case r.V != 1 || r.ID != id:
		return nil, fmt.Errorf("result for another run")
	case r.Signal != "" && !signalRe.MatchString(r.Signal):
		return nil, fmt.Errorf("bad signal name")
	case len(r.Changed) > maxEntries || len(r.Deleted) > maxEntries || len(r.Skipped) > maxEntries:
		return nil, fmt.Errorf("more file changes than the workspace may hold")
	}
	if maxOutput > 0 {
		r.Truncated = r.Truncated || len(r.Stdout) > maxOutput || len(r.Stderr) > maxOutput
		r.Stdout, r.Stderr = clip(r.Stdout, maxOutput), clip(r.Stderr, maxOutput)
	}
	r.Error = cleanMessage(r.Error)
	if r.DurationMS < 0 {
		r.DurationMS = 0
	}
	return &r, nil
}

func clip(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}

// cleanMessage keeps a VM-supplied message short and printable.
func cleanMessage(s string) string {
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, strings.ToValidUTF8(s, "?"))
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return s
}

// Frames of a job on its terminal (helper.py's header).
const (
	frameStarted = 'S'
	frameStdout  = 'O'
	frameStderr  = 'E'
	frameExit    = 'X'
	frameResult  = 'R' // a run's or scan's result, as it ends
	framePrefix  = "SBX1 "
	// maxFrameLine bounds one terminal line: the largest frame is an
	// exit's file lists.
	maxFrameLine = 8 << 20
)

// frameReader splits terminal output into lines and decodes the frames
// in them; other lines (the shell's own noise) are ignored.
type frameReader struct {
	buf     []byte
	discard bool // inside a line too long to be a frame
}

// feed adds a chunk and calls fn for every complete frame.
func (r *frameReader) feed(chunk string, fn func(kind byte, data []byte)) {
	r.buf = append(r.buf, chunk...)
	for {
		i := bytes.IndexByte(r.buf, '\n')
		if i < 0 {
			if len(r.buf) > maxFrameLine {
				r.buf, r.discard = r.buf[:0], true
			}
			return
		}
		line := r.buf[:i]
		r.buf = r.buf[i+1:]
		if r.discard {
			r.discard = false
			continue
		}
		line = codesandbox.CleanOutput(bytes.TrimRight(line, "\r"))
		j := bytes.Index(line, []byte(framePrefix))
		if j < 0 || len(line) < j+len(framePrefix)+2 || line[j+len(framePrefix)+1] != ' ' {
			continue
		}
		kind := line[j+len(framePrefix)]
		data, err := base64.StdEncoding.DecodeString(string(line[j+len(framePrefix)+2:]))
		if err != nil {
			continue
		}
		fn(kind, data)
	}
}
