package jobs

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// procRunner runs jobs as real host processes (bash in its own process
// group): the manager's logic is tested here; the sandboxes' job support is
// tested with real containers and bwrap in their own packages and tests/.
type procRunner struct{ dir string }

type procJob struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan struct{}
	exit  sandbox.JobExit
}

func (r procRunner) StartJob(ctx context.Context, spec sandbox.JobSpec, sink sandbox.JobSink) (sandbox.Job, error) {
	cmd := exec.Command("bash", "-c", spec.Command)
	cmd.Dir = r.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	j := &procJob{cmd: cmd, done: make(chan struct{})}
	if spec.Interactive {
		w, err := cmd.StdinPipe()
		if err != nil {
			return nil, err
		}
		j.stdin = w
	}
	outR, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	errR, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	pump := func(stream string, rd io.Reader) {
		defer wg.Done()
		buf := make([]byte, 4096)
		for {
			n, err := rd.Read(buf)
			if n > 0 {
				mu.Lock()
				sink(stream, buf[:n])
				mu.Unlock()
			}
			if err != nil {
				return
			}
		}
	}
	wg.Add(2)
	go pump(sandbox.StreamStdout, outR)
	go pump(sandbox.StreamStderr, errR)
	start := time.Now()
	go func() {
		var timedOut bool
		timer := time.AfterFunc(spec.Timeout, func() { timedOut = true; _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) })
		wg.Wait()
		err := cmd.Wait()
		timer.Stop()
		j.exit = sandbox.JobExit{Duration: time.Since(start), TimedOut: timedOut}
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				j.exit.Signal = "SIG" + strings.ToUpper(ws.Signal().String())
				j.exit.ExitCode = 128 + int(ws.Signal())
			} else {
				j.exit.ExitCode = ee.ExitCode()
			}
		}
		close(j.done)
	}()
	return j, nil
}

func (j *procJob) WriteStdin(_ context.Context, b []byte) error {
	if j.stdin == nil {
		return errors.New("no stdin")
	}
	_, err := j.stdin.Write(b)
	return err
}
func (j *procJob) CloseStdin(context.Context) error {
	if j.stdin == nil {
		return errors.New("no stdin")
	}
	return j.stdin.Close()
}
func (j *procJob) Signal(_ context.Context, sig syscall.Signal) error {
	return syscall.Kill(-j.cmd.Process.Pid, sig)
}
func (j *procJob) Done() <-chan struct{} { return j.done }
func (j *procJob) Exit() sandbox.JobExit { return j.exit }

func openTest(t *testing.T, dir string, mod func(*Options)) *Manager {
	t.Helper()
	return openTestOn(t, filepath.Join(dir, "state.db"), dir, mod)
}

// openTestOn is openTest with the state in the store at db.
func openTestOn(t *testing.T, db, dir string, mod func(*Options)) *Manager {
	t.Helper()
	o := Options{DBPath: db, Dir: filepath.Join(dir, "jobs"), Log: zerolog.Nop()}
	if mod != nil {
		mod(&o)
	}
	m, err := Open(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = m.Close(ctx)
	})
	return m
}

func start(t *testing.T, m *Manager, principal, session, command string, interactive bool) string {
	t.Helper()
	ended := make(chan sandbox.JobExit, 1)
	id, err := m.Start(context.Background(), StartRequest{Principal: principal, SessionID: session, SessionKey: session,
		Runner: procRunner{dir: t.TempDir()}, Spec: sandbox.JobSpec{Command: command, Timeout: 30 * time.Second, Interactive: interactive},
		Network: "none", OnEnd: func(x sandbox.JobExit) { ended <- x }})
	if err != nil {
		t.Fatal(err)
	}
	if !IDPattern.MatchString(id) {
		t.Fatalf("id %q", id)
	}
	return id
}

// readAll reads by cursor with long-polls until the job ends, checking that
// seqs are contiguous and strictly increasing.
func readAll(t *testing.T, m *Manager, principal, id string) (events []Event, sawRunningOutput bool) {
	t.Helper()
	var since int64
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		out, err := m.Read(context.Background(), principal, id, ReadRequest{Since: since, Wait: 5 * time.Second, MaxEvents: 100, MaxBytes: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if out.Dropped != 0 {
			t.Fatalf("dropped %d", out.Dropped)
		}
		for _, e := range out.Events {
			if e.Seq != since+1 {
				t.Fatalf("seq %d after %d", e.Seq, since)
			}
			since = e.Seq
			events = append(events, e)
			if e.Type == EventStdout && out.Status == StatusRunning {
				sawRunningOutput = true
			}
		}
		if out.Status != StatusRunning && !out.More {
			return events, sawRunningOutput
		}
	}
	t.Fatal("job did not end")
	return nil, false
}

func stdout(events []Event) string {
	var b strings.Builder
	for _, e := range events {
		if e.Type == EventStdout {
			b.WriteString(e.Data)
		}
	}
	return b.String()
}

func TestIncrementalReadByCursor(t *testing.T) { eachStore(t, testIncrementalReadByCursor) }

func testIncrementalReadByCursor(t *testing.T, loc func(testing.TB) string) {
	db := loc(t)
	m := openTestOn(t, db, t.TempDir(), nil)
	id := start(t, m, "alice", "s1", `for i in 1 2 3 4 5; do echo line$i; sleep 0.2; done`, false)
	events, early := readAll(t, m, "alice", id)
	if got := stdout(events); got != "line1\nline2\nline3\nline4\nline5\n" {
		t.Fatalf("stdout %q", got)
	}
	if !early {
		t.Error("no output was read while the job was running")
	}
	if events[0].Type != EventReady || events[len(events)-1].Type != EventExit || *events[len(events)-1].Code != 0 {
		t.Fatalf("first/last events: %+v / %+v", events[0], events[len(events)-1])
	}
	info, err := m.Status(context.Background(), "alice", id)
	if err != nil || info.Status != StatusCompleted || info.ExitCode == nil || *info.ExitCode != 0 || info.LastSeq != events[len(events)-1].Seq {
		t.Fatalf("status %+v %v", info, err)
	}
}

func TestInteractiveStdin(t *testing.T) {
	m := openTest(t, t.TempDir(), nil)
	id := start(t, m, "alice", "s1", `read name; echo "hello $name"; read x; echo "bye $x"`, true)
	ctx := context.Background()
	if err := m.SendStdin(ctx, "alice", id, []byte("world\n"), false); err != nil {
		t.Fatal(err)
	}
	if err := m.SendStdin(ctx, "bob", id, []byte("x\n"), false); !isCode(err, brokererr.SandboxNotFound) {
		t.Fatalf("other principal: %v", err)
	}
	if err := m.SendStdin(ctx, "alice", id, []byte("moon"), true); err != nil {
		t.Fatal(err)
	}
	events, _ := readAll(t, m, "alice", id)
	if got := stdout(events); got != "hello world\nbye moon\n" {
		t.Fatalf("stdout %q", got)
	}
	if err := m.SendStdin(ctx, "alice", id, []byte("late\n"), false); !isCode(err, brokererr.Conflict) {
		t.Fatalf("stdin after exit: %v", err)
	}
	nonInteractive := start(t, m, "alice", "s1", `sleep 5`, false)
	if err := m.SendStdin(ctx, "alice", nonInteractive, []byte("x"), false); !isCode(err, brokererr.Conflict) {
		t.Fatalf("stdin to non-interactive job: %v", err)
	}
	if _, err := m.Cancel(ctx, "alice", nonInteractive, true); err != nil {
		t.Fatal(err)
	}
}

func isCode(err error, c brokererr.Code) bool {
	var be *brokererr.Error
	return errors.As(err, &be) && be.Code == c
}

// waitFor long-polls until an event satisfies ok.
func waitFor(t *testing.T, m *Manager, principal, id string, ok func(Event) bool) {
	t.Helper()
	var since int64
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		out, err := m.Read(context.Background(), principal, id, ReadRequest{Since: since, Wait: 5 * time.Second, MaxEvents: 100, MaxBytes: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range out.Events {
			if ok(e) {
				return
			}
		}
		since = out.Next
	}
	t.Fatal("event never came")
}

// waitEnded waits for the job's row to leave running: the closing event
// is logged just before the row is updated.
func waitEnded(t *testing.T, m *Manager, principal, id string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		info, err := m.Status(context.Background(), principal, id)
		if err != nil {
			t.Fatal(err)
		}
		if info.Status != StatusRunning {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("job never ended")
}

func TestCancelTrapsSIGTERM(t *testing.T) {
	m := openTest(t, t.TempDir(), nil)
	id := start(t, m, "alice", "s1", `trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.05; done`, false)
	waitFor(t, m, "alice", id, func(e Event) bool { return strings.Contains(e.Data, "ready") })
	info, err := m.Cancel(context.Background(), "alice", id, false)
	if err != nil {
		t.Fatal(err)
	}
	if info.Status != StatusCancelled || info.ExitCode == nil || *info.ExitCode != 7 {
		t.Fatalf("after cancel: %+v", info)
	}
	events, _ := readAll(t, m, "alice", id)
	if !strings.Contains(stdout(events), "got-term") || events[len(events)-1].Type != EventCancelled {
		t.Fatalf("events %+v", events)
	}
	if _, err := m.Cancel(context.Background(), "alice", id, false); !isCode(err, brokererr.Conflict) {
		t.Fatalf("second cancel: %v", err)
	}

	// force: SIGKILL at once, even for a job that ignores SIGTERM.
	id2 := start(t, m, "alice", "s1", `trap '' TERM; echo ready; while :; do sleep 0.05; done`, false)
	waitFor(t, m, "alice", id2, func(e Event) bool { return strings.Contains(e.Data, "ready") })
	begin := time.Now()
	info, err = m.Cancel(context.Background(), "alice", id2, true)
	if err != nil || info.Status != StatusCancelled || info.Signal == "" {
		t.Fatalf("force cancel: %+v %v", info, err)
	}
	if time.Since(begin) >= CancelGrace {
		t.Fatalf("force cancel waited the grace period")
	}
}

func TestConcurrencyLimits(t *testing.T) {
	m := openTest(t, t.TempDir(), func(o *Options) { o.MaxConcurrent = 3; o.MaxPerSession = 2 })
	ctx := context.Background()
	a := start(t, m, "alice", "s1", "sleep 30", false)
	start(t, m, "alice", "s1", "sleep 30", false)
	_, err := m.Start(ctx, StartRequest{Principal: "alice", SessionID: "s1", SessionKey: "s1", Runner: procRunner{dir: t.TempDir()},
		Spec: sandbox.JobSpec{Command: "true", Timeout: time.Second}})
	if !isCode(err, brokererr.QuotaExceeded) || !strings.Contains(err.Error(), "session") {
		t.Fatalf("per-session limit: %v", err)
	}
	start(t, m, "alice", "s2", "sleep 30", false)
	_, err = m.Start(ctx, StartRequest{Principal: "bob", SessionID: "s3", SessionKey: "s3", Runner: procRunner{dir: t.TempDir()},
		Spec: sandbox.JobSpec{Command: "true", Timeout: time.Second}})
	if !isCode(err, brokererr.QuotaExceeded) || !strings.Contains(err.Error(), "broker") {
		t.Fatalf("global limit: %v", err)
	}
	// A slot frees when a job ends.
	if _, err := m.Cancel(ctx, "alice", a, true); err != nil {
		t.Fatal(err)
	}
	start(t, m, "bob", "s3", "true", false)
}

func TestRestartKeepsOutputAndMarksRunningJobsAsError(t *testing.T) {
	eachStore(t, testRestartKeepsOutputAndMarksRunningJobsAsError)
}

func testRestartKeepsOutputAndMarksRunningJobsAsError(t *testing.T, loc func(testing.TB) string) {
	db := loc(t)
	dir := t.TempDir()
	first := openTestOn(t, db, dir, nil)
	id := start(t, first, "alice", "s1", `echo before-restart; sleep 30`, false)
	waitFor(t, first, "alice", id, func(e Event) bool { return strings.Contains(e.Data, "before-restart") })
	done := start(t, first, "alice", "s1", `echo finished`, false)
	readAll(t, first, "alice", done)

	// A second broker opens the same state without the first one closing
	// (as after a crash).
	second := openTestOn(t, db, dir, nil)
	info, err := second.Status(context.Background(), "alice", id)
	if err != nil || info.Status != StatusError || !strings.Contains(info.Error, "restarted") {
		t.Fatalf("status after restart: %+v %v", info, err)
	}
	out, err := second.Read(context.Background(), "alice", id, ReadRequest{MaxEvents: 100, MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if out.Status != StatusError || !strings.Contains(stdout(out.Events), "before-restart") || out.Events[len(out.Events)-1].Type != EventError {
		t.Fatalf("output after restart: %+v", out)
	}
	fin, err := second.Status(context.Background(), "alice", done)
	if err != nil || fin.Status != StatusCompleted {
		t.Fatalf("finished job after restart: %+v %v", fin, err)
	}
	list, err := second.List(context.Background(), "alice", "s1", 10)
	if err != nil || len(list) != 2 {
		t.Fatalf("list %v %v", list, err)
	}
	if l, _ := second.List(context.Background(), "bob", "", 10); len(l) != 0 {
		t.Fatalf("bob sees %v", l)
	}
}

func TestLogCapDropsOldestAndSaysHowMany(t *testing.T) {
	m := openTest(t, t.TempDir(), func(o *Options) { o.LogMaxBytes = 16 << 10 })
	id := start(t, m, "alice", "s1", `for i in $(seq 1 3000); do echo "line $i"; done`, false)
	waitFor(t, m, "alice", id, func(e Event) bool { return e.Type == EventExit })
	out, err := m.Read(context.Background(), "alice", id, ReadRequest{MaxEvents: 100000, MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if out.Dropped == 0 || out.Events[0].Seq != out.Dropped+1 {
		t.Fatalf("dropped %d, first seq %d", out.Dropped, out.Events[0].Seq)
	}
	for i := 1; i < len(out.Events); i++ {
		if out.Events[i].Seq != out.Events[i-1].Seq+1 {
			t.Fatalf("gap at %d", i)
		}
	}
	if !strings.Contains(stdout(out.Events), "line 3000\n") || out.Events[len(out.Events)-1].Type != EventExit {
		t.Fatal("newest output missing")
	}
	var size int64
	ents, _ := os.ReadDir(filepath.Join(m.o.Dir, id))
	for _, e := range ents {
		fi, _ := e.Info()
		size += fi.Size()
	}
	if size > 16<<10+4096 {
		t.Fatalf("log uses %d bytes on disk", size)
	}
}

func TestUnknownAndForeignIDs(t *testing.T) { eachStore(t, testUnknownAndForeignIDs) }

func testUnknownAndForeignIDs(t *testing.T, loc func(testing.TB) string) {
	db := loc(t)
	m := openTestOn(t, db, t.TempDir(), nil)
	id := start(t, m, "alice", "s1", "echo hi", false)
	for _, tc := range []struct{ principal, id string }{{"bob", id}, {"alice", "exec_" + strings.Repeat("0", 32)}, {"alice", "../../etc"}} {
		if _, err := m.Status(context.Background(), tc.principal, tc.id); !isCode(err, brokererr.SandboxNotFound) {
			t.Errorf("%s/%s: %v", tc.principal, tc.id, err)
		}
		if _, err := m.Read(context.Background(), tc.principal, tc.id, ReadRequest{MaxEvents: 1, MaxBytes: 1}); !isCode(err, brokererr.SandboxNotFound) {
			t.Errorf("read %s/%s: %v", tc.principal, tc.id, err)
		}
	}
}

func FuzzSegmentScan(f *testing.F) {
	f.Add([]byte(`{"seq":1,"ts":"x","type":"ready"}` + "\n" + `{"seq":2,"type":"stdout","data":"a"}`))
	f.Add([]byte("{\"seq\":-1}\n\x00\xff{"))
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, segName(1)), data, 0o600); err != nil {
			t.Fatal(err)
		}
		l, err := openLog(dir, 1<<20)
		if err != nil {
			return
		}
		defer l.close()
		p, err := l.read(0, 1000, 1<<20)
		if err != nil {
			return
		}
		for _, e := range p.Events {
			if e.Seq <= 0 {
				t.Fatalf("bad seq %d", e.Seq)
			}
		}
		// Appending after a torn or hostile file still yields a fresh seq.
		e, err := l.append(Event{Type: EventStdout, Data: "x"}, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		for _, old := range p.Events {
			if old.Seq >= e.Seq {
				t.Fatalf("seq %d reused (old %d)", e.Seq, old.Seq)
			}
		}
	})
}

func TestOnEndRunsOnceForRefusedStarts(t *testing.T) {
	m := openTest(t, t.TempDir(), func(o *Options) { o.MaxConcurrent = 1; o.MaxPerSession = 1 })
	start(t, m, "alice", "s1", "sleep 30", false)
	ends := 0
	_, err := m.Start(context.Background(), StartRequest{Principal: "alice", SessionID: "s1", SessionKey: "s1", Runner: procRunner{dir: t.TempDir()},
		Spec: sandbox.JobSpec{Command: "true", Timeout: time.Second}, OnEnd: func(sandbox.JobExit) { ends++ }})
	if !isCode(err, brokererr.QuotaExceeded) || ends != 1 {
		t.Fatalf("refused start: err %v, OnEnd ran %d times", err, ends)
	}
}

func TestCancelEscalatesAfterTheCallerLeaves(t *testing.T) {
	m := openTest(t, t.TempDir(), nil)
	id := start(t, m, "alice", "s1", `trap '' TERM; echo ready; while :; do sleep 0.05; done`, false)
	waitFor(t, m, "alice", id, func(e Event) bool { return strings.Contains(e.Data, "ready") })
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the client is gone before the grace period ends
	if _, err := m.Cancel(ctx, "alice", id, false); err != nil {
		t.Fatal(err)
	}
	done := m.Done("alice", id)
	if done == nil {
		t.Fatal("job ended at SIGTERM although it ignores it")
	}
	select {
	case <-done:
	case <-time.After(CancelGrace + 10*time.Second):
		t.Fatal("SIGKILL never came")
	}
	if info, _ := m.Status(context.Background(), "alice", id); info.Status != StatusCancelled || !strings.HasPrefix(info.Signal, "SIGKILL") {
		t.Fatalf("after escalation: %+v", info)
	}
}

func TestCloseMarksRunningJobsAsErrorWithTheReason(t *testing.T) {
	dir := t.TempDir()
	m := openTest(t, dir, nil)
	id := start(t, m, "alice", "s1", `echo started; sleep 30`, false)
	waitFor(t, m, "alice", id, func(e Event) bool { return strings.Contains(e.Data, "started") })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Close(ctx); err != nil {
		t.Fatal(err)
	}
	again := openTest(t, dir, nil)
	info, err := again.Status(context.Background(), "alice", id)
	if err != nil || info.Status != StatusError || info.Error != restartReason {
		t.Fatalf("after a graceful stop: %+v %v", info, err)
	}
	out, _ := again.Read(context.Background(), "alice", id, ReadRequest{MaxEvents: 100, MaxBytes: 1 << 20})
	if !strings.Contains(stdout(out.Events), "started") || out.Events[len(out.Events)-1].Message != restartReason {
		t.Fatalf("events %+v", out.Events)
	}
}

func TestDroppedEventsCountedOnceAcrossReads(t *testing.T) {
	m := openTest(t, t.TempDir(), func(o *Options) { o.LogMaxBytes = 16 << 10 })
	id := start(t, m, "alice", "s1", `for i in $(seq 1 3000); do echo "line $i"; done`, false)
	waitFor(t, m, "alice", id, func(e Event) bool { return e.Type == EventExit })
	// Small pages: every seq is either returned or counted as dropped,
	// exactly once.
	var since, seen, dropped int64
	for {
		out, err := m.Read(context.Background(), "alice", id, ReadRequest{Since: since, MaxEvents: 50, MaxBytes: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		dropped += out.Dropped
		seen += int64(len(out.Events))
		if out.Next < since {
			t.Fatalf("cursor went back: %d after %d", out.Next, since)
		}
		since = out.Next
		if !out.More {
			break
		}
	}
	last, _ := m.Status(context.Background(), "alice", id)
	if dropped == 0 || seen+dropped != last.LastSeq {
		t.Fatalf("seen %d + dropped %d != last seq %d", seen, dropped, last.LastSeq)
	}
}

func TestPruneDeletesEndedJobsPastRetention(t *testing.T) {
	eachStore(t, testPruneDeletesEndedJobsPastRetention)
}

func testPruneDeletesEndedJobsPastRetention(t *testing.T, loc func(testing.TB) string) {
	db := loc(t)
	m := openTestOn(t, db, t.TempDir(), func(o *Options) { o.Retention = time.Millisecond })
	id := start(t, m, "alice", "s1", "echo done", false)
	waitFor(t, m, "alice", id, func(e Event) bool { return e.Type == EventExit })
	waitEnded(t, m, "alice", id)
	live := start(t, m, "alice", "s1", "echo ready; sleep 30", false)
	waitFor(t, m, "alice", live, func(e Event) bool { return strings.Contains(e.Data, "ready") })
	m.Prune(context.Background())
	if _, err := m.Status(context.Background(), "alice", id); !isCode(err, brokererr.SandboxNotFound) {
		t.Fatalf("ended job still there: %v", err)
	}
	if _, err := os.Stat(filepath.Join(m.o.Dir, id)); !os.IsNotExist(err) {
		t.Fatalf("log dir left: %v", err)
	}
	if info, err := m.Status(context.Background(), "alice", live); err != nil || info.Status != StatusRunning {
		t.Fatalf("a running job was pruned: %+v %v", info, err)
	}
}

// List reports the same last_seq as Status, live and ended.
func TestListReportsLastSeq(t *testing.T) { eachStore(t, testListReportsLastSeq) }

func testListReportsLastSeq(t *testing.T, loc func(testing.TB) string) {
	db := loc(t)
	m := openTestOn(t, db, t.TempDir(), nil)
	ctx := context.Background()
	id := start(t, m, "alice", "s1", `echo one; echo two; read x`, true)
	waitFor(t, m, "alice", id, func(e Event) bool { return e.Type == EventStdout && strings.Contains(e.Data, "two") })
	check := func(when string) {
		t.Helper()
		info, err := m.Status(ctx, "alice", id)
		if err != nil {
			t.Fatal(err)
		}
		list, err := m.List(ctx, "alice", "", 10)
		if err != nil || len(list) != 1 {
			t.Fatalf("list %+v %v", list, err)
		}
		if info.LastSeq < 2 || list[0].LastSeq != info.LastSeq {
			t.Fatalf("%s: list last_seq %d, status %d", when, list[0].LastSeq, info.LastSeq)
		}
	}
	check("running")
	if err := m.SendStdin(ctx, "alice", id, nil, true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, m, "alice", id, func(e Event) bool { return e.Type == EventExit })
	check("ended")
}

// lastSeqOnDisk reads only a segment's tail, but falls back to the whole
// segment when its last line is longer than the tail, and skips a torn
// last line.
func TestLastSeqOnDisk(t *testing.T) {
	dir := t.TempDir()
	l, err := openLog(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for i := 0; i < 100; i++ {
		if _, err := l.append(Event{Type: EventStdout, Data: strings.Repeat("x", 500)}, now); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := lastSeqOnDisk(dir); err != nil || got != 100 {
		t.Fatalf("last seq %d %v, want 100", got, err)
	}
	if _, err := l.append(Event{Type: EventStdout, Data: strings.Repeat("y", 3*tailBytes)}, now); err != nil {
		t.Fatal(err)
	}
	if got, err := lastSeqOnDisk(dir); err != nil || got != 101 {
		t.Fatalf("after a long line: %d %v, want 101", got, err)
	}
	if err := l.close(); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(dir, segName(1)), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString(`{"seq":102,"ts":"x","type":"std`) // a crash mid-write
	f.Close()
	if got, err := lastSeqOnDisk(dir); err != nil || got != 101 {
		t.Fatalf("after a torn line: %d %v, want 101", got, err)
	}
}

// A long-poll that got output gathers what follows within the window, so
// ten lines printed at intervals take a few reads, not one per line; a
// full page ends the window early.
func TestWaitGathersOutput(t *testing.T) {
	m := openTest(t, t.TempDir(), nil)
	id := start(t, m, "alice", "s1", `for i in $(seq 1 10); do echo line$i; sleep 0.02; done`, false)
	var since int64
	var out strings.Builder
	reads := 0
	for {
		reads++
		page, err := m.Read(context.Background(), "alice", id, ReadRequest{Since: since, Wait: 10 * time.Second,
			MaxEvents: 100, MaxBytes: 1 << 20, Gather: 250 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range page.Events {
			if e.Seq != since+1 {
				t.Fatalf("seq %d after %d", e.Seq, since)
			}
			since = e.Seq
			out.WriteString(e.Data)
		}
		if page.Status != StatusRunning && !page.More {
			break
		}
		if reads > 20 {
			t.Fatal("job did not end")
		}
	}
	if !strings.HasSuffix(out.String(), "line10\n") || strings.Count(out.String(), "line") != 10 {
		t.Fatalf("output %q", out.String())
	}
	if reads > 6 {
		t.Fatalf("%d reads for 10 lines: output was not gathered", reads)
	}

	// A page that fills ends the window at once.
	id = start(t, m, "alice", "s2", `head -c 100000 /dev/zero | tr '\0' x; sleep 30`, false)
	t0 := time.Now()
	page, err := m.Read(context.Background(), "alice", id, ReadRequest{Wait: 30 * time.Second, MaxEvents: 1000, MaxBytes: 8 << 10, Gather: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	size := 0
	for _, e := range page.Events {
		size += len(e.Data)
	}
	if !page.More && size < 8<<10 || time.Since(t0) > 10*time.Second {
		t.Fatalf("full page: %d bytes, more=%v after %s", size, page.More, time.Since(t0))
	}
}

// Refused network requests are recorded on the job: counted per host, port
// and rule, logged once in order with the output, reported by Read, Status
// and List, and kept after the job ends and the broker restarts.
func TestEgressDenialsRecorded(t *testing.T) {
	dir := t.TempDir()
	m := openTest(t, dir, nil)
	ctx := context.Background()
	var deny func(EgressDenial)
	built := make(chan struct{})
	id, err := m.Start(ctx, StartRequest{Principal: "alice", SessionID: "s1", SessionKey: "s1",
		Runner: procRunner{dir: t.TempDir()}, Spec: sandbox.JobSpec{Command: `read x; echo done`, Timeout: 30 * time.Second, Interactive: true},
		Network: "allow=*.example.org",
		Egress: func(d func(EgressDenial)) (func(net.Listener), error) {
			deny = d
			close(built)
			return func(net.Listener) {}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	<-built
	blocked := EgressDenial{Host: "blocked.example.net", Port: 443, Reason: "not_in_allowed_domains", Rule: "allowed_domains [*.example.org]"}
	deny(blocked)
	deny(blocked)
	deny(EgressDenial{Host: "10.0.0.1", Port: 443, Reason: "ip_literal", Rule: "allowed_domains lists domain names only"})
	check := func(when string, got []EgressDenial) {
		t.Helper()
		if len(got) != 2 || got[0].Host != blocked.Host || got[0].Count != 2 || got[0].Rule != blocked.Rule || got[1].Count != 1 {
			t.Fatalf("%s: denials %+v", when, got)
		}
	}
	out, err := m.Read(ctx, "alice", id, ReadRequest{MaxEvents: 100, MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	check("read", out.EgressDenied)
	var logged []Event
	for _, e := range out.Events {
		if e.Type == EventEgressDenied {
			logged = append(logged, e)
		}
	}
	if len(logged) != 2 || logged[0].Host != blocked.Host || logged[0].Port != 443 || logged[0].Rule != blocked.Rule {
		t.Fatalf("logged %+v", logged)
	}
	if err := m.SendStdin(ctx, "alice", id, []byte("go\n"), true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, m, "alice", id, func(e Event) bool { return e.Type == EventExit })
	info, err := m.Status(ctx, "alice", id)
	if err != nil {
		t.Fatal(err)
	}
	check("status after the end", info.EgressDenied)
	list, err := m.List(ctx, "alice", "", 10)
	if err != nil || len(list) != 1 {
		t.Fatal(list, err)
	}
	check("list", list[0].EgressDenied)
	closeCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_ = m.Close(closeCtx)
	m2 := openTest(t, dir, nil)
	if info, err = m2.Status(ctx, "alice", id); err != nil {
		t.Fatal(err)
	}
	check("after a restart", info.EgressDenied)
	if _, err := m2.Status(ctx, "bob", id); brokererr.CodeOf(err) != brokererr.SandboxNotFound {
		t.Fatalf("another principal: %v", err)
	}
}

// FuzzLastSeqOnDisk: whatever a segment holds (torn, long or garbled
// lines), reading only its tail finds the same last seq as a whole scan.
func FuzzLastSeqOnDisk(f *testing.F) {
	f.Add([]byte("{\"seq\":1,\"type\":\"ready\"}\n{\"seq\":2,\"type\":\"exit\"}\n"))
	f.Add([]byte("{\"seq\":7}\n{\"seq\":8,\"ty"))
	f.Add([]byte("garbage\n\n{\"seq\":-3}\n"))
	f.Add(append([]byte("{\"seq\":4}\n{\"seq\":5,\"data\":\""), append(bytes.Repeat([]byte("x"), 20000), []byte("\"}\n")...)...))
	f.Fuzz(func(t *testing.T, seg []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, segName(1)), seg, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := lastSeqOnDisk(dir)
		if err != nil {
			t.Fatalf("error on content: %v", err)
		}
		var want int64
		_ = scanSegment(filepath.Join(dir, segName(1)), func(e Event) bool {
			want = e.Seq // the last whole event line
			return true
		})
		if got != want {
			t.Fatalf("last seq %d, a whole scan says %d", got, want)
		}
	})
}

// eachStore runs fn once per store (a state.db file, a PostgreSQL
// database), handing it that store's location maker.
func eachStore(t *testing.T, fn func(t *testing.T, loc func(testing.TB) string)) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) { fn(t, st.Loc) })
}

// Replicas on one PostgreSQL store: a replica that opens leaves the jobs
// of a live replica running, and the leader's Prune closes out the jobs
// of one that is gone.
func TestReplicaJobsLostOnlyWithTheirReplica(t *testing.T) {
	ctx := context.Background()
	db := statedbtest.PostgresURL(t)
	presence := func(id string) *statedb.Presence {
		p, err := statedb.NewPresence(db, id)
		if err != nil || !p.Keep(ctx) {
			t.Fatalf("presence %s: %v", id, err)
		}
		t.Cleanup(func() { p.Close() })
		return p
	}
	pa := presence("a")
	a := openTestOn(t, db, t.TempDir(), func(o *Options) { o.Presence = pa })
	id := start(t, a, "alice", "s1", "echo ready; sleep 30", false)
	waitFor(t, a, "alice", id, func(e Event) bool { return strings.Contains(e.Data, "ready") })

	b := openTestOn(t, db, t.TempDir(), func(o *Options) { o.Presence = presence("b") })
	b.Prune(ctx)
	if info, err := b.Status(ctx, "alice", id); err != nil || info.Status != StatusRunning {
		t.Fatalf("a live replica's job after b opened and pruned: %+v %v", info, err)
	}
	pa.Close() // replica a is gone (its lock went with it)
	b.Prune(ctx)
	if info, err := b.Status(ctx, "alice", id); err != nil || info.Status != StatusError || !strings.Contains(info.Error, "restarted") {
		t.Fatalf("a gone replica's job after Prune: %+v %v", info, err)
	}
}

// A gathering read counts as new what was appended after its first read,
// also when that was before the gathering began: output that arrives just
// after the read which saw only the ready event fills the page then, not
// when the gathering window ends (with nothing returned).
func TestGatherCountsFromTheRead(t *testing.T) {
	l, err := openLog(t.TempDir(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.close() })
	now := time.Now()
	if _, err := l.append(Event{Type: EventReady}, now); err != nil {
		t.Fatal(err)
	}
	req := ReadRequest{MaxEvents: 1000, MaxBytes: 8 << 10}
	p, err := l.read(0, req.MaxEvents, req.MaxBytes)
	if err != nil || len(p.Events) != 1 {
		t.Fatalf("first read: %+v, %v", p, err)
	}
	// The job's output, between the read and the gathering.
	for range 3 {
		if _, err := l.append(Event{Type: EventStdout, Data: strings.Repeat("x", 4<<10)}, now); err != nil {
			t.Fatal(err)
		}
	}
	// A window that ends long after the page is full: only the output
	// already appended can end the wait in time.
	if !l.gatherWait(context.Background(), make(chan struct{}), time.After(10*time.Second), nil, p, req) {
		t.Fatal("gatherWait: nothing new when the window ended")
	}
	if p, err = l.read(0, req.MaxEvents, req.MaxBytes); err != nil || !p.More {
		t.Fatalf("second read: more %v, %v", p.More, err)
	}
}
