package projects_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// TestBuildRunnerRunsBuildInBackground: a sandbox that is no JobBuilder
// (CodeSandbox) still builds as a job: its Build runs past the starting
// call, and its output and exit code come out as a job's.
func TestBuildRunnerRunsBuildInBackground(t *testing.T) {
	m, _, _ := newManager(t)
	_, sb, err := m.Create(context.Background(), "alice", projects.CreateRequest{ProjectName: "nopkg", Template: "react",
		Files: map[string][]byte{"index.html": []byte("x")}}) // no package.json: the build fails
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := sb.(projects.JobBuilder); ok {
		t.Fatal("the CodeSandbox sandbox is a JobBuilder; this test needs one that is not")
	}
	r := projects.NewBuildRunner(sb, 1<<10)
	var sunk bytes.Buffer
	start, cancel := context.WithCancel(context.Background())
	job, err := r.StartJob(start, sandbox.JobSpec{ID: "exec_x"}, func(stream string, data []byte) {
		if stream == sandbox.StreamStdout {
			sunk.Write(data)
		}
	})
	cancel() // the call that started it is over; the build goes on
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-job.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the build did not end")
	}
	x := job.Exit()
	if x.ExitCode != 1 || x.Err != nil || x.TimedOut || x.Signal != "" || !bytes.Contains(sunk.Bytes(), []byte("package.json")) ||
		!bytes.Equal(r.Output(), sunk.Bytes()) {
		t.Fatalf("exit %+v, output %q, kept %q", x, sunk.Bytes(), r.Output())
	}
	if err := job.WriteStdin(context.Background(), []byte("y\n")); brokererr.CodeOf(err) != brokererr.Conflict {
		t.Fatalf("stdin to a build: %v", err)
	}
}
