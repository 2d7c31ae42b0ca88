package docker

// A minimal stand-in for `sandbox-broker agent`, used when the real broker
// binary cannot be built (the agent is developed concurrently). The test
// binary is bind-mounted as /opt/sandbox/broker; TestMain dispatches to
// fakeAgentMain when it is started as "agent". It speaks protocol.go: one
// JSON request line, one JSON response line per connection.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

type capBuf struct {
	mu    sync.Mutex
	b     bytes.Buffer
	max   int
	trunc bool
}

func (c *capBuf) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	room := c.max - c.b.Len()
	if room < len(p) {
		c.trunc = true
		if room > 0 {
			c.b.Write(p[:room])
		}
		return len(p), nil
	}
	c.b.Write(p)
	return len(p), nil
}

func fakeAgentMain(args []string) int {
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	sock := fs.String("socket", agent.SocketDir+"/"+agent.SocketName, "")
	_ = fs.String("language", "", "")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	_ = os.Remove(*sock)
	ln, err := net.Listen("unix", *sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fake agent:", err)
		return 1
	}
	var runMu sync.Mutex
	for {
		conn, err := ln.Accept()
		if err != nil {
			return 1
		}
		go func() {
			defer conn.Close()
			line, err := bufio.NewReaderSize(conn, 64<<10).ReadBytes('\n')
			if err != nil {
				return
			}
			var req agent.Request
			var resp agent.Response
			if err := json.Unmarshal(line, &req); err != nil {
				resp.Error = "bad request"
			} else if req.Language != agent.PingLanguage {
				runMu.Lock()
				resp = fakeRun(req)
				runMu.Unlock()
			}
			b, _ := json.Marshal(resp)
			_, _ = conn.Write(append(b, '\n'))
		}()
	}
}

func fakeRun(req agent.Request) agent.Response {
	var argv []string
	switch req.Language {
	case "python":
		argv = []string{"python3", "-c", req.Code}
	case "bash":
		argv = []string{"bash", "-c", req.Code}
	default:
		return agent.Response{Error: "language not supported by the fake agent"}
	}
	max := req.MaxOutputBytes
	if max <= 0 {
		max = agent.DefaultMaxOutputBytes
	}
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if timeout <= 0 {
		timeout = time.Minute
	}
	stdout, stderr := &capBuf{max: max}, &capBuf{max: max}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = agent.WorkDir
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "LANG=C.UTF-8", "MPLBACKEND=Agg"}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return agent.Response{Error: err.Error()}
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var timedOut atomic.Bool
	stop := context.AfterFunc(ctx, func() {
		if ctx.Err() == context.DeadlineExceeded {
			timedOut.Store(true)
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
	})
	_ = cmd.Wait()
	stop()
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	resp := agent.Response{
		Stdout: stdout.b.Bytes(), Stderr: stderr.b.Bytes(),
		Truncated: stdout.trunc || stderr.trunc, TimedOut: timedOut.Load(),
		DurationMS: time.Since(start).Milliseconds(),
	}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		resp.Signal = "SIG" + map[syscall.Signal]string{syscall.SIGKILL: "KILL", syscall.SIGSEGV: "SEGV", syscall.SIGTERM: "TERM"}[ws.Signal()]
		resp.ExitCode = 128 + int(ws.Signal())
	} else {
		resp.ExitCode = cmd.ProcessState.ExitCode()
	}
	return resp
}
