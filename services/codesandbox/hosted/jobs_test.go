package hosted

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// sinkBuf collects a job's output.
type sinkBuf struct {
	mu       sync.Mutex
	out, err bytes.Buffer
	changed  chan struct{}
}

func newSink() *sinkBuf { return &sinkBuf{changed: make(chan struct{}, 1)} }

func (b *sinkBuf) sink(stream string, data []byte) {
	b.mu.Lock()
	if stream == sandbox.StreamStdout {
		b.out.Write(data)
	} else {
		b.err.Write(data)
	}
	b.mu.Unlock()
	select {
	case b.changed <- struct{}{}:
	default:
	}
}

func (b *sinkBuf) stdout() string { b.mu.Lock(); defer b.mu.Unlock(); return b.out.String() }
func (b *sinkBuf) stderr() string { b.mu.Lock(); defer b.mu.Unlock(); return b.err.String() }

// waitFor waits until stdout contains s.
func (b *sinkBuf) waitFor(t *testing.T, s string) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for !strings.Contains(b.stdout(), s) {
		select {
		case <-b.changed:
		case <-deadline:
			t.Fatalf("no %q in %q", s, b.stdout())
		}
	}
}

func startJob(t *testing.T, s *Session, spec sandbox.JobSpec) (sandbox.Job, *sinkBuf) {
	t.Helper()
	b := newSink()
	if spec.Timeout == 0 {
		spec.Timeout = 30 * time.Second
	}
	j, err := s.StartJob(ctx(t), spec, b.sink)
	if err != nil {
		t.Fatal(err)
	}
	return j, b
}

func waitJob(t *testing.T, j sandbox.Job) sandbox.JobExit {
	t.Helper()
	select {
	case <-j.Done():
		return j.Exit()
	case <-time.After(60 * time.Second):
		t.Fatal("job did not end")
	}
	return sandbox.JobExit{}
}

func TestJobStreamsAndCopiesBack(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	if err := s.WriteFile(ctx(t), "sub/in.txt", []byte("input"), false); err != nil {
		t.Fatal(err)
	}
	j, b := startJob(t, s, sandbox.JobSpec{ID: "j1", WorkDir: "sub", Env: map[string]string{"GREETING": "hey"},
		Command: `echo "$GREETING $(cat in.txt)"; for i in 1 2 3; do echo e$i >&2; done; printf 'raw\r\n\x1b[0m'; echo made > out.txt; exit 4`})
	x := waitJob(t, j)
	if x.Err != nil || x.ExitCode != 4 || x.TimedOut {
		t.Fatalf("exit %+v", x)
	}
	if b.stdout() != "hey input\nraw\r\n\x1b[0m" || b.stderr() != "e1\ne2\ne3\n" {
		t.Fatalf("stdout %q stderr %q", b.stdout(), b.stderr())
	}
	// The job's files are on the host once it is reported ended.
	if got, err := os.ReadFile(filepath.Join(e.dir(wid1), "sub", "out.txt")); err != nil || string(got) != "made\n" {
		t.Fatalf("out.txt %q %v", got, err)
	}
	if r, ok := j.(sandbox.BackendReporter); !ok || r.Backend() != Name {
		t.Fatal("the job does not say which backend runs it")
	}
}

func TestInteractiveJob(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	j, b := startJob(t, s, sandbox.JobSpec{Command: "echo ready; cat; echo eof", Interactive: true})
	b.waitFor(t, "ready\n")
	// Bytes a terminal would mangle reach stdin as they are, then EOF.
	in := []byte("line one\n\x03\x04\r\nnot a signal\n" + strings.Repeat("z", 10000))
	if err := j.WriteStdin(ctx(t), in); err != nil {
		t.Fatal(err)
	}
	if err := j.CloseStdin(ctx(t)); err != nil {
		t.Fatal(err)
	}
	x := waitJob(t, j)
	if x.ExitCode != 0 || b.stdout() != "ready\n"+string(in)+"eof\n" {
		t.Fatalf("exit %+v stdout %q", x, b.stdout())
	}
	if err := j.WriteStdin(ctx(t), []byte("late")); err == nil {
		t.Fatal("stdin accepted after the end")
	}
}

func TestJobSignalAndTimeout(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	j, b := startJob(t, s, sandbox.JobSpec{Command: "trap 'echo got TERM; exit 7' TERM; echo ready; while true; do sleep 0.1; done"})
	b.waitFor(t, "ready\n")
	if err := j.Signal(ctx(t), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if x := waitJob(t, j); x.ExitCode != 7 || !strings.Contains(b.stdout(), "got TERM") {
		t.Fatalf("%+v %q", x, b.stdout())
	}
	start := time.Now()
	j, _ = startJob(t, s, sandbox.JobSpec{Command: "sleep 60", Timeout: time.Second})
	if x := waitJob(t, j); !x.TimedOut || x.Signal != "SIGKILL" || time.Since(start) > 20*time.Second {
		t.Fatalf("timeout %+v after %v", x, time.Since(start))
	}
	// A job runs beside run_code.
	j, b = startJob(t, s, sandbox.JobSpec{Command: "echo up; sleep 2; echo down"})
	b.waitFor(t, "up\n")
	if r := run(t, s, "bash", "echo run"); string(r.Stdout) != "run\n" {
		t.Fatalf("run beside a job: %q", r.Stdout)
	}
	if x := waitJob(t, j); x.ExitCode != 0 || b.stdout() != "up\ndown\n" {
		t.Fatalf("%+v %q", x, b.stdout())
	}
}

func TestJobRefusals(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	_, err := s.StartJob(ctx(t), sandbox.JobSpec{Command: "true", Egress: func(net.Listener) {}}, nil)
	wantCode(t, err, brokererr.InvalidInput)
	_, err = s.StartJob(ctx(t), sandbox.JobSpec{Command: "true", WorkDir: "../etc"}, nil)
	if err == nil {
		t.Fatal("workdir outside the workspace accepted")
	}
	_, err = s.StartJob(ctx(t), sandbox.JobSpec{Command: "true", WorkDir: "missing"}, nil)
	wantCode(t, err, brokererr.InvalidInput)
	if helperRuns(e.fake) != 1 { // only the job whose directory was missing got to the VM
		t.Fatalf("%d helper runs", helperRuns(e.fake))
	}
	// A dropped connection after the start: its end is still learned.
	j, b := startJob(t, s, sandbox.JobSpec{Command: "echo ready; sleep 2; echo x > after.txt; exit 3"})
	b.waitFor(t, "ready\n")
	if e.fake.DropConnections(s.v.id()) == 0 {
		t.Fatal("no connection")
	}
	x := waitJob(t, j)
	if x.Err != nil || x.ExitCode != 3 || !strings.Contains(b.stderr(), "dropped") {
		t.Fatalf("after the drop: %+v %q", x, b.stderr())
	}
	if _, err := os.Stat(filepath.Join(e.dir(wid1), "after.txt")); err != nil {
		t.Fatalf("files of a job that outlived its connection: %v", err)
	}
	_ = context.Background
}
