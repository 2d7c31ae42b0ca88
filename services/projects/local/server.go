package local

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/docker"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// SocketName is the node app's Unix socket, at the workspace root; the app
// gets its in-container path in $PREVIEW_SOCKET.
const SocketName = ".preview.sock"

const (
	serverStartTimeout = 30 * time.Second // npm start until the socket answers
	serverStopGrace    = 5 * time.Second
	socketPoll         = 100 * time.Millisecond
)

// server is the node template's app, run as a job in the project container.
type server struct {
	mu  sync.Mutex
	job sandbox.Job
	gen uint64 // the project generation the job was started for
}

func jobDone(j sandbox.Job) bool {
	select {
	case <-j.Done():
		return true
	default:
		return false
	}
}

// ensureServer starts the app unless a job started for the current files is
// running, and waits until its socket accepts connections.
func (pr *project) ensureServer(ctx context.Context) error {
	s := &pr.srv
	s.mu.Lock()
	defer s.mu.Unlock()
	gen := pr.generation()
	if s.job != nil && !jobDone(s.job) && s.gen == gen {
		return nil
	}
	if s.job != nil {
		stopJob(ctx, s.job)
		s.job = nil
	}
	jr, ok := pr.sess.(sandbox.JobRunner)
	if !ok {
		return brokererr.New(brokererr.NotConfigured, "this broker cannot run the node app server")
	}
	// A stale socket (or anything the sandbox put there) goes first; the
	// removal never follows a symlink.
	if root, err := os.OpenRoot(pr.dir); err == nil {
		if err := root.Remove(SocketName); err != nil && !errors.Is(err, fs.ErrNotExist) {
			pr.p.log.Warn().Err(err).Str("project", pr.id).Msg("preview_socket_not_removed")
		}
		_ = root.Close()
	}
	pr.console.Write([]byte("[broker] starting the app: npm start\n"))
	sctx, cancel := context.WithTimeout(ctx, serverStartTimeout)
	defer cancel()
	job, err := jr.StartJob(sctx, sandbox.JobSpec{
		ID:       files.NewWorkspaceID(),
		Language: Language,
		Command:  "exec npm start",
		Env:      map[string]string{"PREVIEW_SOCKET": path.Join(docker.WorkspacePath, SocketName)},
		Timeout:  projects.TTL,
	}, func(_ string, data []byte) { pr.console.Write(data) })
	if err != nil {
		return err
	}
	s.job, s.gen = job, gen
	t := time.NewTicker(socketPoll)
	defer t.Stop()
	for {
		if c, err := agent.DialSocket(sctx, filepath.Join(pr.dir, SocketName)); err == nil {
			_ = c.Close()
			pr.p.log.Info().Str("project", pr.id).Msg("preview_server_started")
			return nil
		}
		select {
		case <-job.Done():
			ex := job.Exit()
			pr.console.Write([]byte("[broker] the app exited before it listened on $PREVIEW_SOCKET\n"))
			return brokererr.New(brokererr.Unavailable, "the app exited (code %d) before listening on $PREVIEW_SOCKET; see get_sandbox_output console_log", ex.ExitCode).NotRetryable()
		case <-sctx.Done():
			stopJob(ctx, job)
			s.job = nil
			return brokererr.New(brokererr.SandboxTimeout, "the app did not listen on $PREVIEW_SOCKET within %s; see get_sandbox_output console_log", serverStartTimeout)
		case <-t.C:
		}
	}
}

// stop ends the app server, if any.
func (s *server) stop(ctx context.Context) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.job != nil {
		stopJob(ctx, s.job)
		s.job = nil
	}
}

// stopJob sends SIGTERM, then SIGKILL after a grace period.
func stopJob(ctx context.Context, j sandbox.Job) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*serverStopGrace)
	defer cancel()
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		if jobDone(j) {
			return
		}
		_ = j.Signal(ctx, sig)
		t := time.NewTimer(serverStopGrace)
		select {
		case <-j.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}
