package kube

import (
	"context"
	"net"
	"path"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

var _ sandbox.JobRunner = (*Session)(nil)

// jobLanguages is the order in which a job without JobSpec.Language picks
// its runner, as on Docker: every runner has bash, python the most tools.
var jobLanguages = []string{agent.LangPython, agent.LangBash, agent.LangNode, agent.LangTypeScript, agent.LangJavaScript}

// StartJob implements sandbox.JobRunner: spec runs as `bash -c` in the
// session's pod beside run_code. The workspace is synced before it starts
// and after it ends (and before file calls while it runs). Its network,
// when it has one, rides on tunnels the broker opens to the agent: the
// pod itself may open no connection.
func (s *Session) StartJob(ctx context.Context, spec sandbox.JobSpec, sink sandbox.JobSink) (sandbox.Job, error) {
	timeout := spec.Timeout
	if timeout <= 0 {
		timeout = defaultExecTimeout
	}
	if timeout > agent.MaxTimeoutMS*time.Millisecond {
		return nil, brokererr.New(brokererr.InvalidInput, "the timeout may be at most %s", agent.MaxTimeoutMS*time.Millisecond)
	}
	workDir := WorkspacePath
	if spec.WorkDir != "" && spec.WorkDir != "." {
		rel, err := workspace.ValidatePath(spec.WorkDir)
		if err != nil {
			return nil, err
		}
		workDir = path.Join(WorkspacePath, rel) // the agent resolves it again, inside the workspace
	}
	lang := spec.Language
	if lang == "" {
		lang = agent.LangBash
		for _, l := range jobLanguages {
			if _, ok := s.b.o.Runners[l]; ok {
				lang = l
				break
			}
		}
	}
	if _, err := s.b.image(lang); err != nil {
		return nil, err
	}
	req := agent.JobRequest{Command: spec.Command, WorkDir: workDir, Env: spec.EnvList(),
		TimeoutMS: max(timeout.Milliseconds(), 1), Interactive: spec.Interactive}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
	}
	for attempt := 0; ; attempt++ {
		j, err := s.startJobLocked(ctx, lang, spec, req, sink)
		if attempt == 0 && ctx.Err() == nil && unreachable(err) {
			continue
		}
		return j, err
	}
}

func (s *Session) startJobLocked(ctx context.Context, lang string, spec sandbox.JobSpec, req agent.JobRequest, sink sandbox.JobSink) (sandbox.Job, error) {
	p, err := s.podLocked(ctx, lang)
	if err != nil {
		return nil, err
	}
	w, err := s.OpenWorkspace(ctx)
	if err != nil {
		return nil, err
	}
	err = s.syncLocked(ctx, w, p)
	w.Close()
	if err != nil {
		return nil, s.syncFailed(p, err)
	}
	var tl *tunnelListener
	if spec.Egress != nil {
		req.EgressTunnel = sandbox.NewID()
		tl = newTunnelListener(p.client, req.EgressTunnel)
		go spec.Egress(tl)
	}
	p.jobs.Add(1)
	j, err := agent.StartJobVia(ctx, p.client.Dial, req, sink)
	if err != nil {
		p.jobs.Add(-1)
		if tl != nil {
			tl.Close()
		}
		if unreachable(err) {
			s.retireLocked(p, sandbox.LostUnresponsive)
			return nil, err
		}
		return nil, agent.JobStartError(ctx, err)
	}
	kj := &kubeJob{Job: j, done: make(chan struct{})}
	go func() {
		<-j.Done()
		if tl != nil {
			tl.Close()
		}
		// The job's files reach the broker's copy before Done.
		s.mu.Lock()
		if s.pods[p.lang] == p && !p.gone.Load() {
			s.syncQuietly(p)
		}
		p.jobs.Add(-1)
		s.mu.Unlock()
		close(kj.done)
	}()
	s.b.log.Debug().Str("pod", p.name).Str("language", lang).Bool("egress", tl != nil).Msg("job_started")
	return kj, nil
}

// kubeJob is the agent's job; Done waits for the sync after it.
type kubeJob struct {
	sandbox.Job
	done chan struct{}
}

func (k *kubeJob) Done() <-chan struct{} { return k.done }

// tunnelListener is a job's egress listener (sandbox.JobSpec.Egress): it
// keeps tunnelIdle tunnels parked at the agent, and each that the agent
// claims for one of the job's connections is Accept's next connection.
type tunnelListener struct {
	client *agent.PodClient
	token  string
	conns  chan net.Conn
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once
}

const tunnelIdle = 2

func newTunnelListener(client *agent.PodClient, token string) *tunnelListener {
	ctx, cancel := context.WithCancel(context.Background())
	t := &tunnelListener{client: client, token: token, conns: make(chan net.Conn), ctx: ctx, cancel: cancel}
	for range tunnelIdle {
		t.wg.Add(1)
		go t.park()
	}
	return t
}

// park keeps one tunnel parked: when the agent claims it, it is handed to
// Accept and another is parked; a failed tunnel is retried after a pause
// (the job may not have started yet, or the pod is gone).
func (t *tunnelListener) park() {
	defer t.wg.Done()
	pause := 50 * time.Millisecond
	for t.ctx.Err() == nil {
		c, err := t.client.Tunnel(t.ctx, t.token)
		if err != nil {
			select {
			case <-t.ctx.Done():
				return
			case <-time.After(pause):
			}
			pause = min(pause*2, 2*time.Second)
			continue
		}
		pause = 50 * time.Millisecond
		select {
		case t.conns <- c:
		case <-t.ctx.Done():
			c.Close()
			return
		}
	}
}

func (t *tunnelListener) Accept() (net.Conn, error) {
	select {
	case c := <-t.conns:
		return c, nil
	case <-t.ctx.Done():
		return nil, net.ErrClosed
	}
}

func (t *tunnelListener) Close() error {
	t.once.Do(func() {
		t.cancel()
		t.wg.Wait()
	})
	return nil
}

func (t *tunnelListener) Addr() net.Addr { return tunnelAddr(t.token) }

type tunnelAddr string

func (a tunnelAddr) Network() string { return "tunnel" }
func (a tunnelAddr) String() string  { return "tunnel:" + string(a) }
