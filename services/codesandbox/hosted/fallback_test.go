package hosted

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// TestFallbackOnlyForWorkNotStarted puts a second hosted backend (its own
// fake) behind the first: a run the first could not start goes to the
// second, a run whose outcome the first lost does not (it could run twice).
func TestFallbackOnlyForWorkNotStarted(t *testing.T) {
	old := runMargin
	runMargin = 2 * time.Second
	defer func() { runMargin = old }()
	a, b := newEnv(t, nil), newEnv(t, nil)
	var fellBack []error
	f := &sandbox.Fallback{Primary: a.b, Secondary: b.b, OnFallback: func(_ sandbox.SessionRef, err error) { fellBack = append(fellBack, err) }}
	s, err := f.Open(ctx(t), sandbox.SessionRef{WorkspaceID: wid1, Dir: a.dir(wid1), Principal: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	a.fake.Inject(csbfake.Fault{Status: http.StatusServiceUnavailable, N: 1, Path: "/sandbox/" + runnerTemplate + "/fork"})
	res, err := s.Exec(ctx(t), sandbox.ExecRequest{Language: "bash", Code: "echo b > b.txt; echo ran", Timeout: 20 * time.Second})
	if err != nil || string(res.Stdout) != "ran\n" || res.Backend != Name || len(fellBack) != 1 {
		t.Fatalf("%+v %v fell back %d times", res, err, len(fellBack))
	}
	if helperRuns(a.fake) != 0 || helperRuns(b.fake) != 1 {
		t.Fatalf("runs: primary %d, secondary %d", helperRuns(a.fake), helperRuns(b.fake))
	}
	// The primary is back, and finds the secondary's file in the workspace.
	res, err = s.Exec(ctx(t), sandbox.ExecRequest{Language: "bash", Code: "cat b.txt", Timeout: 20 * time.Second})
	if err != nil || string(res.Stdout) != "b\n" || helperRuns(a.fake) != 1 {
		t.Fatalf("back on the primary: %+v %v", res, err)
	}
	// A run the primary started and then lost is not run again anywhere.
	done := make(chan error, 1)
	go func() {
		_, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: "touch started.txt; sleep 3", Timeout: 3 * time.Second})
		done <- err
	}()
	id := a.vmID(wid1)
	if err := a.fake.Await(ctx(t), func() bool {
		st, _ := a.fake.Sandbox(id)
		return st.Files["/project/workspace/started.txt"] != nil
	}); err != nil {
		t.Fatal(err)
	}
	a.fake.HibernateVM(id)
	wantCode(t, <-done, brokererr.Unavailable)
	if helperRuns(b.fake) != 1 || len(fellBack) != 1 {
		t.Fatalf("a lost run went to the secondary: %d runs there", helperRuns(b.fake))
	}
}
