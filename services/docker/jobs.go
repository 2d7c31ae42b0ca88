package docker

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

var _ sandbox.JobRunner = (*Session)(nil)

// StartJob implements sandbox.JobRunner: spec runs as `bash -c` beside
// run_code in the session's container (see agent.JobLanguageOrder). While it runs,
// the container is not released (Release refuses) nor replaced after a
// run, and the workspace quota is watched as during a run: past it the
// container is removed, the files written since the job started are
// deleted and the job ends with QUOTA_EXCEEDED.
func (s *Session) StartJob(ctx context.Context, spec sandbox.JobSpec, sink sandbox.JobSink) (sandbox.Job, error) {
	timeout := spec.Timeout
	if timeout <= 0 {
		timeout = defaultExecTimeout
	}
	if timeout > agent.MaxTimeoutMS*time.Millisecond {
		return nil, brokererr.New(brokererr.InvalidInput, "the timeout may be at most %s", agent.MaxTimeoutMS*time.Millisecond)
	}

	req := agent.JobRequest{
		Command:     spec.Command,
		Env:         spec.EnvList(),
		TimeoutMS:   max(timeout.Milliseconds(), 1),
		Interactive: spec.Interactive,
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	for attempt := 0; ; attempt++ {
		j, err := s.startJobLocked(ctx, spec, req, sink)
		if retryOnNewContainer(ctx, attempt, err) {
			continue
		}
		return j, err
	}
}

// startJobLocked starts req once in the session's container. Caller holds
// s.mu.
func (s *Session) startJobLocked(ctx context.Context, spec sandbox.JobSpec, req agent.JobRequest, sink sandbox.JobSink) (sandbox.Job, error) {
	e := s.e
	// The container first: claiming a pooled one renames its directory
	// onto the workspace path, which the workspace handle must then see.
	c, err := s.jobContainerLocked(ctx, spec.Language)
	if err != nil {
		return nil, err
	}
	w, err := s.OpenWorkspace(ctx)
	if err != nil {
		return nil, err
	}
	keepW := false
	defer func() {
		if !keepW {
			w.Close()
		}
	}()
	if req.WorkDir, err = s.jobWorkDir(spec.WorkDir); err != nil {
		return nil, err
	}
	before, err := w.Snapshot()
	if err != nil {
		return nil, err
	}

	c.jobs.Add(1)
	e.touchIdle(c)
	var eg *egressSocket
	started := false
	defer func() {
		if !started {
			eg.close()
			c.jobs.Add(-1)
			e.touchIdle(c)
		}
	}()
	if spec.Egress != nil {
		if eg, err = newEgressSocket(c.runDir, c.uid); err != nil {
			e.log.Warn().Err(err).Str("container", shortID(c.dockerID)).Msg("job_egress_socket_failed")
			return nil, brokererr.New(brokererr.Unavailable, "cannot give the execution a network path")
		}
		go spec.Egress(eg.ln)
		req.EgressSocket = agent.SocketDir + "/" + eg.name
	}
	j, err := agentStartJob(ctx, c.socket(), req, sink)
	if err != nil {
		if errors.Is(err, agent.ErrNotReached) {
			s.dropLocked(c)
		}
		return nil, agent.JobStartError(ctx, err)
	}
	started, keepW = true, true

	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stopWatch := s.watchQuota(wctx, w, c)
	dj := &dockerJob{Job: j, done: make(chan struct{})}
	go func() {
		<-j.Done()
		fired := stopWatch()
		cancel()
		eg.close()
		if fired {
			c.gone.Store(true)
			w.RemoveChanged(before)
			l := w.Limits()
			dj.setErr(brokererr.New(brokererr.QuotaExceeded,
				"the workspace exceeded its quota (%d files, %d MiB); the execution was stopped and the files written since it started were removed", l.MaxFiles, l.MaxBytes>>20))
		}
		w.Close()
		c.jobs.Add(-1)
		e.touchIdle(c)
		close(dj.done)
	}()
	e.log.Debug().Str("container", shortID(c.dockerID)).Str("language", c.lang).Bool("egress", eg != nil).Msg("job_started")
	return dj, nil
}

// agentStartJob is a variable for tests, like agentRun.
var agentStartJob = agent.StartJob

// jobContainerLocked returns the session's container of lang (default:
// the first of agent.JobLanguageOrder with a runner image), starting it if needed.
// Caller holds s.mu.
func (s *Session) jobContainerLocked(ctx context.Context, lang string) (*ctr, error) {
	if lang == "" {
		s.e.mu.Lock()
		runners := s.e.runners
		s.e.mu.Unlock()
		lang = agent.LangBash
		for _, l := range agent.JobLanguageOrder {
			if _, ok := runners[l]; ok {
				lang = l
				break
			}
		}
	}
	if c := s.ctrs[lang]; c != nil && !c.gone.Load() {
		return c, nil
	}
	r, err := s.e.runner(ctx, lang)
	if err != nil {
		return nil, err
	}
	return s.containerLocked(ctx, r)
}

// jobWorkDir maps a workspace-relative directory to its path inside the
// container. It is validated again and walked through os.Root component by
// component: each must be a real directory, so a symlink the sandbox
// planted cannot move the job anywhere (the agent resolves it once more).
func (s *Session) jobWorkDir(rel string) (string, error) {
	if rel == "" {
		return WorkspacePath, nil
	}
	if _, err := workspace.ValidatePath(rel); err != nil {
		return "", err
	}
	root, err := os.OpenRoot(s.ref.Dir)
	if err != nil {
		return "", brokererr.Wrap(err, brokererr.InternalError, "cannot open the workspace")
	}
	defer root.Close()
	cur := ""
	for _, seg := range strings.Split(rel, "/") {
		cur = path.Join(cur, seg)
		fi, err := root.Lstat(cur)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return "", brokererr.New(brokererr.FileNotFound, "working directory %q does not exist", rel)
		case err != nil:
			return "", brokererr.New(brokererr.PathTraversal, "working directory %q is not inside the workspace", rel)
		case fi.Mode()&fs.ModeSymlink != 0:
			return "", brokererr.New(brokererr.PathTraversal, "working directory %q goes through a symbolic link", rel)
		case !fi.IsDir():
			return "", brokererr.New(brokererr.InvalidInput, "working directory %q is not a directory", rel)
		}
	}
	return WorkspacePath + "/" + rel, nil
}

// egressSocket is a job's Unix listener in its container's run dir.
type egressSocket struct {
	ln   net.Listener
	name string
	once sync.Once
}

func newEgressSocket(runDir string, uid int) (*egressSocket, error) {
	name := "egress-" + sandbox.NewID() + ".sock"
	p := filepath.Join(runDir, name)
	ln, err := agent.ListenSocket(p)
	if err != nil {
		return nil, err
	}
	// The sandbox user must be able to connect (write permission). The
	// run dir is the sandbox's: nothing here may follow a symlink it put
	// in place of the socket.
	gid, mode := uid, uint32(0o600)
	if os.Geteuid() != 0 {
		uid, gid, mode = -1, -1, 0o666 // the run dir is 0777 then
	}
	if err := agent.SetSocketAccess(p, uid, gid, mode); err != nil {
		ln.Close()
		return nil, err
	}
	return &egressSocket{ln: ln, name: name}, nil
}

// close closes the listener (which unlinks the socket); nil-safe.
func (g *egressSocket) close() {
	if g == nil {
		return
	}
	g.once.Do(func() { _ = g.ln.Close() })
}

// dockerJob is the agent's job plus the container's bookkeeping: Done is
// closed only once the job's slot is given back.
type dockerJob struct {
	sandbox.Job
	done chan struct{}
	mu   sync.Mutex
	err  error // overrides Exit().Err (quota)
}

func (d *dockerJob) setErr(err error) {
	d.mu.Lock()
	d.err = err
	d.mu.Unlock()
}

func (d *dockerJob) Done() <-chan struct{} { return d.done }

func (d *dockerJob) Exit() sandbox.JobExit {
	x := d.Job.Exit()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err != nil {
		x.Err = d.err
	}
	return x
}
