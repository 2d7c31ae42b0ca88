package tests

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// openFDs counts the broker process's open descriptors other than
// sockets: files, pipes and pidfds are what runs and jobs hold, while the
// number of sockets moves with HTTP keep-alive and the Docker client's
// connection pool.
func (b *Broker) openFDs(t *testing.T) int {
	t.Helper()
	dir := "/proc/" + strconv.Itoa(b.cmd.Process.Pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && !strings.HasPrefix(l, "socket:") {
			n++
		}
	}
	return n
}

// dirBytes is the size of the regular files under dir.
func dirBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			n += fi.Size()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// callAsync calls a tool in the background.
func callAsync(c *client.Client, name string, args map[string]any) <-chan *mcp.CallToolResult {
	out := make(chan *mcp.CallToolResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var req mcp.CallToolRequest
		req.Params.Name = name
		req.Params.Arguments = args
		res, _ := c.CallTool(ctx, req) // nil: the caller fails on it
		out <- res
	}()
	return out
}

// responsive checks that the broker answers another client, and runs code
// in another session, while a call is still in flight on pending.
func responsive(t *testing.T, c2 *client.Client, pending <-chan *mcp.CallToolResult) <-chan *mcp.CallToolResult {
	t.Helper()
	if res := callTool(t, c2, "get_usage", nil); res.IsError {
		t.Fatalf("get_usage while a call floods: %+v", res.Content)
	}
	var done execResult
	resultJSON(t, callTool(t, c2, "execute_code", map[string]any{"session_id": "other", "command": "echo other-session"}), &done)
	if done.Status != "completed" || stdoutOf(done.Output) != "other-session\n" {
		t.Fatalf("another session while a call floods: %+v", done)
	}
	select {
	case <-pending:
		t.Fatal("the flooding call ended before the check: test premise")
	default:
	}
	return pending
}

// TestSandboxFloodsOutputAndIgnoresStdin: code that writes an endless
// stream without a newline (to stdout or stderr), and jobs that never read
// the stdin they are sent, end by their timeouts with a clear result and
// capped output, while the broker keeps serving other calls; nothing is
// left behind (the broker's descriptors return to where they were).
func TestSandboxFloodsOutputAndIgnoresStdin(t *testing.T) {
	const jobLogMax = 1 << 20
	backends(t, map[string]string{"SANDBOX_JOB_LOG_MAX_BYTES": strconv.Itoa(jobLogMax)}, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		c2 := b.Client(t, testToken)
		// The sessions, each with its sandboxes, exist before the baseline
		// (jobs run in the python runner's, which on runner file systems is
		// not bash's).
		for _, session := range []string{"flood", "deaf"} {
			if r, _ := run(t, c, map[string]any{"session_id": session, "language": "bash", "code": "true"}); !r.Success {
				t.Fatalf("warm-up: %+v", r)
			}
			if res := callTool(t, c, "execute_code", map[string]any{"session_id": session, "command": "true"}); res.IsError {
				t.Fatalf("warm-up job: %+v", res.Content)
			}
		}
		responsive(t, c2, nil)
		baseline := b.openFDs(t)

		// Started first, as its send_stdin waits out the broker's 30 s
		// stdin limit while the rest runs: a job that stops reading.
		deaf := startAsync(t, c, map[string]any{"session_id": "deaf", "interactive": true, "timeout_seconds": 300,
			"command": "trap 'wc -c; exit 0' TERM; echo ready; while :; do sleep 0.1; done"})
		readFor(t, c, deaf.ExecutionID, "ready")
		stdinDone := make(chan stdinOutcome, 1)
		go func() { stdinDone <- sendUntilRefused(c, deaf.ExecutionID) }()

		for _, stream := range []string{"", " >&2"} {
			pending := callAsync(c, "run_code", map[string]any{"session_id": "flood", "language": "bash",
				"code": "yes | tr -d '\\n'" + stream, "timeout_s": 5})
			if stream == "" {
				pending = responsive(t, c2, pending)
			}
			res := <-pending
			if res == nil || res.IsError {
				t.Fatalf("run_code flood%s failed", stream)
			}
			var r runResult
			resultJSON(t, res, &r)
			out := r.Stdout + r.Stderr
			if !r.TimedOut || !r.Truncated || !strings.HasPrefix(out, "yyyy") || len(out) > 1<<20 {
				t.Fatalf("run_code flood%s: timed_out=%v truncated=%v %d bytes", stream, r.TimedOut, r.Truncated, len(out))
			}
		}

		// A job floods its log: it ends by its timeout, its log capped.
		flood := startAsync(t, c, map[string]any{"session_id": "flood", "command": "yes | tr -d '\\n'", "timeout_seconds": 3})
		if st := waitEnded(t, c2, flood.ExecutionID); st != "timeout" {
			t.Fatalf("flooding job: %s", st)
		}
		if n := dirBytes(t, filepath.Join(b.Root, "jobs", flood.ExecutionID)); n == 0 || n > jobLogMax+64<<10 {
			t.Fatalf("flooding job's log holds %d bytes (cap %d)", n, jobLogMax)
		}

		// A job that never reads and times out: the send_stdin blocked on
		// its full pipe returns when it ends, saying stdin is closed.
		short := startAsync(t, c, map[string]any{"session_id": "flood", "command": "sleep 600", "interactive": true, "timeout_seconds": 4})
		if o := sendUntilRefused(c, short.ExecutionID); o.err.Error != "CONFLICT" || !strings.Contains(o.err.Message, "stdin") {
			t.Fatalf("send_stdin to a job that never reads and times out: %+v", o)
		}
		if st := waitEnded(t, c2, short.ExecutionID); st != "timeout" {
			t.Fatalf("job that never reads: %s", st)
		}

		// The job that stopped reading but lives on: after 30 s the call
		// says how much of its input was accepted and is not retryable as
		// is; once the job reads again (its TERM trap runs wc -c), exactly
		// that much reaches it.
		o := <-stdinDone
		if o.err.Error != "SANDBOX_TIMEOUT" || o.err.Retryable || o.accepted <= 0 {
			t.Fatalf("send_stdin to a job that stopped reading: %+v", o)
		}
		cancelled := callAsync(c2, "cancel_execution", map[string]any{"execution_id": deaf.ExecutionID})
		if res := callTool(t, c, "send_stdin", map[string]any{"execution_id": deaf.ExecutionID, "input_data": "", "close": true}); res.IsError {
			t.Fatalf("closing stdin: %+v", res.Content)
		}
		if res := <-cancelled; res == nil || res.IsError {
			t.Fatalf("cancel_execution: %+v", res)
		}
		var out execResult
		resultJSON(t, callTool(t, c, "get_execution_output", map[string]any{"execution_id": deaf.ExecutionID}), &out)
		if got := strings.TrimSpace(strings.TrimPrefix(stdoutOf(out.Output), "ready\n")); got != strconv.Itoa(o.accepted) {
			t.Fatalf("the job read %q bytes; the calls reported %d accepted", got, o.accepted)
		}

		// The sessions still work, and nothing leaked.
		if r, _ := run(t, c, map[string]any{"session_id": "flood", "language": "bash", "code": "echo after"}); r.Stdout != "after\n" {
			t.Fatalf("session after the floods: %+v", r)
		}
		eventually(t, 10*time.Second, "broker descriptors back to the baseline", func() bool {
			return b.openFDs(t) <= baseline
		})
	})
}

// waitEnded polls a job's status until it is no longer running.
func waitEnded(t *testing.T, c *client.Client, id string) string {
	t.Helper()
	var st execResult
	eventually(t, 60*time.Second, "job "+id+" ended", func() bool {
		resultJSON(t, callTool(t, c, "get_execution_status", map[string]any{"execution_id": id}), &st)
		return st.Status != "running"
	})
	return st.Status
}

type stdinOutcome struct {
	err      toolError
	accepted int // bytes the job's stdin took, by the calls' own account
}

var acceptedRE = regexp.MustCompile(`: (\d+) of \d+ bytes were accepted`)

// sendUntilRefused sends 64 KiB at a time to a job's stdin until a call
// fails (at most 4 MiB) and returns that failure with the bytes accepted.
func sendUntilRefused(c *client.Client, id string) stdinOutcome {
	chunk := strings.Repeat("x", 65536)
	var o stdinOutcome
	for range 64 {
		res := <-callAsync(c, "send_stdin", map[string]any{"execution_id": id, "input_data": chunk})
		if res == nil {
			o.err.Error = "no result"
			return o
		}
		if !res.IsError {
			o.accepted += len(chunk)
			continue
		}
		if tc, ok := res.Content[0].(mcp.TextContent); ok {
			_ = json.Unmarshal([]byte(tc.Text), &o.err)
		}
		if m := acceptedRE.FindStringSubmatch(o.err.Message); m != nil {
			n, _ := strconv.Atoi(m[1])
			o.accepted += n
		}
		return o
	}
	o.err.Error = "4 MiB accepted by a job that never reads"
	return o
}
