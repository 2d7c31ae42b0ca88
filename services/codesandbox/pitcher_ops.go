package codesandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// ShellSize is a terminal size.
type ShellSize struct {
	Cols int `msgpack:"cols"`
	Rows int `msgpack:"rows"`
}

// The SDK's terminal size for commands.
var defaultSize = ShellSize{Cols: 128, Rows: 24}

// Shell is ShellDTO (with buffer for OpenShellDTO).
type Shell struct {
	ShellID      string   `msgpack:"shellId"`
	Name         string   `msgpack:"name"`
	Status       string   `msgpack:"status"`
	ExitCode     *int     `msgpack:"exitCode"`
	ShellType    string   `msgpack:"shellType"`
	StartCommand string   `msgpack:"startCommand"`
	Buffer       []string `msgpack:"buffer"`
}

// Port is one open port the agent reports.
type Port struct {
	Port int    `msgpack:"port"`
	URL  string `msgpack:"url"`
}

// Task is TaskDTO (fields the broker reads).
type Task struct {
	ID         string `msgpack:"id"`
	Name       string `msgpack:"name"`
	Command    string `msgpack:"command"`
	RunAtStart bool   `msgpack:"runAtStart"`
	Preview    *struct {
		Port int `msgpack:"port"`
	} `msgpack:"preview"`
	Shell *Shell `msgpack:"shell"`
}

// FileStat is fs/stat's result.
type FileStat struct {
	Type      int   `msgpack:"type"` // 0 file, 1 directory
	IsSymlink bool  `msgpack:"isSymlink"`
	Size      int64 `msgpack:"size"`
}

// RunResult is a finished command.
type RunResult struct {
	Output    []byte // combined output, ANSI codes removed, tail-bounded
	ExitCode  int    // -1 when the shell was terminated
	Truncated bool   // the head of the output was dropped
}

// WriteFile writes content at path (relative paths resolve against the
// workspace), creating or overwriting the file.
func (p *Pitcher) WriteFile(ctx context.Context, path string, content []byte) error {
	if content == nil {
		content = []byte{}
	}
	return p.Call(ctx, "fs/writeFile", struct {
		Path      string `msgpack:"path"`
		Content   []byte `msgpack:"content"`
		Create    bool   `msgpack:"create"`
		Overwrite bool   `msgpack:"overwrite"`
	}{path, content, true, true}, nil)
}

// ReadFile returns a file's content.
func (p *Pitcher) ReadFile(ctx context.Context, path string) ([]byte, error) {
	var out struct {
		Content []byte `msgpack:"content"`
	}
	if err := p.Call(ctx, "fs/readFile", struct {
		Path string `msgpack:"path"`
	}{path}, &out); err != nil {
		return nil, err
	}
	return out.Content, nil
}

// Mkdir creates a directory.
func (p *Pitcher) Mkdir(ctx context.Context, path string, recursive bool) error {
	return p.Call(ctx, "fs/mkdir", struct {
		Path      string `msgpack:"path"`
		Recursive bool   `msgpack:"recursive"`
	}{path, recursive}, nil)
}

// Stat describes a path.
func (p *Pitcher) Stat(ctx context.Context, path string) (*FileStat, error) {
	var out FileStat
	err := p.Call(ctx, "fs/stat", struct {
		Path string `msgpack:"path"`
	}{path}, &out)
	return &out, err
}

// ListPorts lists the VM's open ports.
func (p *Pitcher) ListPorts(ctx context.Context) ([]Port, error) {
	var out struct {
		List []Port `msgpack:"list"`
	}
	err := p.Call(ctx, "port/list", struct{}{}, &out)
	return out.List, err
}

// ListTasks lists the VM's configured tasks (.codesandbox/tasks.json).
func (p *Pitcher) ListTasks(ctx context.Context) (map[string]Task, error) {
	var out struct {
		Tasks map[string]Task `msgpack:"tasks"`
	}
	err := p.Call(ctx, "task/list", struct{}{}, &out)
	return out.Tasks, err
}

// ListShells lists the VM's shells.
func (p *Pitcher) ListShells(ctx context.Context) ([]Shell, error) {
	var out struct {
		Shells []Shell `msgpack:"shells"`
	}
	err := p.Call(ctx, "shell/list", struct{}{}, &out)
	return out.Shells, err
}

// OpenShell returns a shell with its current output buffer.
func (p *Pitcher) OpenShell(ctx context.Context, shellID string) (*Shell, error) {
	var out Shell
	err := p.Call(ctx, "shell/open", struct {
		ShellID string    `msgpack:"shellId"`
		Size    ShellSize `msgpack:"size"`
	}{shellID, defaultSize}, &out)
	return &out, err
}

// Terminate kills a shell.
func (p *Pitcher) Terminate(ctx context.Context, shellID string) error {
	return p.Call(ctx, "shell/terminate", struct {
		ShellID string `msgpack:"shellId"`
	}{shellID}, nil)
}

// DirEntry is one fs/readdir entry (FSReadDirResult,
// pitcher-protocol/messages/fs.d.ts:137-143).
type DirEntry struct {
	Name      string `msgpack:"name"`
	Type      int    `msgpack:"type"` // 0 file, 1 directory
	IsSymlink bool   `msgpack:"isSymlink"`
}

// ReadDir lists a directory.
func (p *Pitcher) ReadDir(ctx context.Context, path string) ([]DirEntry, error) {
	var out struct {
		Entries []DirEntry `msgpack:"entries"`
	}
	err := p.Call(ctx, "fs/readdir", struct {
		Path string `msgpack:"path"`
	}{path}, &out)
	return out.Entries, err
}

// Remove deletes a file or, with recursive, a directory tree
// (FSRemoveParams, pitcher-protocol/messages/fs.d.ts:195-203).
func (p *Pitcher) Remove(ctx context.Context, path string, recursive bool) error {
	return p.Call(ctx, "fs/remove", struct {
		Path      string `msgpack:"path"`
		Recursive bool   `msgpack:"recursive"`
	}{path, recursive}, nil)
}

// ShellIn types input into a shell's terminal (ShellIn,
// pitcher-protocol/messages/shell.d.ts:52-59; its result is null).
func (p *Pitcher) ShellIn(ctx context.Context, shellID, input string) error {
	return p.Call(ctx, "shell/in", struct {
		ShellID string    `msgpack:"shellId"`
		Input   string    `msgpack:"input"`
		Size    ShellSize `msgpack:"size"`
	}{shellID, input, defaultSize}, nil)
}

// Run runs command with bash in cwd, as the SDK does (a system terminal
// shell), collecting shell/out until shell/exit. At most maxOutput bytes
// of the output's tail are kept. When ctx ends first the shell is
// terminated and the partial output comes back with the context's error.
func (p *Pitcher) Run(ctx context.Context, command, cwd string, maxOutput int) (*RunResult, error) {
	if maxOutput <= 0 {
		maxOutput = defaultMaxShellOutput
	}
	sr := newShellRun(maxOutput)
	shellID, err := p.startShell(ctx, command, cwd, sr)
	if err != nil {
		return nil, err
	}
	select {
	case <-sr.done:
		return sr.result()
	case <-p.done:
		res, _ := sr.result()
		return res, fmt.Errorf("%w: %w", ErrPitcherClosed, p.Err())
	case <-ctx.Done():
		p.dropShell(shellID)
		res := sr.partial()
		return res, p.ctxErr(ctx, "shell/create")
	}
}

// StreamedShell is a command started with Stream.
type StreamedShell struct {
	ID string
	p  *Pitcher
	sr *shellRun
}

// Done is closed when the command has exited or the connection ended.
func (s *StreamedShell) Done() <-chan struct{} { return s.sr.done }

// Exit is the exit code once Done is closed (-1 when terminated); the
// error is set when the connection ended first (ErrPitcherClosed).
func (s *StreamedShell) Exit() (int, error) {
	s.sr.mu.Lock()
	defer s.sr.mu.Unlock()
	return s.sr.exit, s.sr.err
}

// Terminate kills the shell and stops its output.
func (s *StreamedShell) Terminate(ctx context.Context) {
	s.p.mu.Lock()
	delete(s.p.shells, s.ID)
	s.p.mu.Unlock()
	if err := s.p.Terminate(ctx, s.ID); err != nil {
		s.p.log.Warn().Err(err).Msg("pitcher_terminate_failed")
	}
	s.sr.fail(errors.New("shell terminated"))
}

// Stream starts command like Run but hands every output chunk (the
// agent's "[CODESANDBOX]" lines left out) to out, from the connection's
// reader: out must return quickly. ctx bounds only the start.
func (p *Pitcher) Stream(ctx context.Context, command, cwd string, out func(chunk string)) (*StreamedShell, error) {
	sr := &shellRun{sink: out, done: make(chan struct{})}
	id, err := p.startShell(ctx, command, cwd, sr)
	if err != nil {
		return nil, err
	}
	return &StreamedShell{ID: id, p: p, sr: sr}, nil
}

// dropShell terminates a shell whose caller gave up on it.
func (p *Pitcher) dropShell(shellID string) {
	p.mu.Lock()
	delete(p.shells, shellID)
	p.mu.Unlock()
	tctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if err := p.Terminate(tctx, shellID); err != nil {
		p.log.Warn().Err(err).Msg("pitcher_terminate_failed")
	}
	cancel()
}

// startShell sends shell/create for `bash -c command` and registers sr for
// its output before any later message is read.
func (p *Pitcher) startShell(ctx context.Context, command, cwd string, sr *shellRun) (string, error) {
	var shellID string
	params := struct {
		Command       string    `msgpack:"command"`
		Cwd           string    `msgpack:"cwd,omitempty"`
		Size          ShellSize `msgpack:"size"`
		Type          string    `msgpack:"type"`
		IsSystemShell bool      `msgpack:"isSystemShell"`
	}{"bash -c " + ShellQuote(command), cwd, defaultSize, "TERMINAL", true}
	err := p.call(ctx, "shell/create", params, nil, func(raw msgpack.RawMessage) {
		var s Shell
		if msgpack.Unmarshal(raw, &s) != nil || s.ShellID == "" {
			return
		}
		shellID = s.ShellID
		for _, b := range s.Buffer {
			sr.add(b)
		}
		if s.Status != "RUNNING" && s.Status != "RESTARTING" && s.ExitCode != nil {
			sr.finish(*s.ExitCode)
			return
		}
		p.mu.Lock()
		gone := p.err
		if gone == nil {
			p.shells[s.ShellID] = sr
		}
		p.mu.Unlock()
		if gone != nil {
			sr.fail(fmt.Errorf("%w: %w", ErrPitcherClosed, gone))
		}
	})
	if err != nil {
		return "", err
	}
	if shellID == "" {
		return "", errors.New("pitcher shell/create: no shellId in result")
	}
	return shellID, nil
}

func (p *Pitcher) shell(id string) *shellRun {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.shells[id]
}

func (p *Pitcher) finishShell(id string, code int) {
	p.mu.Lock()
	s := p.shells[id]
	delete(p.shells, id)
	p.mu.Unlock()
	if s != nil {
		s.finish(code)
	}
}

// shellRun collects one command's output, or hands it to sink.
type shellRun struct {
	mu    sync.Mutex
	out   tailBuffer
	sink  func(string)
	exit  int
	err   error
	done  chan struct{}
	ended bool
}

func newShellRun(max int) *shellRun {
	return &shellRun{out: tailBuffer{max: max}, done: make(chan struct{})}
}

// add keeps a chunk; the agent's own "[CODESANDBOX]" status lines are not
// the command's output (the SDK drops them too).
func (s *shellRun) add(chunk string) {
	if strings.HasPrefix(chunk, "[CODESANDBOX]") {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.ended:
	case s.sink != nil:
		s.sink(chunk)
	default:
		s.out.write([]byte(chunk))
	}
}

func (s *shellRun) finish(code int) { s.end(code, nil) }
func (s *shellRun) fail(err error)  { s.end(-1, err) }

func (s *shellRun) end(code int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return
	}
	s.ended, s.exit, s.err = true, code, err
	close(s.done)
}

func (s *shellRun) result() (*RunResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return &RunResult{Output: CleanOutput(s.out.b), ExitCode: s.exit, Truncated: s.out.dropped > 0}, s.err
}

func (s *shellRun) partial() *RunResult {
	s.mu.Lock()
	defer s.mu.Unlock()
	return &RunResult{Output: CleanOutput(s.out.b), ExitCode: -1, Truncated: s.out.dropped > 0}
}

// tailBuffer keeps the last max bytes written.
type tailBuffer struct {
	max     int
	b       []byte
	dropped int64
}

func (t *tailBuffer) write(p []byte) {
	if len(p) >= t.max {
		t.dropped += int64(len(t.b) + len(p) - t.max)
		t.b = append(t.b[:0], p[len(p)-t.max:]...)
		return
	}
	if over := len(t.b) + len(p) - t.max; over > 0 {
		t.dropped += int64(over)
		n := copy(t.b, t.b[over:])
		t.b = t.b[:n]
	}
	t.b = append(t.b, p...)
}

// tail returns at most max bytes of b's end.
func tail(b []byte, max int) []byte {
	if max >= 0 && len(b) > max {
		return b[len(b)-max:]
	}
	return b
}

// ShellQuote quotes s as one POSIX shell word.
func ShellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// CleanOutput turns terminal output into plain text: ANSI escape
// sequences are removed and CRLF becomes LF.
func CleanOutput(b []byte) []byte {
	out := StripANSI(b)
	return bytes.ReplaceAll(out, []byte("\r\n"), []byte("\n"))
}

// StripANSI removes CSI (ESC [ … final), OSC (ESC ] … BEL or ESC \),
// ESC-intermediate-final (ESC ( B) and two-byte ESC sequences. An
// unfinished sequence at the end is dropped.
func StripANSI(b []byte) []byte {
	const (
		text = iota
		esc
		csi
		osc
		oscEsc
		inter
	)
	out := make([]byte, 0, len(b))
	state := text
	for _, c := range b {
		switch state {
		case text:
			if c == 0x1b {
				state = esc
			} else {
				out = append(out, c)
			}
		case esc:
			switch c {
			case '[':
				state = csi
			case ']':
				state = osc
			default:
				if c >= 0x20 && c <= 0x2f {
					state = inter
				} else {
					state = text
				}
			}
		case inter:
			if c < 0x20 || c > 0x2f {
				state = text
			}
		case csi:
			if c >= 0x40 && c <= 0x7e {
				state = text
			}
		case osc:
			switch c {
			case 0x07:
				state = text
			case 0x1b:
				state = oscEsc
			}
		case oscEsc:
			if c == '\\' {
				state = text
			} else {
				state = osc
			}
		}
	}
	return out
}
