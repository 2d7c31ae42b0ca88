package agent

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// TypeScript and JavaScript without Node's start-up on a run's path. With
// a toolchain (the directory holding node_modules/typescript, @types/node
// and the native helper sandbox_proc.node: /opt/ts in the typescript
// runner), the agent keeps two processes of Node in its own session:
//
//   - the resident (node_resident.js) keeps the TypeScript compiler and the
//     library types loaded; it type-checks each run's main.ts and writes
//     main.js, and never runs code of a run. A type error is reported as
//     tsc reports it and the code does not run;
//   - a spare (node_run.js) is Node started and idle; it takes one run,
//     calls setsid, and runs it as `node main.js` would. The next spare
//     starts at once.
//
// Without the toolchain, or while neither is ready, TypeScript falls back
// to the language's command (tsx) and JavaScript to node.

//go:embed node_resident.js
var nodeResidentScript string

//go:embed node_run.js
var nodeRunScript string

const (
	// nodeNative is the native helper's name in the toolchain.
	nodeNative = "sandbox_proc.node"
	// nodeReadyTimeout bounds a resident's or spare's start-up.
	nodeReadyTimeout = 2 * time.Minute
	// nodeSpareWait is how long a run waits for a spare that is starting
	// (starting another Node beside it would only slow both down).
	nodeSpareWait = 5 * time.Second
	// nodeReplyTimeout bounds a spare's answer to its run.
	nodeReplyTimeout = 2 * time.Second
	// maxResidentLine bounds one line from the resident.
	maxResidentLine = 1 << 20
)

// nodeProc is a resident or a spare: the agent's child, with its end of
// the socket on the child's fd 3.
type nodeProc struct {
	ch   *child
	conn net.Conn
	rd   *bufio.Reader
	// A spare's stdout and stderr, made before it started: the agent's
	// read ends, the caller's once it took a run.
	stdout, stderr *os.File
	took           atomic.Bool
}

func (p *nodeProc) procID() int             { return p.ch.pid }
func (p *nodeProc) exited() <-chan struct{} { return p.ch.done }
func (p *nodeProc) kill() {
	_ = syscall.Kill(p.ch.pid, syscall.SIGKILL)
}

// close releases the agent's ends; the process is gone or killed.
func (p *nodeProc) close() {
	p.conn.Close()
	if p.stdout != nil {
		p.stdout.Close()
		p.stderr.Close()
	}
}

func (p *nodeProc) writeJSON(v any, deadline time.Time) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return p.writeLine(b, deadline)
}

func (p *nodeProc) writeLine(b []byte, deadline time.Time) error {
	_ = p.conn.SetWriteDeadline(deadline)
	_, err := p.conn.Write(append(b, '\n'))
	return err
}

func (p *nodeProc) readLine(deadline time.Time) ([]byte, error) {
	_ = p.conn.SetReadDeadline(deadline)
	line, err := readLine(p.rd, maxResidentLine)
	if err != nil {
		return nil, err
	}
	return []byte(strings.TrimRight(string(line), "\n")), nil
}

// nodeRuntime is the agent's Node resident and spares.
type nodeRuntime struct {
	s         *Server
	node      string // the node binary
	toolchain string
	resident  *keeper[*nodeProc]
	spare     *keeper[*nodeProc]
}

// findNodeToolchain returns the toolchain directory: opts.NodeToolchain, or
// else the one the language's tsx command is installed in
// (<dir>/node_modules/tsx/...), if it holds TypeScript and the helper.
func findNodeToolchain(opts Options) string {
	dir := opts.NodeToolchain
	if dir == "" {
		cmd, ok := opts.Commands[LangTypeScript]
		if !ok || len(cmd.Argv) == 0 {
			return ""
		}
		bin, err := lookPath(cmd.Argv[0], envValue(opts.Env, "PATH"))
		if err != nil {
			return ""
		}
		if bin, err = filepath.EvalSymlinks(bin); err != nil {
			return ""
		}
		i := strings.LastIndex(bin, string(filepath.Separator)+"node_modules"+string(filepath.Separator))
		if i < 0 {
			return ""
		}
		dir = bin[:i]
	}
	for _, f := range []string{filepath.Join("node_modules", "typescript", "package.json"), nodeNative} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			return ""
		}
	}
	return dir
}

func newNodeRuntime(s *Server) *nodeRuntime {
	tc := findNodeToolchain(s.opts)
	if tc == "" {
		return nil
	}
	node, err := lookPath("node", envValue(s.opts.Env, "PATH"))
	if err != nil {
		return nil
	}
	r := &nodeRuntime{s: s, node: node, toolchain: tc}
	r.resident = newKeeper(s, "typescript resident", r.startResident, r.waitSealed, r.waitReady)
	r.spare = newKeeper(s, "node spare", r.startSpare, r.waitSealed, r.waitReady)
	r.resident.onReady, r.spare.onReady = s.opts.residentReady, s.opts.spareReady
	return r
}

// command runs a JavaScript file in a new Node (a direct start).
func (r *nodeRuntime) command() Command {
	return Command{Argv: []string{r.node, "--enable-source-maps", "-e", nodeRunScript, r.toolchain}, Ext: ".js"}
}

func (r *nodeRuntime) begin(ctx context.Context) {
	r.resident.begin(ctx)
	r.spare.begin(ctx)
}

func (r *nodeRuntime) warm() {
	r.resident.warm()
	r.spare.warm()
}

func (r *nodeRuntime) isWarm() bool { return r.resident.isReady() && r.spare.isReady() }

func (r *nodeRuntime) release() {
	r.resident.release()
	r.spare.release()
}

func (r *nodeRuntime) shutdown() {
	r.resident.shutdown()
	r.spare.shutdown()
}

// start starts node with script in the agent's session, a socket on its
// fd 3 and the given stdout and stderr.
func (r *nodeRuntime) start(script string, ownGroup bool, stdout, stderr io.Writer) (*nodeProc, error) {
	conn, theirs, err := childSocket(syscall.SOCK_STREAM)
	if err != nil {
		return nil, err
	}
	defer theirs.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		conn.Close()
		return nil, err
	}
	defer devnull.Close()
	ch, err := r.s.startInfra(&exec.Cmd{
		Path:       r.node,
		Args:       []string{"node", "--enable-source-maps", "-e", script, r.toolchain},
		Env:        r.s.opts.Env,
		Dir:        "/",
		Stdin:      devnull,
		Stdout:     stdout,
		Stderr:     stderr,
		ExtraFiles: []*os.File{theirs}, // fd 3
	}, ownGroup)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("start node: %w", err)
	}
	p := &nodeProc{ch: ch, conn: conn, rd: bufio.NewReaderSize(conn, 64<<10)}
	go func() {
		<-ch.done
		conn.Close()
	}()
	return p, nil
}

// startResident starts the resident in a process group of its own; its
// output goes to the agent's log.
func (r *nodeRuntime) startResident() (*nodeProc, error) {
	devnull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		return nil, err
	}
	defer devnull.Close()
	return r.start(nodeResidentScript, true, devnull, r.s.log)
}

// startSpare starts a spare with the pipes that will be its run's stdout
// and stderr. It stays in the agent's process group: setsid fails for a
// group leader.
func (r *nodeRuntime) startSpare() (*nodeProc, error) {
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return nil, err
	}
	p, err := r.start(nodeRunScript, false, outW, errW)
	outW.Close()
	errW.Close()
	if err != nil {
		outR.Close()
		errR.Close()
		return nil, err
	}
	p.stdout, p.stderr = outR, errR
	go func() {
		<-p.ch.done
		// A spare that never took a run: nobody else reads these.
		if !p.took.Load() {
			outR.Close()
			errR.Close()
		}
	}()
	return p, nil
}

// waitSealed waits for a resident's or spare's first line: it is
// non-dumpable.
func (r *nodeRuntime) waitSealed(ctx context.Context, p *nodeProc) error {
	stop := context.AfterFunc(ctx, func() { _ = p.conn.SetReadDeadline(time.Now()) })
	defer stop()
	line, err := p.readLine(time.Now().Add(sealTimeout))
	if err != nil {
		return err
	}
	if string(line) != "sealed" {
		return fmt.Errorf("bad first line %q", truncate(string(line), 80))
	}
	return nil
}

// waitReady waits for a resident's or spare's ready line.
func (r *nodeRuntime) waitReady(ctx context.Context, p *nodeProc) error {
	stop := context.AfterFunc(ctx, func() { _ = p.conn.SetReadDeadline(time.Now()) })
	defer stop()
	line, err := p.readLine(time.Now().Add(nodeReadyTimeout))
	if err != nil {
		return fmt.Errorf("waiting for ready: %w", err)
	}
	if string(line) == "ready" {
		return nil
	}
	var hello struct {
		Ready bool `json:"ready"`
		PID   int  `json:"pid"`
	}
	if json.Unmarshal(line, &hello) != nil || !hello.Ready || hello.PID != p.ch.pid {
		return fmt.Errorf("bad ready message %q", truncate(string(line), 80))
	}
	return nil
}

// errCheckTimeout is the resident's answer not arriving before the run's
// deadline.
var errCheckTimeout = errors.New("type check timed out")

// check type-checks the run's main.ts (path) with the resident, which
// writes main.js beside it when there is no error, and returns the
// number of errors with their text. The resident is started if needed and
// waited for until deadline; on any failure it is discarded.
func (r *nodeRuntime) check(ctx context.Context, path, out string, deadline time.Time) (int, string, error) {
	r.resident.warm()
	p, err := r.resident.get(ctx, time.Until(deadline), false)
	if err != nil {
		if time.Now().After(deadline) {
			return 0, "", errCheckTimeout
		}
		return 0, "", fmt.Errorf("typescript resident: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = p.conn.SetDeadline(time.Now()) })
	defer stop()
	if err := p.writeJSON(map[string]string{"file": path, "out": out}, deadline); err != nil {
		r.resident.discard(p, err)
		return 0, "", fmt.Errorf("typescript resident: %w", err)
	}
	line, err := p.readLine(deadline)
	if err != nil {
		r.resident.discard(p, err)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() && ctx.Err() == nil {
			return 0, "", errCheckTimeout
		}
		return 0, "", fmt.Errorf("typescript resident: %w", err)
	}
	var reply struct {
		Errors      int    `json:"errors"`
		Diagnostics string `json:"diagnostics"`
		Error       string `json:"error"`
	}
	if err := json.Unmarshal(line, &reply); err != nil || reply.Error != "" || reply.Errors < 0 {
		why := fmt.Errorf("bad reply %q", truncate(string(line), 80))
		if reply.Error != "" {
			why = errors.New(truncate(reply.Error, 300))
		}
		return 0, "", fmt.Errorf("typescript resident: %w", why)
	}
	return reply.Errors, reply.Diagnostics, nil
}

// spawn hands the run at path to a spare, waiting a bounded time for one
// that is starting. It returns the run's process and the read ends of its
// stdout and stderr; begin is called right before the run may start (the
// caller takes codeLock there). On failure the spare is gone, begin was
// not called and nothing of the run started: the caller starts it another
// way.
func (r *nodeRuntime) spawn(ctx context.Context, path, cwd string, begin func()) (*proc, *os.File, *os.File, error) {
	r.spare.warm()
	p, err := r.spare.get(ctx, nodeSpareWait, true)
	if err != nil {
		return nil, nil, nil, err
	}
	fail := func(err error) (*proc, *os.File, *os.File, error) {
		p.kill()
		select {
		case <-p.exited():
		case <-time.After(killGraceWait):
		}
		p.close()
		return nil, nil, nil, fmt.Errorf("node spare: %w", err)
	}
	_ = syscall.Kill(p.ch.pid, syscall.SIGCONT) // in case it was stopped
	deadline := time.Now().Add(nodeReplyTimeout)
	if err := p.writeJSON(map[string]string{"path": path, "cwd": cwd}, deadline); err != nil {
		return fail(err)
	}
	line, err := p.readLine(deadline)
	if err != nil || string(line) != "ok" {
		return fail(fmt.Errorf("no ack (%v)", err))
	}
	// From here on it is a run: the sweep may kill it, and only the agent
	// reads its output.
	p.took.Store(true)
	unprotect(p.ch.pid)
	begin()
	r.spare.warm() // the next spare boots once this run's code has ended
	if err := p.writeLine([]byte("go"), deadline); err != nil {
		// It may have died; its status says how.
		r.s.logf("node spare %d: go: %v", p.ch.pid, err)
	}
	p.conn.Close()
	done := make(chan outcome, 1)
	go func() {
		<-p.ch.done
		done <- outcomeOf(p.ch.state, nil)
	}()
	return &proc{pid: p.ch.pid, done: done}, p.stdout, p.stderr, nil
}
