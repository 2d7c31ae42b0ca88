package process

import (
	"bytes"
	"context"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// collector is a JobSink that keeps both streams.
type collector struct {
	mu       sync.Mutex
	out, err bytes.Buffer
}

func (c *collector) sink(stream string, data []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if stream == sandbox.StreamStdout {
		c.out.Write(data)
	} else {
		c.err.Write(data)
	}
}

func (c *collector) String() (string, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.out.String(), c.err.String()
}

func waitDone(t *testing.T, j sandbox.Job, d time.Duration) sandbox.JobExit {
	t.Helper()
	select {
	case <-j.Done():
		return j.Exit()
	case <-time.After(d):
		t.Fatal("job did not end")
	}
	return sandbox.JobExit{}
}

func TestJobInteractive(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	var c collector
	ctx := context.Background()
	j, err := s.StartJob(ctx, sandbox.JobSpec{ID: randHex(16), Command: "echo out; echo err >&2; read x; echo got $x > job.txt; echo got $x; exit 7",
		Env: map[string]string{"GREETING": "hi"}, Timeout: 20 * time.Second, Interactive: true}, c.sink)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.WriteStdin(ctx, []byte("ping\n")); err != nil {
		t.Fatal(err)
	}
	ex := waitDone(t, j, 30*time.Second)
	out, errOut := c.String()
	if ex.ExitCode != 7 || out != "out\ngot ping\n" || errOut != "err\n" {
		t.Fatalf("exit %+v stdout %q stderr %q", ex, out, errOut)
	}
	f, err := s.ReadFile(ctx, "job.txt", 0, 0)
	if err != nil || string(f.Data) != "got ping\n" {
		t.Fatalf("job file: %v %q", err, f.Data)
	}
}

func TestJobSurvivesExecAndDiesWithRelease(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	var c collector
	ctx := context.Background()
	j, err := s.StartJob(ctx, sandbox.JobSpec{ID: randHex(16), Command: "echo started; exec sleep 300", Timeout: time.Minute}, c.sink)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "job output", func() bool { o, _ := c.String(); return o == "started\n" })
	if res := exec1(t, s, "python", "print(5)", 20*time.Second); string(res.Stdout) != "5\n" {
		t.Fatalf("exec beside job: %q %q", res.Stdout, res.Stderr)
	}
	select {
	case <-j.Done():
		t.Fatalf("run_code ended the job: %+v", j.Exit())
	default:
	}
	tree := descendants(current(t, s).pid)
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitDone(t, j, 20*time.Second)
	if !allDead(tree) {
		t.Fatal("job processes survive Release")
	}
}

func TestJobSignal(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	var c collector
	j, err := s.StartJob(context.Background(), sandbox.JobSpec{ID: randHex(16), Command: "echo up; sleep 300", Timeout: time.Minute}, c.sink)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 20*time.Second, "job output", func() bool { o, _ := c.String(); return o == "up\n" })
	if err := j.Signal(context.Background(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if ex := waitDone(t, j, 20*time.Second); ex.Signal != "SIGTERM" && ex.ExitCode != 143 {
		t.Fatalf("exit %+v", ex)
	}
}

func TestJobEgress(t *testing.T) {
	b := newBackend(t, nil)
	s := open(t, b)
	served := make(chan string, 1)
	var closedLn = make(chan struct{})
	egress := func(ln net.Listener) {
		defer close(closedLn)
		c, err := ln.Accept()
		if err != nil {
			served <- "accept: " + err.Error()
			return
		}
		buf := make([]byte, 64)
		n, _ := c.Read(buf)
		served <- string(buf[:n])
		_, _ = c.Write([]byte("pong"))
		c.Close()
		// Serve until the backend closes the listener at job end.
		for {
			if c, err := ln.Accept(); err != nil {
				return
			} else {
				c.Close()
			}
		}
	}
	var c collector
	j, err := s.StartJob(context.Background(), sandbox.JobSpec{ID: randHex(16), Timeout: 30 * time.Second, Egress: egress,
		Command: `python3 -c '
import os, socket, urllib.parse
u = urllib.parse.urlparse(os.environ["HTTP_PROXY"])
c = socket.create_connection((u.hostname, u.port), timeout=10)
c.sendall(b"ping")
print(c.recv(4).decode())
'`}, c.sink)
	if err != nil {
		t.Fatal(err)
	}
	ex := waitDone(t, j, 40*time.Second)
	out, errOut := c.String()
	if ex.ExitCode != 0 || strings.TrimSpace(out) != "pong" {
		t.Fatalf("exit %+v stdout %q stderr %q", ex, out, errOut)
	}
	if m := <-served; m != "ping" {
		t.Fatalf("egress got %q", m)
	}
	select {
	case <-closedLn:
	case <-time.After(10 * time.Second):
		t.Fatal("egress listener not closed after the job ended")
	}
	// No network without Egress.
	var c2 collector
	j, err = s.StartJob(context.Background(), sandbox.JobSpec{ID: randHex(16), Timeout: 30 * time.Second,
		Command: `python3 -c 'import socket; socket.create_connection(("1.1.1.1", 80), timeout=3)'`}, c2.sink)
	if err != nil {
		t.Fatal(err)
	}
	if ex := waitDone(t, j, 40*time.Second); ex.ExitCode == 0 {
		t.Fatal("a job without egress reached the network")
	}
}
