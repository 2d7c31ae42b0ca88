package hosted

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

func count(reqs []csbfake.Request, method, path string) int {
	n := 0
	for _, r := range reqs {
		if r.Method == method && r.Path == path {
			n++
		}
	}
	return n
}

func TestFaultsBeforeTheRun(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	cx := ctx(t)
	// A fork that fails is not retried (it could make a second VM), and
	// says so: retryable, and marked as not started (Fallback may take it).
	e.fake.Inject(csbfake.Fault{Status: http.StatusServiceUnavailable, N: 1, Path: "/sandbox/" + runnerTemplate + "/fork"})
	_, err := s.Exec(cx, sandbox.ExecRequest{Language: "bash", Code: "echo hi"})
	if be := wantCode(t, err, brokererr.Unavailable); !be.Retryable || !sandbox.IsNotStarted(err) {
		t.Fatalf("fork 503: %+v", be)
	}
	if n := count(e.fake.Requests(), "POST", "/sandbox/"+runnerTemplate+"/fork"); n != 1 || helperRuns(e.fake) != 0 {
		t.Fatalf("%d forks, %d runs", n, helperRuns(e.fake))
	}
	run(t, s, "bash", "echo one > a.txt")
	id := s.v.id()
	e.idleRelease(s)
	// Resuming is idempotent: 5xx are retried.
	e.fake.ResetRequests()
	e.fake.Inject(csbfake.Fault{Status: http.StatusBadGateway, N: 2, Path: "/vm/" + id + "/start"})
	if r := run(t, s, "bash", "cat a.txt"); string(r.Stdout) != "one\n" {
		t.Fatalf("after 502s: %q", r.Stdout)
	}
	if n := count(e.fake.Requests(), "POST", "/vm/"+id+"/start"); n != 3 {
		t.Fatalf("%d starts, want 3", n)
	}
	// No VM may start (the workspace's concurrent-VM budget): retryable later.
	e.idleRelease(s)
	e.fake.Inject(csbfake.Fault{Status: http.StatusTooManyRequests, N: 10, Path: "/vm/" + id + "/start"})
	_, err = s.Exec(cx, sandbox.ExecRequest{Language: "bash", Code: "true"})
	if be := wantCode(t, err, brokererr.RateLimitExceeded); !be.Retryable || be.RetryAfter <= 0 || !sandbox.IsNotStarted(err) {
		t.Fatalf("429: %+v", be)
	}
	e.fake.ClearFaults()
	// Rejected credentials are not retryable.
	bad := newEnv(t, func(o *Options) { o.API.APIKey = "csb_v1_wrong_key_000000000000" })
	_, err = bad.open(wid1, "alice").Exec(cx, sandbox.ExecRequest{Language: "bash", Code: "true"})
	if be := wantCode(t, err, brokererr.PermissionDenied); be.Retryable {
		t.Fatalf("401: %+v", be)
	}
}

// startRun runs code in the background and waits until it has begun:
// started.txt exists in the VM.
func startRun(t *testing.T, e *env, s *Session, code string, timeout time.Duration) (<-chan sandbox.ExecResult, <-chan error, string) {
	t.Helper()
	run(t, s, "bash", "true") // the VM exists
	id := s.v.id()
	resc, errc := make(chan sandbox.ExecResult, 1), make(chan error, 1)
	go func() {
		res, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: code, Timeout: timeout})
		resc <- res
		errc <- err
	}()
	cx, cancel := context.WithTimeout(ctx(t), 30*time.Second)
	defer cancel()
	if err := e.fake.Await(cx, func() bool {
		st, _ := e.fake.Sandbox(id)
		_, ok := st.Files["/project/workspace/started.txt"]
		return ok
	}); err != nil {
		t.Fatal("the run did not start")
	}
	return resc, errc, id
}

func TestDroppedConnectionRecoversTheOutcome(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	resc, errc, id := startRun(t, e, s, "echo run >> count.txt; touch started.txt; echo started; sleep 2; echo done", 30*time.Second)
	if e.fake.DropConnections(id) == 0 {
		t.Fatal("no connection to drop")
	}
	res, err := <-resc, <-errc
	if err != nil || string(res.Stdout) != "started\ndone\n" || res.ExitCode != 0 {
		t.Fatalf("after the drop: %+v %v (%v)", res, err, errors.Unwrap(err))
	}
	// It ran once: the result was looked up, not run again.
	if helperRuns(e.fake) != 2 { // the setup run and this one
		t.Fatalf("%d helper runs", helperRuns(e.fake))
	}
	if r := run(t, s, "bash", "cat count.txt"); string(r.Stdout) != "run\n" {
		t.Fatalf("count.txt %q", r.Stdout)
	}
}

func TestLostRunIsNotRunAgain(t *testing.T) {
	old := runMargin
	runMargin = 2 * time.Second
	defer func() { runMargin = old }()
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	resc, errc, id := startRun(t, e, s, "echo run >> count.txt; touch started.txt; echo started; sleep 3; echo done", 3*time.Second)
	// The VM goes to sleep under the run (the fake's hibernation ends its processes).
	if !e.fake.HibernateVM(id) {
		t.Fatal("not running")
	}
	res, err := <-resc, <-errc
	if err == nil {
		t.Fatalf("hibernated under the run, yet: %+v stdout=%q", res, res.Stdout)
	}
	be := wantCode(t, err, brokererr.Unavailable)
	if be.Retryable || !strings.Contains(be.Message, "not run again") || len(res.Stdout) != 0 {
		t.Fatalf("%+v %+v", be, res)
	}
	if helperRuns(e.fake) != 2 {
		t.Fatalf("%d helper runs", helperRuns(e.fake))
	}
	if r := run(t, s, "bash", "cat count.txt"); string(r.Stdout) != "run\n" {
		t.Fatalf("count.txt %q", r.Stdout)
	}
}

func TestCancelledRunStopsInTheVM(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	run(t, s, "bash", "true")
	cx, cancel := context.WithCancel(ctx(t))
	go func() {
		_ = e.fake.Await(ctx(t), func() bool {
			st, _ := e.fake.Sandbox(s.v.id())
			_, ok := st.Files["/project/workspace/started.txt"]
			return ok
		})
		cancel()
	}()
	_, err := s.Exec(cx, sandbox.ExecRequest{Language: "bash", Code: "touch started.txt; echo started; sleep 3; echo late > late.txt", Timeout: 30 * time.Second})
	wantCode(t, err, brokererr.Unavailable)
	terminated := false
	for _, c := range e.fake.PitcherCalls() {
		terminated = terminated || c.Method == "shell/terminate"
	}
	if !terminated {
		t.Fatal("the cancelled run's shell was not terminated")
	}
	time.Sleep(4 * time.Second)
	if r := run(t, s, "bash", "ls"); strings.Contains(string(r.Stdout), "late.txt") {
		t.Fatalf("the cancelled run went on: %q", r.Stdout)
	}
}
