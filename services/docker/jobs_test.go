package docker

import (
	"bufio"
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

// jobOutput is a JobSink that collects output and wakes waiters.
type jobOutput struct {
	mu   sync.Mutex
	out  map[string]*strings.Builder
	wake chan struct{}
}

func newJobOutput() *jobOutput {
	return &jobOutput{out: map[string]*strings.Builder{sandbox.StreamStdout: {}, sandbox.StreamStderr: {}}, wake: make(chan struct{}, 1)}
}

func (o *jobOutput) sink(stream string, data []byte) {
	o.mu.Lock()
	o.out[stream].Write(data)
	o.mu.Unlock()
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

func (o *jobOutput) text(stream string) string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.out[stream].String()
}

func (o *jobOutput) waitFor(t *testing.T, substr string) {
	t.Helper()
	deadline := time.NewTimer(60 * time.Second)
	defer deadline.Stop()
	for !strings.Contains(o.text(sandbox.StreamStdout), substr) {
		select {
		case <-o.wake:
		case <-deadline.C:
			t.Fatalf("stdout never contained %q; stdout %q stderr %q", substr, o.text(sandbox.StreamStdout), o.text(sandbox.StreamStderr))
		}
	}
}

func startJob(t *testing.T, s sandbox.Session, spec sandbox.JobSpec, o *jobOutput) sandbox.Job {
	t.Helper()
	if spec.Timeout == 0 {
		spec.Timeout = time.Minute
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	j, err := s.(sandbox.JobRunner).StartJob(ctx, spec, o.sink)
	if err != nil {
		t.Fatalf("StartJob(%q): %v", spec.Command, err)
	}
	t.Cleanup(func() {
		_ = j.Signal(context.Background(), syscall.SIGKILL)
		<-j.Done()
	})
	return j
}

func jobExit(t *testing.T, j sandbox.Job) sandbox.JobExit {
	t.Helper()
	select {
	case <-j.Done():
		return j.Exit()
	case <-time.After(time.Minute):
		t.Fatal("job did not end")
	}
	return sandbox.JobExit{}
}

func openSession(t *testing.T, e *Engine) sandbox.Session {
	t.Helper()
	s, err := e.Open(context.Background(), newRef(e))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Destroy(context.Background()) })
	return s
}

func TestJobStreamsAndStdin(t *testing.T) { forRuntimes(t, testJobStreamsAndStdin) }

func testJobStreamsAndStdin(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "python")
	s := openSession(t, e)
	o := newJobOutput()
	j := startJob(t, s, sandbox.JobSpec{Command: "for i in 1 2 3 4 5; do echo line$i; sleep 0.2; done; echo err >&2; pwd", Env: map[string]string{"A": "1"}}, o)
	o.waitFor(t, "line1\n")
	select {
	case <-j.Done():
		t.Fatal("the first line arrived only after the job ended")
	default:
	}
	x := jobExit(t, j)
	if x.Err != nil || x.ExitCode != 0 || x.TimedOut {
		t.Fatalf("exit %+v", x)
	}
	if got := o.text(sandbox.StreamStdout); got != "line1\nline2\nline3\nline4\nline5\n/mnt/data\n" {
		t.Fatalf("stdout %q", got)
	}
	if got := o.text(sandbox.StreamStderr); got != "err\n" {
		t.Fatalf("stderr %q", got)
	}
	if x.Duration < 800*time.Millisecond {
		t.Fatalf("duration %v", x.Duration)
	}
	// Without a Language the job runs in the python runner, whatever the
	// session ran before.
	if c := sessionContainer(t, s); c.lang != "python" {
		t.Fatalf("job container language %q", c.lang)
	}

	o = newJobOutput()
	j = startJob(t, s, sandbox.JobSpec{Command: "read l; echo got:$l; cat", Interactive: true}, o)
	ctx := context.Background()
	if err := j.WriteStdin(ctx, []byte("hello\n")); err != nil {
		t.Fatal(err)
	}
	o.waitFor(t, "got:hello\n")
	if err := j.WriteStdin(ctx, []byte("more\n")); err != nil {
		t.Fatal(err)
	}
	if err := j.CloseStdin(ctx); err != nil {
		t.Fatal(err)
	}
	if x := jobExit(t, j); x.ExitCode != 0 || o.text(sandbox.StreamStdout) != "got:hello\nmore\n" {
		t.Fatalf("exit %+v stdout %q", x, o.text(sandbox.StreamStdout))
	}

	// Timeout kills the job.
	o = newJobOutput()
	j = startJob(t, s, sandbox.JobSpec{Command: "sleep 1000", Timeout: 500 * time.Millisecond}, o)
	if x := jobExit(t, j); !x.TimedOut || x.Signal != "SIGKILL" {
		t.Fatalf("exit %+v", x)
	}
}

func TestJobSurvivesExecAndRelease(t *testing.T) {
	e := newEngine(t, nil)
	needRunner(t, e, "bash")
	s := openSession(t, e)
	ctx := context.Background()
	o := newJobOutput()
	// The job starts a session of its own while the run below is under
	// way (they hand over through files): without the job exemption the
	// stray check would replace the container, killing the job.
	j := startJob(t, s, sandbox.JobSpec{Language: "bash", Command: "echo ready; while [ ! -e go ]; do sleep 0.05; done; setsid sleep 999 & touch ack; while read l; do echo got:$l; done", Interactive: true}, o)
	o.waitFor(t, "ready\n")
	c := sessionContainer(t, s)

	// A run in the same container leaves daemons: the run's sweep kills
	// them, the job lives on, and the container is kept.
	res := exec1(t, s, "bash", "touch go; while [ ! -e ack ]; do sleep 0.05; done\nsetsid sleep 1000 >/dev/null 2>&1 &\n(setsid sleep 1001 >/dev/null 2>&1 &)\necho ran", 20*time.Second)
	if string(res.Stdout) != "ran\n" || res.ExitCode != 0 {
		t.Fatalf("exec %+v", res)
	}
	if got := sessionContainer(t, s); got != c {
		t.Fatal("the container was replaced while a job ran in it")
	}
	if err := j.WriteStdin(ctx, []byte("after-run\n")); err != nil {
		t.Fatal(err)
	}
	o.waitFor(t, "got:after-run\n")
	res = exec1(t, s, "bash", "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 100[01]' || true", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "0" {
		t.Fatalf("the run's daemons survived its sweep: %q", res.Stdout)
	}
	res = exec1(t, s, "bash", "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 999' || true", 20*time.Second)
	if strings.TrimSpace(string(res.Stdout)) != "1" {
		t.Fatalf("the job's own daemon was swept: %q", res.Stdout)
	}

	// Release refuses while the job runs and removes nothing.
	err := s.Release(ctx)
	if brokererr.CodeOf(err) != brokererr.Conflict {
		t.Fatalf("Release with a live job: %v", err)
	}
	if ins, err := e.cli.ContainerInspect(ctx, c.dockerID); err != nil || !ins.State.Running {
		t.Fatalf("container after the refused Release: %v", err)
	}
	if err := j.WriteStdin(ctx, []byte("after-release\n")); err != nil {
		t.Fatal(err)
	}
	o.waitFor(t, "got:after-release\n")

	// Once the job has ended, Release works.
	if err := j.CloseStdin(ctx); err != nil {
		t.Fatal(err)
	}
	if x := jobExit(t, j); x.ExitCode != 0 || x.Err != nil {
		t.Fatalf("exit %+v", x)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatalf("Release after the job: %v", err)
	}
	if list := listContainers(t, e.cli, LabelID+"="+c.id); len(list) != 0 {
		t.Fatal("container left after Release")
	}

	// Destroy ends a live job.
	o = newJobOutput()
	j = startJob(t, s, sandbox.JobSpec{Command: "echo ready; sleep 1000"}, o)
	o.waitFor(t, "ready\n")
	if err := s.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if x := jobExit(t, j); x.Err == nil && x.Signal == "" {
		t.Fatalf("job after Destroy: %+v", x)
	}
}

func TestJobEgressAndWorkDir(t *testing.T) { forRuntimes(t, testJobEgressAndWorkDir) }

func testJobEgressAndWorkDir(t *testing.T, rt string) {
	e := newEngine(t, func(o *Options) { o.Runtime = rt })
	needRunner(t, e, "bash")
	s := openSession(t, e)
	ctx := context.Background()
	got := make(chan string, 1)
	lns := make(chan net.Listener, 1)
	egress := func(ln net.Listener) {
		lns <- ln
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		line, _ := bufio.NewReader(c).ReadString('\n')
		got <- line
		_, _ = c.Write([]byte("pong\n"))
	}
	if err := s.WriteFile(ctx, "sub/dir/keep.txt", []byte("x"), false); err != nil {
		t.Fatal(err)
	}
	o := newJobOutput()
	cmd := `port=${HTTP_PROXY##*:}; exec 3<>/dev/tcp/127.0.0.1/$port; printf 'hello-from-job\n' >&3; read -r r <&3; echo "reply:$r"; pwd`
	j := startJob(t, s, sandbox.JobSpec{Command: cmd, WorkDir: "sub/dir", Egress: egress}, o)
	x := jobExit(t, j)
	if x.ExitCode != 0 {
		t.Fatalf("exit %+v stdout %q stderr %q", x, o.text(sandbox.StreamStdout), o.text(sandbox.StreamStderr))
	}
	select {
	case line := <-got:
		if line != "hello-from-job\n" {
			t.Fatalf("egress got %q", line)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the egress listener got nothing")
	}
	if out := o.text(sandbox.StreamStdout); out != "reply:pong\n/mnt/data/sub/dir\n" {
		t.Fatalf("stdout %q", out)
	}
	// The listener is closed and its socket removed with the job.
	if _, err := (<-lns).Accept(); err == nil {
		t.Fatal("egress listener still open")
	}
	c := sessionContainer(t, s)
	if m, _ := filepath.Glob(filepath.Join(c.runDir, "egress-*")); len(m) != 0 {
		t.Fatalf("egress socket left: %v", m)
	}

	// Working directories are checked on the host.
	if err := os.Symlink("/etc", filepath.Join(s.(*Session).ref.Dir, "link")); err != nil {
		t.Fatal(err)
	}
	for dir, code := range map[string]brokererr.Code{
		"link":             brokererr.PathTraversal,
		"link/ssl":         brokererr.PathTraversal,
		"../x":             brokererr.PathTraversal,
		"/etc":             brokererr.PathTraversal,
		"nope":             brokererr.FileNotFound,
		"sub/dir/keep.txt": brokererr.InvalidInput,
	} {
		_, err := s.(sandbox.JobRunner).StartJob(ctx, sandbox.JobSpec{Command: "pwd", WorkDir: dir, Timeout: time.Minute}, nil)
		if brokererr.CodeOf(err) != code {
			t.Errorf("WorkDir %q: %v, want %s", dir, err, code)
		}
	}
	if n := c.jobs.Load(); n != 0 {
		t.Fatalf("live job count %d after refusals", n)
	}
}
