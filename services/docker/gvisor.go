package docker

// gVisor (runsc) support: what differs from runc is here.

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/pkg/stdcopy"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// RuntimeRunsc is gVisor's OCI runtime (config SANDBOX_RUNTIME=runsc).
const RuntimeRunsc = "runsc"

// runscFlags are the runsc flags the engine relies on; the daemon's
// registration of runsc must pass them (README, "gVisor").
var runscFlags = []struct{ name, value, why string }{
	{"oci-seccomp", "true", "without it runsc ignores the sandbox seccomp profile"},
	{"network", "none", "sandboxes get a loopback interface and nothing else"},
	{"host-uds", "all", "the broker connects to the agent's socket and jobs to their egress socket"},
}

// checkRuntime refuses to start on a daemon that does not have the
// configured runtime, or has runsc without runscFlags: the sandboxes would
// fail to start, or start without their seccomp profile.
func (e *Engine) checkRuntime(ctx context.Context) error {
	if e.o.Runtime == "" || e.o.Runtime == "runc" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	info, err := e.cli.Info(ctx)
	if err != nil {
		return fmt.Errorf("docker: cannot read the daemon's runtimes: %w", err)
	}
	rt, ok := info.Runtimes[e.o.Runtime]
	if !ok {
		return fmt.Errorf("docker: SANDBOX_RUNTIME=%s but the Docker daemon has no runtime of that name (register it in daemon.json \"runtimes\")", e.o.Runtime)
	}
	if e.o.Runtime != RuntimeRunsc {
		return nil
	}
	return checkRunscArgs(rt.Args)
}

// checkRunscArgs checks a runsc registration's runtimeArgs for runscFlags.
func checkRunscArgs(args []string) error {
	got := runtimeFlags(args)
	for _, f := range runscFlags {
		if got[f.name] != f.value {
			return fmt.Errorf("docker: the daemon's runsc runtime needs runtimeArgs --%s=%s (%s); it has %q", f.name, f.value, f.why, args)
		}
	}
	return nil
}

// runtimeFlags parses a runtime's Go-style flags: -x, --x, --x=v, --x v.
func runtimeFlags(args []string) map[string]string {
	bools := map[string]bool{"oci-seccomp": true}
	out := map[string]string{}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		switch {
		case hasValue:
		case bools[name]:
			value = "true"
		case i+1 < len(args):
			i++
			value = args[i]
		}
		out[name] = value
	}
	return out
}

// gvisorHostTasks is the host threads a gVisor sandbox needs beside one
// per sandbox task: the Sentry's and the gofer's own.
const gvisorHostTasks = 256

// applyRuntimeLimits adapts the process limit to gVisor. The pids cgroup
// counts host threads, and under runsc those are the Sentry's, its gofer's
// and one systrap stub per sandbox thread: a fork bomb that reaches the
// cgroup limit makes the Sentry itself fail and the whole sandbox dies with
// no output. So the sandbox's own limit is RLIMIT_NPROC, which the Sentry
// counts per sandbox (not per host uid, as runc's kernel would), and the
// cgroup keeps a backstop above it.
func (e *Engine) applyRuntimeLimits(hc *container.HostConfig) {
	if e.o.Runtime != RuntimeRunsc {
		return
	}
	n := e.o.PidsLimit
	host := 2*n + gvisorHostTasks
	hc.PidsLimit = &host
	hc.Ulimits = append(hc.Ulimits, &container.Ulimit{Name: "nproc", Soft: n, Hard: n})
}

// sessionsTimeout bounds starting the session monitor and each answer.
const sessionsTimeout = 10 * time.Second

// sessionMonitor lists the sessions of a gVisor sandbox and their
// processes (agent.Sessions) as the sandbox's kernel sees them. Under runsc
// the sandbox's processes are not host processes (the host sees only the
// Sentry, the gofer and systrap stubs, in sessions of their own), so runc's
// host-/proc check cannot work, and the sandbox's process IDs mean nothing
// in the host's /proc. The monitor is `agent sessions`, started once per
// container by the runtime as root with no capabilities: sandbox code runs
// as another uid and cannot signal, trace or feed it, and what it reads is
// the Sentry's /proc. It answers one line per line it is sent. Its answers
// are parsed as untrusted all the same (agent.ParseSessions), and the
// first bad one breaks the monitor for good: a stream out of step could
// answer later questions with a line of an attacker's choosing.
type sessionMonitor struct {
	mu     sync.Mutex
	conn   net.Conn      // the exec's stdin, and its output stream
	out    *bufio.Reader // its stdout, demultiplexed
	broken error
}

// startSessionMonitor starts c's monitor; the container's removal ends it.
func (e *Engine) startSessionMonitor(ctx context.Context, c *ctr) (*sessionMonitor, error) {
	ctx, cancel := context.WithTimeout(ctx, sessionsTimeout)
	defer cancel()
	ex, err := e.cli.ContainerExecCreate(ctx, c.dockerID, container.ExecOptions{
		User:         "0:0",
		Cmd:          []string{AgentPath, "agent", agent.SessionsCommand},
		AttachStdin:  true,
		AttachStdout: true,
		AttachStderr: true,
	})
	if err != nil {
		return nil, err
	}
	att, err := e.cli.ContainerExecAttach(ctx, ex.ID, container.ExecAttachOptions{})
	if err != nil {
		return nil, err
	}
	pr, pw := io.Pipe()
	go func() {
		_, err := stdcopy.StdCopy(pw, io.Discard, att.Reader)
		pw.CloseWithError(cmp.Or(err, io.EOF))
	}()
	return newSessionMonitor(att.Conn, pr), nil
}

// newSessionMonitor asks questions on conn and reads answers from out,
// each at most agent.MaxSessionsAnswer bytes.
func newSessionMonitor(conn net.Conn, out io.Reader) *sessionMonitor {
	return &sessionMonitor{conn: conn, out: bufio.NewReaderSize(out, agent.MaxSessionsAnswer)}
}

// sessions asks the monitor once.
func (m *sessionMonitor) sessions() (agent.Sessions, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.broken != nil {
		return nil, m.broken
	}
	s, err := m.ask()
	if err != nil {
		m.broken = fmt.Errorf("session monitor: %w", err)
		_ = m.conn.Close()
		return nil, m.broken
	}
	return s, nil
}

func (m *sessionMonitor) ask() (agent.Sessions, error) {
	// The deadline also ends a hung answer.
	if err := m.conn.SetDeadline(time.Now().Add(sessionsTimeout)); err != nil {
		return nil, err
	}
	if _, err := m.conn.Write([]byte("\n")); err != nil {
		return nil, err
	}
	// ReadSlice fails with bufio.ErrBufferFull on a line longer than the
	// buffer, which is the longest answer.
	line, err := m.out.ReadSlice('\n')
	if err != nil {
		return nil, err
	}
	if err := m.conn.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	return agent.ParseSessions(line)
}

func (m *sessionMonitor) close() {
	if m != nil {
		_ = m.conn.Close()
	}
}

// sandboxSessions asks c's monitor; a container without one cannot tell.
func (e *Engine) sandboxSessions(c *ctr) (agent.Sessions, error) {
	if c.monitor == nil {
		return nil, errors.New("no session monitor")
	}
	return c.monitor.sessions()
}
