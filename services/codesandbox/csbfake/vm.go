package csbfake

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/creack/pty"
)

// Option configures a fake.
type Option func(*Server)

// WithRealShell makes the VMs run shell/create commands for real: bash in
// a bubblewrap sandbox whose root is the host's /usr and /etc (read-only:
// what a runner template's image provides, python3 and node among it),
// with the VM's own /project and /tmp (the directory the agent's fs/*
// methods work on), in a pseudo-terminal of the SDK's size, as a
// TERMINAL shell is. Output is streamed as shell/out, input arrives
// through shell/in, and shell/exit carries the real exit status. As in a
// VM, a shell lives on when the connection that started it drops (its
// output then goes nowhere); stopping the VM kills it. The VM
// keeps the host's network namespace: a VM has a network, and what the
// broker does to deny it must show. Without bubblewrap the test fails when
// CI=true and is skipped elsewhere.
func WithRealShell() Option {
	return func(s *Server) {
		if _, err := exec.LookPath("bwrap"); err != nil {
			if os.Getenv("CI") == "true" {
				s.t.Fatalf("CI=true but bubblewrap is missing: %v", err)
			}
			s.t.Skipf("the fake's real shell needs bubblewrap: %v", err)
		}
		s.realShell = true
	}
}

// WithUnprivilegedShell runs the real shell's commands as uid 1000
// without capabilities (a non-root VM user), so they cannot make a network
// namespace without a user namespace first.
func WithUnprivilegedShell() Option {
	return func(s *Server) { s.capDrop = true }
}

// WithLatency delays every management API answer by rest and every
// message the agent sends (responses and notifications, in order) by
// agent, as a network between the broker and CodeSandbox would.
func WithLatency(rest, agent time.Duration) Option {
	return func(s *Server) { s.restDelay, s.agentDelay = rest, agent }
}

// SetLatency changes the injected latencies (see WithLatency).
func (s *Server) SetLatency(rest, agent time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.restDelay, s.agentDelay = rest, agent
}

func (s *Server) latency() (rest, agent time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.restDelay, s.agentDelay
}

// vmPath is the VM's PATH.
const vmPath = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"

// usrLinks are the top-level directories a merged-/usr host links into /usr.
var usrLinks = []string{"bin", "sbin", "lib", "lib32", "lib64", "libx32"}

// vmArgs is the bubblewrap command line of one command in sb's VM.
func vmArgs(f *vmFS, cwd, command string, capDrop bool) []string {
	a := []string{
		"--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "csb-vm",
		"--clearenv", "--setenv", "PATH", vmPath, "--setenv", "HOME", "/root", "--setenv", "TERM", "xterm-256color",
		"--setenv", "LANG", "C.UTF-8",
		"--ro-bind", "/usr", "/usr",
	}
	if capDrop {
		a = append(a, "--unshare-user", "--uid", "1000", "--gid", "1000", "--cap-drop", "ALL")
	}
	for _, d := range usrLinks {
		host := "/" + d
		fi, err := os.Lstat(host)
		switch {
		case err != nil:
		case fi.Mode()&os.ModeSymlink != 0:
			if t, err := os.Readlink(host); err == nil {
				a = append(a, "--symlink", t, host)
			}
		case fi.IsDir():
			a = append(a, "--ro-bind", host, host)
		}
	}
	return append(a,
		"--ro-bind", "/etc", "/etc",
		"--bind", f.hostPath("/project"), "/project",
		"--bind", f.hostPath("/tmp"), "/tmp",
		"--tmpfs", "/root",
		"--proc", "/proc", "--dev", "/dev",
		"--chdir", cwd,
		"--", "bash", "-c", command,
	)
}

// startReal starts sh's command in the VM (see WithRealShell) and returns
// what streams it, to run once shell/create has been answered.
func (s *Server) startReal(ac *agentConn, sb *sandbox, sh *shell, cwd string) func() {
	cmd := exec.Command("bwrap", vmArgs(sb.fs, cwd, sh.command, s.capDrop)...)
	tty, err := pty.StartWithSize(cmd, &pty.Winsize{Cols: 128, Rows: 24})
	if err != nil {
		return func() { s.endShell(ac, sh, 127, "bash: cannot start: "+err.Error()+"\r\n") }
	}
	s.mu.Lock()
	sh.tty = tty
	s.mu.Unlock()
	s.shellWG.Add(1)
	return func() {
		defer s.shellWG.Done()
		s.streamReal(ac, sh, cmd, tty)
	}
}

// streamReal sends the terminal's output until the command and everything
// it started have ended, then shell/exit.
func (s *Server) streamReal(ac *agentConn, sh *shell, cmd *exec.Cmd, tty *os.File) {
	defer tty.Close()
	exited := make(chan struct{})
	go func() { // a shell outlives its connection, not its VM
		select {
		case <-sh.killed:
		case <-exited:
			return
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}()
	s.shellOut(ac, sh, "[CODESANDBOX] Running command\r\n")
	// Until the VM's processes are all gone (bubblewrap's pid namespace
	// ends with the command) the terminal stays open.
	buf := make([]byte, 8<<10)
	var carry []byte
	for {
		n, err := tty.Read(buf)
		if n > 0 {
			chunk := append(carry, buf[:n]...)
			cut := len(chunk) // a terminal sends text: hold back half a character
			for i := len(chunk) - 1; i >= 0 && i >= len(chunk)-utf8.UTFMax; i-- {
				if utf8.RuneStart(chunk[i]) {
					if !utf8.FullRune(chunk[i:]) {
						cut = i
					}
					break
				}
			}
			s.shellOut(ac, sh, strings.ToValidUTF8(string(chunk[:cut]), "\uFFFD"))
			carry = append([]byte(nil), chunk[cut:]...)
		}
		if err != nil {
			break
		}
	}
	werr := cmd.Wait()
	close(exited)
	code := 0
	var ee *exec.ExitError
	if errors.As(werr, &ee) {
		code = ee.ExitCode()
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			code = 128 + int(ws.Signal())
		}
	} else if werr != nil {
		code = 127
	}
	s.endShell(ac, sh, code, strings.ToValidUTF8(string(carry), "\uFFFD"))
}

// shellOut records and sends one output chunk of sh.
func (s *Server) shellOut(ac *agentConn, sh *shell, chunk string) {
	if chunk == "" {
		return
	}
	params := map[string]any{"shellId": sh.id, "out": chunk}
	s.mu.Lock()
	sh.buffer = append(sh.buffer, chunk)
	s.recordLocked(ac, "shell/out", params)
	s.mu.Unlock()
	ac.notify("shell/out", params)
}

// recordLocked notes a notification of the real shell in PitcherCalls
// (FromAgent); the caller holds s.mu.
func (s *Server) recordLocked(ac *agentConn, method string, params map[string]any) {
	s.calls = append(s.calls, PitcherCall{SandboxID: ac.sandboxID, Method: method, Params: params, FromAgent: true})
	s.bumpLocked()
}

// endShell sends sh's last output and shell/exit, unless it was killed.
func (s *Server) endShell(ac *agentConn, sh *shell, code int, last string) {
	s.shellOut(ac, sh, last)
	s.mu.Lock()
	if sh.status == "KILLED" {
		s.mu.Unlock()
		return
	}
	sh.status, sh.exit, sh.tty = "FINISHED", &code, nil
	params := map[string]any{"shellId": sh.id, "shellType": sh.typ, "exitCode": code}
	s.recordLocked(ac, "shell/exit", params)
	s.mu.Unlock()
	ac.notify("shell/exit", params)
}
