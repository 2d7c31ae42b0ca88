package process

import (
	"context"
	"errors"
	"net"
	"os"
	"path"
	"path/filepath"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// StartJob implements sandbox.JobRunner: the job runs under the agent of
// the session's sandbox for spec.Language (by default the first runner of
// agent.JobLanguageOrder), beside run_code. With spec.Egress the broker
// listens on a Unix socket in the sandbox's run dir (where the agent
// requires it) and hands the listener to spec.Egress until the job ends.
func (s *Session) StartJob(ctx context.Context, spec sandbox.JobSpec, sink sandbox.JobSink) (sandbox.Job, error) {
	workDir := WorkspacePath
	if spec.WorkDir != "" && spec.WorkDir != "." {
		rel, err := workspace.ValidatePath(spec.WorkDir)
		if err != nil {
			return nil, err
		}
		workDir = path.Join(WorkspacePath, rel)
	}
	timeout := spec.Timeout
	if timeout <= 0 {
		timeout = defaultExecTimeout
	}
	timeout = min(timeout, agent.MaxTimeoutMS*time.Millisecond)

	r, err := s.b.jobRunner(spec.Language)
	if err != nil {
		return nil, err
	}
	sb, err := s.sandbox(ctx, r)
	if err != nil {
		return nil, err
	}
	req := agent.JobRequest{
		Command:     spec.Command,
		WorkDir:     workDir,
		Env:         spec.EnvList(),
		TimeoutMS:   max(timeout.Milliseconds(), 1),
		Interactive: spec.Interactive,
	}
	var ln net.Listener
	if spec.Egress != nil {
		name := "egress-" + sandbox.NewID() + ".sock"
		ln, err = s.b.egressListener(filepath.Join(sb.runDir, name), s.uid, s.gid)
		if err != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "cannot create the job's network path")
		}
		req.EgressSocket = agent.SocketDir + "/" + name
		go spec.Egress(ln)
	}
	j, err := agentStartJob(ctx, sb.socket(), req, sink)
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		return nil, jobError(err)
	}
	if ln != nil {
		go func() {
			select {
			case <-j.Done():
			case <-sb.exited:
			}
			ln.Close()
		}()
	}
	return j, nil
}

// agentStartJob is a variable so tests can observe the request.
var agentStartJob = agent.StartJob

// jobError maps the agent's refusal to codes the model can act on.
func jobError(err error) error {
	var je *agent.JobError
	if errors.As(err, &je) {
		msg := je.Message
		if len(msg) > 300 {
			msg = msg[:300] + "…"
		}
		switch je.Kind {
		case agent.JobErrInvalid:
			return brokererr.New(brokererr.InvalidInput, "the job was refused: %s", msg)
		case agent.JobErrLimit:
			return brokererr.New(brokererr.QuotaExceeded, "too many jobs are running in this sandbox: %s", msg).WithRetryAfter(time.Second)
		}
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "the sandbox could not start the job")
}

// egressListener listens on p, in the sandbox-writable run dir, for the
// sandbox uid. The sandbox may swap the name for a symlink at any moment,
// so nothing here follows one: the socket's mode comes from bind(2) (0777
// less the umask: only the owner may connect when the umask is 022), and
// the owner is set with lchown(2). Close unlinks the name, never a target.
func (b *Backend) egressListener(p string, uid, gid int) (net.Listener, error) {
	ln, err := agent.ListenSocket(p)
	if err != nil {
		return nil, err
	}
	if os.Geteuid() == 0 {
		if err := os.Lchown(p, uid, gid); err != nil {
			ln.Close()
			return nil, err
		}
	}
	return ln, nil
}
