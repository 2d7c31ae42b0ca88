package quota

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Env vars that turn this test binary into a helper "broker process".
const (
	envHelperDB    = "QUOTA_HELPER_DB"
	envHelperLimit = "QUOTA_HELPER_LIMIT"
)

// TestHelperProcess is not a real test: run by TestTwoProcesses it says
// "ready", waits for stdin to close (a start barrier, so the processes
// overlap), hammers AllowCall and prints how many calls were allowed.
func TestHelperProcess(t *testing.T) {
	path := os.Getenv(envHelperDB)
	if path == "" {
		t.Skip("helper process only")
	}
	limit, _ := strconv.Atoi(os.Getenv(envHelperLimit))
	s := openStore(t, path, newClock(t0.Add(time.Second)))
	fmt.Println("ready")
	if _, err := io.Copy(io.Discard, os.Stdin); err != nil {
		t.Fatal(err)
	}
	allowed := race(t, []*Store{s}, 8, 100, Limits{CallsPerMinute: limit})
	fmt.Printf("allowed=%d\n", allowed)
}

// helper is one running helper process.
type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

func startHelper(t *testing.T, path string, limit int) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), envHelperDB+"="+path, fmt.Sprintf("%s=%d", envHelperLimit, limit))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := &helper{cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout)}
	if _, ok := h.await("ready"); !ok {
		t.Fatal("helper exited before ready")
	}
	return h
}

// await scans output up to a line starting with prefix and returns the rest.
func (h *helper) await(prefix string) (string, bool) {
	for h.out.Scan() {
		if v, ok := strings.CutPrefix(h.out.Text(), prefix); ok {
			return v, true
		}
	}
	return "", false
}

// Two OS processes on one file: exactly the limit is allowed in total.
func TestTwoProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	path := dbPath(t)
	// Create the schema first so the helpers race only on AllowCall.
	s, err := Open(context.Background(), path, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()

	const limit = 500 // of 2 × 800 attempts
	helpers := []*helper{startHelper(t, path, limit), startHelper(t, path, limit)}
	for _, h := range helpers {
		h.stdin.Close() // release the barrier
	}
	counts := make([]int, len(helpers))
	var wg sync.WaitGroup
	for i, h := range helpers {
		wg.Go(func() {
			v, ok := h.await("allowed=")
			for h.out.Scan() { // drain before Wait closes the pipe
			}
			if err := h.cmd.Wait(); err != nil || !ok {
				t.Errorf("helper %d: %v (reported: %v)", i, err, ok)
				return
			}
			counts[i], _ = strconv.Atoi(v)
		})
	}
	wg.Wait()
	t.Logf("allowed per process: %v", counts)
	if got := counts[0] + counts[1]; got != limit {
		t.Fatalf("two processes allowed %v = %d calls, want exactly %d", counts, got, limit)
	}
}
