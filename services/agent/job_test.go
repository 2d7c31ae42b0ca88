package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// recorder is a JobSink that keeps every call and wakes waiters.
type recorder struct {
	mu      sync.Mutex
	calls   []struct{ stream, data string }
	wake    chan struct{}
	active  bool // a sink call is in progress (detects overlap)
	overlap bool
}

func newRecorder() *recorder { return &recorder{wake: make(chan struct{}, 1)} }

func (r *recorder) sink(stream string, data []byte) {
	r.mu.Lock()
	if r.active {
		r.overlap = true
	}
	r.active = true
	r.calls = append(r.calls, struct{ stream, data string }{stream, string(data)})
	r.mu.Unlock()
	r.mu.Lock()
	r.active = false
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *recorder) text(stream string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	for _, c := range r.calls {
		if c.stream == stream {
			b.WriteString(c.data)
		}
	}
	return b.String()
}

// waitFor waits until stream contains substr.
func (r *recorder) waitFor(t *testing.T, stream, substr string) {
	t.Helper()
	deadline := time.NewTimer(20 * time.Second)
	defer deadline.Stop()
	for !strings.Contains(r.text(stream), substr) {
		select {
		case <-r.wake:
		case <-deadline.C:
			t.Fatalf("%s never contained %q; got %q", stream, substr, r.text(stream))
		}
	}
}

func (ta *testAgent) startJob(t *testing.T, req JobRequest, sink sandbox.JobSink) *clientJob {
	t.Helper()
	if req.TimeoutMS == 0 {
		req.TimeoutMS = 30_000
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	j, err := StartJob(ctx, ta.sock, req, sink)
	if err != nil {
		t.Fatalf("StartJob(%q): %v", req.Command, err)
	}
	cj := j.(*clientJob)
	t.Cleanup(func() {
		_ = cj.Signal(context.Background(), syscall.SIGKILL)
		<-cj.Done()
	})
	return cj
}

func waitDone(t *testing.T, j sandbox.Job) sandbox.JobExit {
	t.Helper()
	select {
	case <-j.Done():
		return j.Exit()
	case <-time.After(30 * time.Second):
		t.Fatal("job did not end")
	}
	return sandbox.JobExit{}
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	p, ok := parseStat(b)
	return ok && p.state != 'Z' && p.state != 'X'
}

func waitGone(t *testing.T, pids ...int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range pids {
		for alive(pid) {
			if time.Now().After(deadline) {
				t.Fatalf("process %d still alive", pid)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

var pidLine = regexp.MustCompile(`(\w+):(\d+)`)

// pids extracts "name:pid" pairs from text.
func pids(t *testing.T, text string, names ...string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, m := range pidLine.FindAllStringSubmatch(text, -1) {
		n, _ := strconv.Atoi(m[2])
		out[m[1]] = n
	}
	for _, n := range names {
		if out[n] <= 1 {
			t.Fatalf("no pid for %q in %q", n, text)
		}
	}
	return out
}

func TestJobStreaming(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	rec := newRecorder()
	j := ta.startJob(t, JobRequest{Command: "for i in 1 2 3; do echo line$i; echo err$i >&2; sleep 0.3; done; printf partial; sleep 0.5; echo end"}, rec.sink)
	rec.waitFor(t, "stdout", "line1\n")
	select {
	case <-j.Done():
		t.Fatal("first line arrived only after the job ended")
	default:
	}
	// A partial line is flushed after JobFlushDelay, not held until the
	// newline.
	rec.waitFor(t, "stdout", "partial")
	if strings.Contains(rec.text("stdout"), "end") {
		t.Fatal("partial line was held back until the newline")
	}
	x := waitDone(t, j)
	if x.Err != nil || x.ExitCode != 0 || x.Signal != "" || x.TimedOut {
		t.Fatalf("exit %+v", x)
	}
	if got := rec.text("stdout"); got != "line1\nline2\nline3\npartialend\n" {
		t.Fatalf("stdout %q", got)
	}
	if got := rec.text("stderr"); got != "err1\nerr2\nerr3\n" {
		t.Fatalf("stderr %q", got)
	}
	if x.Duration < 1400*time.Millisecond {
		t.Fatalf("duration %v", x.Duration)
	}
	rec.mu.Lock()
	overlap := rec.overlap
	rec.mu.Unlock()
	if overlap {
		t.Fatal("sink calls overlapped")
	}
	// Big output is chunked within MaxJobChunk and arrives complete.
	rec2 := newRecorder()
	j = ta.startJob(t, JobRequest{Command: "head -c 200000 /dev/zero | tr '\\0' a"}, rec2.sink)
	waitDone(t, j)
	if got := rec2.text("stdout"); got != strings.Repeat("a", 200000) {
		t.Fatalf("big output: %d bytes", len(got))
	}
	for _, c := range rec2.calls {
		if len(c.data) > MaxJobChunk {
			t.Fatalf("chunk of %d bytes", len(c.data))
		}
	}
	// Env, working directory and exit code.
	rec3 := newRecorder()
	j = ta.startJob(t, JobRequest{Command: "echo $FOO $HOME; pwd; exit 3", Env: []string{"FOO=bar baz"}}, rec3.sink)
	if x := waitDone(t, j); x.ExitCode != 3 {
		t.Fatalf("exit %+v", x)
	}
	if got, want := rec3.text("stdout"), "bar baz /tmp\n"+ta.workDir+"\n"; got != want {
		t.Fatalf("stdout %q, want %q", got, want)
	}
}

func TestJobStdin(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	ctx := context.Background()
	rec := newRecorder()
	j := ta.startJob(t, JobRequest{Command: "read line; echo got:$line; read l2; echo got2:$l2; cat | wc -c", Interactive: true}, rec.sink)
	if err := j.WriteStdin(ctx, []byte("hello\n")); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, "stdout", "got:hello\n")
	// Larger than one frame: split and delivered in order.
	big := append([]byte("second\n"), bytes.Repeat([]byte("x"), 3*MaxJobChunk+5)...)
	if err := j.WriteStdin(ctx, big); err != nil {
		t.Fatal(err)
	}
	if err := j.CloseStdin(ctx); err != nil {
		t.Fatal(err)
	}
	if err := j.WriteStdin(ctx, []byte("late")); err == nil {
		t.Fatal("WriteStdin after CloseStdin succeeded")
	}
	if x := waitDone(t, j); x.ExitCode != 0 || x.Err != nil {
		t.Fatalf("exit %+v", x)
	}
	if got, want := rec.text("stdout"), fmt.Sprintf("got:hello\ngot2:second\n%d\n", 3*MaxJobChunk+5); got != want {
		t.Fatalf("stdout %q, want %q", got, want)
	}
	if err := j.WriteStdin(ctx, []byte("x")); err == nil {
		t.Fatal("WriteStdin after the end succeeded")
	}

	// Not interactive: stdin is /dev/null and writes are refused.
	rec = newRecorder()
	j = ta.startJob(t, JobRequest{Command: "cat; echo eof"}, rec.sink)
	if err := j.WriteStdin(ctx, []byte("x")); err == nil {
		t.Fatal("WriteStdin on a non-interactive job succeeded")
	}
	waitDone(t, j)
	if rec.text("stdout") != "eof\n" {
		t.Fatalf("stdout %q", rec.text("stdout"))
	}

	// A job that never reads: the write waits (ctx gives up), signals still
	// get through, and the next write waits for the pending one.
	rec = newRecorder()
	j = ta.startJob(t, JobRequest{Command: "echo ready; sleep 1000", Interactive: true}, rec.sink)
	rec.waitFor(t, "stdout", "ready")
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := j.WriteStdin(wctx, bytes.Repeat([]byte("y"), 4*MaxJobChunk)) // > pipe buffer
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked write: %v", err)
	}
	if err := j.Signal(ctx, syscall.SIGTERM); err != nil {
		t.Fatalf("signal behind a blocked write: %v", err)
	}
	if x := waitDone(t, j); x.Signal != "SIGTERM" {
		t.Fatalf("exit %+v", x)
	}
}

// A write the job consumed right before it exited is acknowledged as
// written: the agent sends its ack before the exit frame, so send_stdin
// never reports failure for input that was delivered (a race seen under
// load in the end-to-end jobs test).
func TestJobStdinConsumedAtExitIsAcknowledged(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	ctx := context.Background()
	for i := 0; i < 200; i++ { // the race shows in about one run in 200
		rec := newRecorder()
		j := ta.startJob(t, JobRequest{Command: "read -r l; echo got:$l", Interactive: true}, rec.sink)
		if err := j.WriteStdin(ctx, []byte("x\n")); err != nil {
			t.Fatalf("run %d: WriteStdin of input the job read: %v", i, err)
		}
		if x := waitDone(t, j); x.ExitCode != 0 || rec.text("stdout") != "got:x\n" {
			t.Fatalf("run %d: exit %+v, stdout %q", i, x, rec.text("stdout"))
		}
	}
}

// TestJobStdinPartialWriteIsCounted: when a job stops reading part-way
// through a write, the error says how much is in its stdin and how much is
// queued, and exactly that much reaches the job once it reads again.
func TestJobStdinPartialWriteIsCounted(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	ctx := context.Background()
	rec := newRecorder()
	// The job forks nothing while the signal may arrive: the trap
	// interrupts the wait builtin at once (a fork loop left a window in
	// which a pre-exec child could take the signal's trap).
	j := ta.startJob(t, JobRequest{Command: "trap 'wc -c; exit 0' HUP; sleep 1000 & echo ready; wait", Interactive: true}, rec.sink)
	rec.waitFor(t, "stdout", "ready")
	data := bytes.Repeat([]byte("z"), 8*MaxJobChunk) // well past a pipe buffer
	wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	err := j.WriteStdin(wctx, data)
	cancel()
	var part *sandbox.PartialStdinError
	if !errors.As(err, &part) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked write: %v, want a PartialStdinError", err)
	}
	if part.Total != len(data) || part.Written <= 0 || part.Queued != MaxJobChunk || part.Written+part.Queued >= part.Total {
		t.Fatalf("partial write %+v", part)
	}
	// The job reads again: the queued chunk follows, then EOF.
	if err := j.Signal(ctx, syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if err := j.CloseStdin(ctx); err != nil {
		t.Fatalf("close after the queued chunk: %v", err)
	}
	if x := waitDone(t, j); x.ExitCode != 0 {
		t.Fatalf("exit %+v, partial write %+v, stdout %q, stderr %q", x, part, rec.text("stdout"), rec.text("stderr"))
	}
	if got, want := strings.TrimSpace(rec.text("stdout")), fmt.Sprintf("ready\n%d", part.Written+part.Queued); got != want {
		t.Fatalf("stdout %q, want %q", got, want)
	}
}

func TestJobSignals(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	ctx := context.Background()
	rec := newRecorder()
	j := ta.startJob(t, JobRequest{Command: "trap 'echo term; exit 7' TERM; echo ready; while :; do sleep 0.05; done"}, rec.sink)
	rec.waitFor(t, "stdout", "ready")
	if err := j.Signal(ctx, syscall.SIGUSR1); err == nil {
		t.Fatal("SIGUSR1 was accepted")
	}
	if err := j.Signal(ctx, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if x := waitDone(t, j); x.ExitCode != 7 || x.Signal != "" {
		t.Fatalf("exit %+v", x)
	}
	if !strings.Contains(rec.text("stdout"), "term\n") {
		t.Fatalf("trap did not run: %q", rec.text("stdout"))
	}
	// Signalling an ended job is a no-op.
	if err := j.Signal(ctx, syscall.SIGKILL); err != nil {
		t.Fatalf("signal after end: %v", err)
	}
	rec = newRecorder()
	j = ta.startJob(t, JobRequest{Command: "echo ready; sleep 1000"}, rec.sink)
	rec.waitFor(t, "stdout", "ready")
	if err := j.Signal(ctx, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if x := waitDone(t, j); x.Signal != "SIGINT" {
		t.Fatalf("exit %+v", x)
	}
}

func TestJobTimeoutKillsTree(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	rec := newRecorder()
	start := time.Now()
	j := ta.startJob(t, JobRequest{Command: "trap '' TERM; sleep 1000 & echo bg:$!; setsid sleep 1001 & echo sid:$!; sleep 1000", TimeoutMS: 700}, rec.sink)
	rec.waitFor(t, "stdout", "sid:")
	p := pids(t, rec.text("stdout"), "bg", "sid")
	x := waitDone(t, j)
	if !x.TimedOut || x.Signal != "SIGKILL" || x.Err != nil {
		t.Fatalf("exit %+v", x)
	}
	if d := time.Since(start); d > 8*time.Second {
		t.Fatalf("took %v", d)
	}
	waitGone(t, p["bg"], p["sid"], j.PID())
}

func TestJobSurvivesRunSweep(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	rec := newRecorder()
	j := ta.startJob(t, JobRequest{Command: "sleep 1000 & echo child:$!; setsid sleep 1002 & echo sid:$!; echo ready; while :; do sleep 0.05; done"}, rec.sink)
	rec.waitFor(t, "stdout", "ready")
	p := pids(t, rec.text("stdout"), "child", "sid")
	resp := ta.run(t, Request{Code: "setsid sleep 1001 >/dev/null 2>&1 & echo $!\nsleep 1003 >/dev/null 2>&1 &", TimeoutMS: 10_000})
	if resp.Error != "" || resp.ExitCode != 0 {
		t.Fatalf("run: %+v", resp)
	}
	daemon, err := strconv.Atoi(strings.TrimSpace(string(resp.Stdout)))
	if err != nil {
		t.Fatalf("run stdout %q", resp.Stdout)
	}
	waitGone(t, daemon) // the run's daemon was swept...
	for name, pid := range map[string]int{"job": j.PID(), "child": p["child"], "sid": p["sid"]} {
		if !alive(pid) { // ...the job's processes were not
			t.Fatalf("job process %s (%d) killed by the run's sweep", name, pid)
		}
	}
	select {
	case <-j.Done():
		t.Fatalf("job ended: %+v", j.Exit())
	default:
	}
	// The job still works end to end.
	if err := j.Signal(context.Background(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if x := waitDone(t, j); x.Signal != "SIGKILL" {
		t.Fatalf("exit %+v", x)
	}
	waitGone(t, p["child"], p["sid"])
	assertNoLeftovers(t)
}

func TestJobLeftoversKilledAtEnd(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	rec := newRecorder()
	start := time.Now()
	// bg stays in the session, sid leaves it but stays a child of bash,
	// orphan leaves both (setsid, then its parent exits).
	j := ta.startJob(t, JobRequest{Command: "sleep 1000 & echo bg:$!; setsid sleep 1001 & echo sid:$!; (setsid sleep 1002 & echo orphan:$!); echo done"}, rec.sink)
	x := waitDone(t, j)
	if x.ExitCode != 0 || x.Err != nil {
		t.Fatalf("exit %+v", x)
	}
	if d := time.Since(start); d > 8*time.Second {
		t.Fatalf("job held open by its leftovers for %v", d)
	}
	p := pids(t, rec.text("stdout"), "bg", "sid", "orphan")
	waitGone(t, p["bg"], p["sid"], p["orphan"])
	assertNoLeftovers(t)
}

func TestJobConnectionDropKills(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	rec := newRecorder()
	j := ta.startJob(t, JobRequest{Command: "sleep 1000 & echo bg:$!; echo ready; sleep 1000"}, rec.sink)
	rec.waitFor(t, "stdout", "ready")
	p := pids(t, rec.text("stdout"), "bg")
	j.c.Close()
	x := waitDone(t, j)
	if x.Err == nil {
		t.Fatalf("lost connection not reported: %+v", x)
	}
	waitGone(t, j.PID(), p["bg"])
}

func TestJobCap(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	var jobs []*clientJob
	for range MaxJobs {
		jobs = append(jobs, ta.startJob(t, JobRequest{Command: "sleep 1000"}, nil))
	}
	_, err := StartJob(context.Background(), ta.sock, JobRequest{Command: "echo too many", TimeoutMS: 1000}, nil)
	var je *JobError
	if !errors.As(err, &je) || je.Kind != JobErrLimit {
		t.Fatalf("job over the cap: %v", err)
	}
	// Runs are not limited by jobs.
	if resp := ta.run(t, Request{Code: "echo run"}); string(resp.Stdout) != "run\n" {
		t.Fatalf("run beside %d jobs: %+v", MaxJobs, resp)
	}
	_ = jobs[0].Signal(context.Background(), syscall.SIGKILL)
	waitDone(t, jobs[0])
	// The slot is free once the ended job's cleanup is done.
	deadline := time.Now().Add(10 * time.Second)
	for {
		j, err := StartJob(context.Background(), ta.sock, JobRequest{Command: "exit 0", TimeoutMS: 1000}, nil)
		if err == nil {
			waitDone(t, j)
			break
		}
		if !errors.As(err, &je) || je.Kind != JobErrLimit || time.Now().After(deadline) {
			t.Fatalf("after freeing a slot: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestJobRefusals(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	outside := t.TempDir()
	if err := os.Mkdir(filepath.Join(ta.workDir, "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(ta.workDir, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ta.workDir, "file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	egressOutside := filepath.Join(outside, "e.sock")
	ln, err := net.Listen("unix", egressOutside)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cases := []struct {
		name string
		req  JobRequest
		want string
	}{
		{"empty", JobRequest{Command: "  "}, "empty"},
		{"outside", JobRequest{Command: "pwd", WorkDir: outside}, "outside"},
		{"symlink-escape", JobRequest{Command: "pwd", WorkDir: filepath.Join(ta.workDir, "escape")}, "outside"},
		{"dotdot", JobRequest{Command: "pwd", WorkDir: ta.workDir + "/sub/../.."}, "outside"},
		{"relative", JobRequest{Command: "pwd", WorkDir: "sub"}, "absolute"},
		{"missing", JobRequest{Command: "pwd", WorkDir: ta.workDir + "/nope"}, "does not exist"},
		{"file", JobRequest{Command: "pwd", WorkDir: ta.workDir + "/file"}, "not a directory"},
		{"env-key", JobRequest{Command: "env", Env: []string{"A-B=1"}}, "environment"},
		{"env-no-eq", JobRequest{Command: "env", Env: []string{"AB"}}, "environment"},
		{"env-nul", JobRequest{Command: "env", Env: []string{"A=\x00"}}, "environment"},
		{"egress-outside", JobRequest{Command: "true", EgressSocket: egressOutside}, "egress_socket"},
		{"egress-agent", JobRequest{Command: "true", EgressSocket: ta.sock}, "egress_socket"},
		{"egress-missing", JobRequest{Command: "true", EgressSocket: filepath.Join(filepath.Dir(ta.sock), "none.sock")}, "not a socket"},
	}
	for _, c := range cases {
		c.req.TimeoutMS = 5000
		_, err := StartJob(context.Background(), ta.sock, c.req, nil)
		var je *JobError
		if !errors.As(err, &je) || je.Kind != JobErrInvalid || !strings.Contains(je.Message, c.want) {
			t.Errorf("%s: %v, want an invalid-kind refusal containing %q", c.name, err, c.want)
		}
	}
	if _, err := StartJob(context.Background(), ta.sock, JobRequest{Command: "true", TimeoutMS: MaxTimeoutMS + 1}, nil); err == nil {
		t.Error("oversized timeout accepted")
	}
	// Inside the workspace, through a symlink that stays inside: fine.
	if err := os.Symlink("sub", filepath.Join(ta.workDir, "alias")); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	j := ta.startJob(t, JobRequest{Command: "pwd", WorkDir: filepath.Join(ta.workDir, "alias")}, rec.sink)
	waitDone(t, j)
	if got := rec.text("stdout"); got != filepath.Join(ta.workDir, "sub")+"\n" {
		t.Fatalf("pwd %q", got)
	}
	// Raw protocol: an unknown op and unknown fields are refused.
	for _, line := range []string{`{"op":"shell","command":"id"}`, `{"op":"job","command":"id","evil":1}`} {
		resp := rawExchange(t, ta.sock, []byte(line+"\n"))
		if !strings.Contains(resp.Error, "bad request") {
			t.Errorf("%s: %+v", line, resp)
		}
	}
	// A client that breaks the frame protocol loses its job.
	c, err := net.Dial("unix", ta.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b, _ := json.Marshal(struct {
		Op string `json:"op"`
		JobRequest
	}{OpJob, JobRequest{Command: "sleep 1000", TimeoutMS: 30_000}})
	_, _ = c.Write(append(b, '\n'))
	br := bufio.NewReader(c)
	f, err := readFrame(br)
	if err != nil || f.T != FrameStarted {
		t.Fatalf("start: %+v %v", f, err)
	}
	_, _ = c.Write([]byte("{\"t\":\"stdin\",\"bogus\":true}\n"))
	_ = c.SetReadDeadline(time.Now().Add(15 * time.Second))
	for {
		f, err := readFrame(br)
		if err != nil {
			t.Fatalf("no exit frame: %v", err)
		}
		if f.T == FrameExit {
			if f.Signal != "SIGKILL" {
				t.Fatalf("exit %+v", f)
			}
			break
		}
	}
	waitGone(t, f.PID)
}

func TestJobEgress(t *testing.T) {
	ta := startAgent(t, Options{Language: LangBash})
	sock := filepath.Join(filepath.Dir(ta.sock), "egress.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		line, _ := bufio.NewReader(c).ReadString('\n')
		got <- line
		_, _ = c.Write([]byte("pong\n"))
	}()
	rec := newRecorder()
	cmd := `port=${HTTP_PROXY##*:}; echo port:$port
exec 3<>/dev/tcp/127.0.0.1/$port; printf 'hello-egress\n' >&3; read -r reply <&3; echo "reply:$reply"
echo "env:$HTTPS_PROXY|$ALL_PROXY|$http_proxy|$https_proxy|$all_proxy|NO=${NO_PROXY-unset}|no=${no_proxy-unset}"`
	j := ta.startJob(t, JobRequest{Command: cmd, EgressSocket: sock, Env: []string{"HTTP_PROXY=http://evil:1"}}, rec.sink)
	x := waitDone(t, j)
	out := rec.text("stdout")
	if x.ExitCode != 0 {
		t.Fatalf("exit %+v, stdout %q stderr %q", x, out, rec.text("stderr"))
	}
	select {
	case line := <-got:
		if line != "hello-egress\n" {
			t.Fatalf("egress server got %q", line)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("egress server got nothing")
	}
	port := pids(t, out, "port")["port"]
	proxy := "http://127.0.0.1:" + strconv.Itoa(port)
	if !strings.Contains(out, "reply:pong\n") {
		t.Fatalf("stdout %q", out)
	}
	if want := "env:" + strings.Repeat(proxy+"|", 5) + "NO=|no=\n"; !strings.Contains(out, want) {
		t.Fatalf("stdout %q lacks %q", out, want)
	}
	// The listener is gone with the job.
	if c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second); err == nil {
		c.Close()
		t.Fatal("egress port still open after the job ended")
	}
}

func TestJobClientRejectsHostileAgent(t *testing.T) {
	started := `{"t":"started","pid":5}` + "\n"
	cases := []struct {
		name   string
		answer string
		start  bool // StartJob succeeds
	}{
		{"refusal", `{"t":"error","kind":"weird","error":"no"}` + "\n", false},
		{"not-a-frame", `{"exit_code":0}` + "\n", false},
		{"exit-first", `{"t":"exit"}` + "\n", false},
		{"garbage-after-start", started + "nope\n", true},
		{"bad-stream", started + `{"t":"out","s":"stdin","d":"eA=="}` + "\n", true},
		{"huge-frame", started + `{"t":"out","s":"stdout","d":"` + strings.Repeat("A", MaxJobFrameBytes) + `"}` + "\n", true},
		{"oversized-chunk", started + `{"t":"out","s":"stdout","d":"` + strings.Repeat("A", (MaxJobChunk+3)/3*4) + `"}` + "\n", true},
		{"eof", started, true},
	}
	for _, c := range cases {
		j, err := StartJob(context.Background(), fakeAgent(t, []byte(c.answer)), JobRequest{Command: "x", TimeoutMS: 1000}, nil)
		if !c.start {
			if err == nil {
				t.Errorf("%s: started", c.name)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if x := waitDone(t, j); x.Err == nil {
			t.Errorf("%s: exit %+v without error", c.name, x)
		}
	}
	// A refusal keeps only known kinds.
	_, err := StartJob(context.Background(), fakeAgent(t, []byte(cases[0].answer)), JobRequest{Command: "x"}, nil)
	var je *JobError
	if !errors.As(err, &je) || je.Kind != JobErrInternal {
		t.Fatalf("refusal: %v", err)
	}
	// A good exit frame, with a hostile signal name.
	j, err := StartJob(context.Background(), fakeAgent(t, []byte(started+`{"t":"out","s":"stdout","d":"aGk="}`+"\n"+`{"t":"exit","code":3,"signal":"SIG\u001b[31m"}`+"\n")), JobRequest{Command: "x"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if x := waitDone(t, j); x.Err != nil || x.ExitCode != 3 || x.Signal != "SIG?" {
		t.Fatalf("exit %+v", x)
	}
}

func TestJobMembers(t *testing.T) {
	// 10 leads a job session; 11 is in it; 12 left it (setsid) but is 11's
	// child; 13 is unrelated; 14 is 13's child.
	procs := []procInfo{{pid: 10, ppid: 1, sid: 10}, {pid: 11, ppid: 10, sid: 10}, {pid: 12, ppid: 11, sid: 12},
		{pid: 13, ppid: 1, sid: 13}, {pid: 14, ppid: 13, sid: 13}}
	m := jobMembers(procs, func(p procInfo) bool { return p.sid == 10 })
	if fmt.Sprint(m) != "map[10:true 11:true 12:true]" {
		t.Fatalf("members %v", m)
	}
}

func FuzzParseFirstLine(f *testing.F) {
	f.Add([]byte(`{"code":"print(1)"}`))
	f.Add([]byte(`{"op":"job","command":"ls","env":["A=1"],"timeout_ms":5}`))
	f.Add([]byte(`{"op":"nope"}`))
	f.Add([]byte(`{"op":null,"code":"x"}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		req, jreq, err := parseFirstLine(line)
		if err != nil {
			if jreq != nil || req != (Request{}) {
				t.Fatal("error with a result")
			}
			return
		}
		if jreq != nil {
			// A job request round-trips through its own encoding.
			b, _ := json.Marshal(struct {
				Op string `json:"op"`
				JobRequest
			}{OpJob, *jreq})
			_, again, err := parseFirstLine(b)
			if err != nil || again == nil || again.Command != jreq.Command {
				t.Fatalf("round trip of %q: %v", b, err)
			}
		}
	})
}

func FuzzJobFrame(f *testing.F) {
	f.Add([]byte(`{"t":"out","s":"stdout","d":"aGk="}` + "\n"))
	f.Add([]byte(`{"t":"exit","code":1,"signal":"SIGKILL"}`))
	f.Add([]byte(`{"t":"ack","id":3,"error":"x"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		fr, err := readFrame(bufio.NewReader(bytes.NewReader(data)))
		if err != nil {
			return
		}
		s := cleanSignal(fr.Signal)
		if s != "" && s != "SIG?" && !regexp.MustCompile(`^SIG[A-Z0-9]{1,9}$`).MatchString(s) {
			t.Fatalf("cleanSignal(%q) = %q", fr.Signal, s)
		}
		if i := bytes.IndexByte(data, '\n'); i > MaxJobFrameBytes || i < 0 && len(data) > MaxJobFrameBytes {
			t.Fatalf("accepted a frame line of more than %d bytes", MaxJobFrameBytes)
		}
	})
}

// TestJobSignalsWorkWhenTheAgentInheritsThemIgnored: an agent started with
// SIGHUP and SIGINT ignored (a broker under nohup, a shell's `&`) still
// gives its jobs the default dispositions, so a job can trap the HUP and
// INT the job tools send. The test re-runs itself with both ignored.
func TestJobSignalsWorkWhenTheAgentInheritsThemIgnored(t *testing.T) {
	if os.Getenv("AGENT_TEST_SIGNALS_IGNORED") == "1" {
		if !signal.Ignored(syscall.SIGHUP) || !signal.Ignored(syscall.SIGINT) {
			t.Fatal("the helper did not start with SIGHUP and SIGINT ignored")
		}
		ta := startAgent(t, Options{Language: LangBash})
		rec := newRecorder()
		j := ta.startJob(t, JobRequest{Command: "grep '^SigIgn:' /proc/self/status"}, rec.sink)
		if x := waitDone(t, j); x.ExitCode != 0 {
			t.Fatalf("exit %+v, stderr %q", x, rec.text("stderr"))
		}
		_, mask, _ := strings.Cut(strings.TrimSpace(rec.text("stdout")), ":")
		ignored, err := strconv.ParseUint(strings.TrimSpace(mask), 16, 64)
		if err != nil {
			t.Fatalf("SigIgn line %q: %v", rec.text("stdout"), err)
		}
		if hupInt := uint64(1<<(syscall.SIGHUP-1) | 1<<(syscall.SIGINT-1)); ignored&hupInt != 0 {
			t.Fatalf("the job ignores signals %#x (SigIgn %#x)", ignored&hupInt, ignored)
		}
		return
	}
	cmd := exec.Command("/bin/sh", "-c", `trap "" HUP INT; exec "$0" -test.run='^TestJobSignalsWorkWhenTheAgentInheritsThemIgnored$' -test.count=1`, os.Args[0])
	cmd.Env = append(os.Environ(), "AGENT_TEST_SIGNALS_IGNORED=1")
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "PASS") {
		t.Fatalf("helper: %v\n%s", err, out)
	}
}
