package hosted

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// Two backends on one store are two broker replicas serving one session;
// each releases it by its own idle clock.

func hibernations(e *env, id string) int {
	return count(e.fake.Requests(), http.MethodPost, "/vm/"+id+"/hibernate")
}

// TestIdleReleaseSparesAVMAnotherReplicaUsed: replica A last used the VM
// long ago, replica B recently: A's idle release leaves it running. Once
// nobody has used it for the idle timeout, it hibernates.
func TestIdleReleaseSparesAVMAnotherReplicaUsed(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		e := newEnv(t, func(o *Options) { o.DBPath = st.Loc(t); o.IdleTimeout = time.Minute })
		r := e.replica()
		a, b := e.open(wid1, "alice"), r.open(wid1, "alice")
		run(t, a, "bash", "true")
		id := a.v.id()
		e.clk.pass(90 * time.Second)
		run(t, b, "bash", "true") // B joins the VM
		e.clk.pass(30 * time.Second)
		if err := a.Release(ctx(t)); err != nil {
			t.Fatal(err)
		}
		if n := hibernations(e, id); n != 0 {
			t.Fatalf("replica A, idle for 2 minutes, hibernated the VM replica B used 30s ago (%d requests)", n)
		}
		if sb, _ := e.fake.Sandbox(id); !sb.Running {
			t.Fatal("the VM is not running")
		}
		e.idleRelease(a)
		if n := hibernations(e, id); n != 1 {
			t.Fatalf("idle on both replicas: %d hibernate requests, want 1", n)
		}
	})
}

// TestIdleReleaseSparesALongCallOnAnotherReplica: a run, then an
// execution, on replica B outlast the idle timeout (and A's last use, by
// far); A's idle release meanwhile leaves the VM running under them.
func TestIdleReleaseSparesALongCallOnAnotherReplica(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		const idle = 200 * time.Millisecond // B's replica records a call's use every 50ms
		e := newEnv(t, func(o *Options) { o.DBPath = st.Loc(t); o.IdleTimeout = idle })
		r := e.replica()
		a, b := e.open(wid1, "alice"), r.open(wid1, "alice")
		run(t, a, "bash", "true")
		id := a.v.id()
		const wait = "touch started.txt; while [ ! -e go ]; do sleep 0.05; done; rm started.txt go"
		calls := []struct {
			name  string
			start func() (end func() error)
		}{
			{"run", func() func() error {
				cx := ctx(t)
				errc := make(chan error, 1)
				go func() {
					res, err := b.Exec(cx, sandbox.ExecRequest{Language: "bash", Code: wait, Timeout: 30 * time.Second})
					if err == nil && res.ExitCode != 0 {
						err = fmt.Errorf("exit %d: %q", res.ExitCode, res.Stderr)
					}
					errc <- err
				}()
				return func() error { return <-errc }
			}},
			{"execution", func() func() error {
				j, _ := startJob(t, b, sandbox.JobSpec{ID: "long", Command: wait})
				return func() error {
					if x := waitJob(t, j); x.Err != nil || x.ExitCode != 0 {
						return fmt.Errorf("exit %+v", x)
					}
					return nil
				}
			}},
		}
		for _, c := range calls {
			end := c.start()
			cx, cancel := context.WithTimeout(ctx(t), 30*time.Second)
			if err := e.fake.Await(cx, func() bool {
				sb, _ := e.fake.Sandbox(id)
				_, ok := sb.Files["/project/workspace/started.txt"]
				return ok
			}); err != nil {
				t.Fatalf("the %s did not start", c.name)
			}
			// The call goes on for an hour; B records the use meanwhile.
			e.clk.pass(time.Hour)
			if err := e.fake.Await(cx, func() bool {
				last, ok, err := e.b.db.lastUsed(cx, wid1, id)
				return err == nil && ok && !last.Before(e.clk.now())
			}); err != nil {
				t.Fatalf("replica B did not record its %s's use while it ran", c.name)
			}
			cancel()
			if err := a.Release(ctx(t)); err != nil {
				t.Fatal(err)
			}
			if n := hibernations(e, id); n != 0 {
				t.Fatalf("replica A hibernated the VM under B's %s", c.name)
			}
			e.fake.SetFile(id, "go", nil)
			if err := end(); err != nil {
				t.Fatalf("B's %s: %v", c.name, err)
			}
		}
		e.idleRelease(a)
		if n := hibernations(e, id); n != 1 {
			t.Fatalf("idle on both replicas: %d hibernate requests, want 1", n)
		}
	})
}

// TestSimultaneousForksMakeOneVM: two replicas make a session's first
// run at once, and both fork. A's fork is answered only after B has
// recorded its VM: A deletes its own and runs in B's, without an error.
func TestSimultaneousForksMakeOneVM(t *testing.T) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) {
		e := newEnv(t, func(o *Options) { o.DBPath = st.Loc(t) })
		r := e.replica()
		a, b := e.open(wid1, "alice"), r.open(wid1, "alice")
		forkPath := "/sandbox/" + runnerTemplate + "/fork"
		held, release := e.fake.HoldNext(http.MethodPost, forkPath)
		defer release()
		type outcome struct {
			res sandbox.ExecResult
			err error
		}
		ac, cx := make(chan outcome, 1), ctx(t)
		go func() {
			res, err := a.Exec(cx, sandbox.ExecRequest{Language: "bash", Code: "echo a; cat b.txt", Timeout: 20 * time.Second})
			ac <- outcome{res, err}
		}()
		select {
		case <-held:
		case <-time.After(30 * time.Second):
			t.Fatal("A did not fork")
		}
		run(t, b, "bash", "echo b > b.txt")
		release()
		o := <-ac
		if o.err != nil || string(o.res.Stdout) != "a\nb\n" {
			t.Fatalf("A's run: %v, stdout %q", o.err, o.res.Stdout)
		}
		winner := b.v.id()
		if a.v.id() != winner || count(e.fake.Requests(), http.MethodPost, forkPath) != 2 {
			t.Fatalf("A's VM %s, B's %s, %d forks", a.v.id(), winner, count(e.fake.Requests(), http.MethodPost, forkPath))
		}
		var deleted []string
		for _, rq := range e.fake.Requests() {
			if rq.Method == http.MethodDelete {
				deleted = append(deleted, strings.TrimPrefix(rq.Path, "/vm/"))
			}
		}
		if len(deleted) != 1 || deleted[0] == winner {
			t.Fatalf("deleted VMs %v; want A's own fork, not %s", deleted, winner)
		}
		if sb, _ := e.fake.Sandbox(deleted[0]); !sb.Deleted {
			t.Fatalf("A's fork %s is not deleted", deleted[0])
		}
		if sb, _ := e.fake.Sandbox(winner); sb.Deleted || !sb.Running {
			t.Fatalf("B's VM %+v", sb)
		}
		runsIn := map[string]int{}
		for _, c := range e.fake.PitcherCalls() {
			if cmd, _ := c.Params["command"].(string); c.Method == "shell/create" && strings.Contains(cmd, helperPath+" run ") {
				runsIn[c.SandboxID]++
			}
		}
		if len(runsIn) != 1 || runsIn[winner] != 2 {
			t.Fatalf("runs by VM %v; want both in %s", runsIn, winner)
		}
		if _, sb, _ := e.b.db.get(ctx(t), wid1); sb != winner {
			t.Fatalf("the row names %q, want %s", sb, winner)
		}
	})
}

// TestReplicaJoinsTheReplacementVM: the session's VM was deleted behind
// the brokers' backs and replica B has put a new one in its place; A,
// finding the old one gone, joins B's rather than replacing it again.
func TestReplicaJoinsTheReplacementVM(t *testing.T) {
	e := newEnv(t, nil)
	r := e.replica()
	a, b := e.open(wid1, "alice"), r.open(wid1, "alice")
	run(t, a, "bash", "true")
	run(t, b, "bash", "true")
	old := a.v.id()
	a.v.disconnect()
	b.v.disconnect()
	if err := e.b.destroyVM(ctx(t), old); err != nil {
		t.Fatal(err)
	}
	run(t, b, "bash", "true")
	run(t, a, "bash", "true")
	forks := count(e.fake.Requests(), http.MethodPost, "/sandbox/"+runnerTemplate+"/fork")
	if a.v.id() != b.v.id() || a.v.id() == old || forks != 2 {
		t.Fatalf("A's VM %s, B's %s (the first %s), %d forks", a.v.id(), b.v.id(), old, forks)
	}
	if _, sb, _ := e.b.db.get(ctx(t), wid1); sb != b.v.id() {
		t.Fatalf("the row names %q, want %s", sb, b.v.id())
	}
}

// TestDestroyOnAReplicaThatNeverRan: replica A opened the session, replica
// B forked its VM and ran in it; closing the session on A deletes B's VM
// at once (not only at the next orphan sweep) and its row.
func TestDestroyOnAReplicaThatNeverRan(t *testing.T) {
	e := newEnv(t, nil)
	r := e.replica()
	a, b := e.open(wid1, "alice"), r.open(wid1, "alice")
	run(t, b, "bash", "true")
	id := r.vmID(wid1)
	if err := a.Destroy(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if sb, ok := e.fake.Sandbox(id); !ok || !sb.Deleted {
		t.Fatalf("B's VM %s after A destroyed the session: %+v", id, sb)
	}
	if _, vm, _ := e.b.db.get(ctx(t), wid1); vm != "" {
		t.Fatalf("the row still names %q", vm)
	}
}
