package docker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

func killContainer(t *testing.T, e *Engine, id string) {
	t.Helper()
	if err := e.cli.ContainerKill(context.Background(), id, "SIGKILL"); err != nil {
		t.Fatal(err)
	}
}

// TestDeadContainerReplaced: a session container killed behind the
// engine's back (as a restarted daemon does) is replaced at once: the next
// run and the next job go to new containers, with no error first, and the
// dead one is removed.
func TestDeadContainerReplaced(t *testing.T) {
	e := newEngine(t, nil)
	needRunner(t, e, "python")
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	exec1(t, s, "python", "open('f.txt','w').write('kept')", 20*time.Second)
	for _, what := range []string{"run", "job"} {
		dead := sessionContainer(t, s).dockerID
		killContainer(t, e, dead)
		switch what {
		case "run":
			res := exec1(t, s, "python", "print(open('f.txt').read())", 20*time.Second)
			if strings.TrimSpace(string(res.Stdout)) != "kept" {
				t.Fatalf("run after the container died: %+v", res)
			}
		case "job":
			j, err := s.(sandbox.JobRunner).StartJob(context.Background(), sandbox.JobSpec{Command: "cat f.txt", Language: "python", Timeout: 20 * time.Second}, nil)
			if err != nil {
				t.Fatalf("job after the container died: %v", err)
			}
			<-j.Done()
			if x := j.Exit(); x.Err != nil || x.ExitCode != 0 {
				t.Fatalf("job exit: %+v", x)
			}
		}
		if now := sessionContainer(t, s).dockerID; now == dead {
			t.Fatalf("%s: still on the dead container", what)
		}
		waitFor(t, 30*time.Second, "dead container removed", func() bool {
			return len(listContainers(t, e.cli, LabelInstance+"="+e.o.InstanceID, "sandbox.id")) == 1
		})
	}
}

// TestRunCutByDeadContainer: a container that dies during a run ends that
// run with a retryable UNAVAILABLE (the code may have run); it is not
// retried behind the caller's back.
func TestRunCutByDeadContainer(t *testing.T) {
	e := newEngine(t, nil)
	needRunner(t, e, "python")
	ref := newRef(e)
	s, err := e.Open(context.Background(), ref)
	if err != nil {
		t.Fatal(err)
	}
	exec1(t, s, "python", "pass", 20*time.Second)
	c := sessionContainer(t, s)
	ran := func() string { b, _ := os.ReadFile(filepath.Join(ref.Dir, "ran")); return string(b) }
	done := make(chan error, 1)
	go func() {
		_, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "python", Code: "import time; open('ran','a').write('x'); time.sleep(60)", Timeout: 90 * time.Second})
		done <- err
	}()
	// (Through the host path: the session is busy with the run.)
	waitFor(t, 20*time.Second, "run started", func() bool { return ran() == "x" })
	killContainer(t, e, c.dockerID)
	err = <-done
	if be := brokererr.As(err); be == nil || be.Code != brokererr.Unavailable || !be.Retryable || errors.Is(err, agent.ErrNotReached) {
		t.Fatalf("err = %v, want a retryable UNAVAILABLE", err)
	}
	if got := ran(); got != "x" {
		t.Fatalf("the cut run ran again: %q", got)
	}
}

// TestPoolReplacesDeadContainer: a pooled container that dies is taken out
// of the pool and replaced without waiting for a claim.
func TestPoolReplacesDeadContainer(t *testing.T) {
	e := newEngine(t, func(o *Options) { o.PoolSize = 1 })
	needRunner(t, e, "python")
	waitPoolReady(t, e, "python", 1)
	var dead string
	for id := range poolIDs(t, e, "python") {
		dead = id
	}
	killContainer(t, e, dead)
	waitFor(t, 90*time.Second, "pool replaced its dead container", func() bool {
		ids := poolIDs(t, e, "python")
		return len(ids) == 1 && !ids[dead] && e.Stats().PoolReady["python"] == 1
	})
	waitFor(t, 30*time.Second, "dead container removed", func() bool {
		for _, c := range listContainers(t, e.cli, LabelInstance+"="+e.o.InstanceID) {
			if c.ID == dead {
				return false
			}
		}
		return true
	})
}
