package tests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// A flood of calls refused at validation meets the rate limit like any
// other flood, and then valid calls are limited too.
func TestInvalidCallFloodIsRateLimited(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none", "RATE_LIMIT_PER_MINUTE": "5"}})
	c := b.Client(t, testToken)
	for i := range 5 {
		if e := mustToolError(t, callTool(t, c, "get_usage", map[string]any{"evil": i}), "INVALID_INPUT"); e.Retryable {
			t.Fatalf("invalid input marked retryable: %+v", e)
		}
	}
	e := mustToolError(t, callTool(t, c, "get_usage", map[string]any{"evil": 5}), "RATE_LIMIT_EXCEEDED")
	if !e.Retryable || e.RetryAfterS == nil || *e.RetryAfterS < 1 {
		t.Fatalf("flood refusal: %+v", e)
	}
	mustToolError(t, callTool(t, c, "get_usage", nil), "RATE_LIMIT_EXCEEDED")
}

// chargeExecution records d of execution time for principal in root's
// state database, as if earlier runs had spent it.
func chargeExecution(t *testing.T, root, principal string, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	s, err := quota.Open(ctx, filepath.Join(root, "state.db"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, r, err := s.ReserveExecution(ctx, principal, quota.Limits{ExecutionPerDay: 24 * time.Hour}, time.Millisecond)
	if err == nil {
		err = s.SettleExecution(ctx, r, d)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// Runs started at once by one principal with budget left for one: one
// starts, the others are refused before any sandbox starts; the winner is
// charged its real duration, not its timeout.
func TestConcurrentRunsCannotOverspendExecutionBudget(t *testing.T) {
	requireDocker(t)
	root := brokerRoot(t)
	chargeExecution(t, root, "default", time.Hour-30*time.Second) // free tier: 30 s left
	b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: map[string]string{
		"MCP_API_TIER": "free", "RATE_LIMIT_PER_MINUTE": "1000", "SANDBOX_POOL_SIZE": "0"}})
	const n = 3
	results := make([]string, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		c := b.Client(t, testToken)
		wg.Go(func() {
			<-start
			res := callTool(t, c, "run_code", map[string]any{"session_id": fmt.Sprintf("budget-%d", i),
				"language": "bash", "code": "sleep 2; echo done", "timeout_s": 20})
			if !res.IsError {
				results[i] = "ok"
				return
			}
			var e toolError
			resultJSON(t, res, &e)
			if e.Error == "QUOTA_EXCEEDED" && e.Retryable && e.RetryAfterS != nil && *e.RetryAfterS > 0 {
				results[i] = "quota"
			} else {
				results[i] = fmt.Sprintf("%+v", e)
			}
		})
	}
	close(start)
	wg.Wait()
	ok, refused := 0, 0
	var winner string
	for i, r := range results {
		switch r {
		case "ok":
			ok++
			winner = fmt.Sprintf("budget-%d", i)
		case "quota":
			refused++
		default:
			t.Fatalf("unexpected outcome %s", r)
		}
	}
	if ok != 1 || refused != n-1 {
		t.Fatalf("%d runs of 20 s started and %d were refused with 30 s of budget left, want 1 and %d", ok, refused, n-1)
	}
	// The winner settled with ~2 s: another 20 s run fits in what is left.
	c := b.Client(t, testToken)
	if r, _ := run(t, c, map[string]any{"session_id": winner, "language": "bash", "code": "echo again", "timeout_s": 20}); strings.TrimSpace(r.Stdout) != "again" {
		t.Fatalf("second run: %+v", r)
	}
	// The refused runs created nothing.
	ents, err := os.ReadDir(filepath.Join(root, "workspaces"))
	if err != nil || len(ents) != 1 {
		t.Fatalf("%d workspaces (%v), want only the winner's", len(ents), err)
	}
}

// The live-container cap refuses a new session's sandbox with a retryable
// QUOTA_EXCEEDED and a retry hint; closing a session makes room.
func TestContainerCapRefusesClearly(t *testing.T) {
	requireDocker(t)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_MAX_CONTAINERS": "2", "SANDBOX_POOL_SIZE": "0"}})
	c := b.Client(t, testToken)
	for _, id := range []string{"cap-a", "cap-b"} {
		run(t, c, map[string]any{"session_id": id, "language": "bash", "code": "true"})
	}
	e := mustToolError(t, callTool(t, c, "run_code", map[string]any{"session_id": "cap-c", "language": "bash", "code": "true"}), "QUOTA_EXCEEDED")
	if !e.Retryable || e.RetryAfterS == nil || *e.RetryAfterS < 60 || !strings.Contains(e.Message, "maximum of 2 sandbox containers") {
		t.Fatalf("at the cap: %+v", e)
	}
	if res := callTool(t, c, "close_session", map[string]any{"session_id": "cap-a"}); res.IsError {
		t.Fatalf("close_session: %+v", res.Content)
	}
	if r, _ := run(t, c, map[string]any{"session_id": "cap-c", "language": "bash", "code": "echo in"}); strings.TrimSpace(r.Stdout) != "in" {
		t.Fatalf("after closing a session: %+v", r)
	}
}

// Docker sessions run as host uids of their own (not a shared 1000), and a
// session keeps its uid and files across a broker restart.
func TestDockerSessionsRunAsTheirOwnUIDs(t *testing.T) {
	requireDocker(t)
	if os.Geteuid() != 0 {
		t.Skip("per-session workspace ownership needs a root broker")
	}
	root := brokerRoot(t)
	env := map[string]string{"SANDBOX_BACKEND": "docker", "SANDBOX_POOL_SIZE": "1"}
	b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: env})
	c := b.Client(t, testToken)
	ids := map[string]int{}
	for _, id := range []string{"uid-a", "uid-b"} {
		r, _ := run(t, c, map[string]any{"session_id": id, "language": "bash", "code": "echo x > mine.txt; id -u"})
		uid, err := strconv.Atoi(strings.TrimSpace(r.Stdout))
		if err != nil || uid < 1_900_000_000 {
			t.Fatalf("%s runs as %q", id, r.Stdout)
		}
		ids[id] = uid
	}
	if ids["uid-a"] == ids["uid-b"] {
		t.Fatalf("two live sessions share uid %d", ids["uid-a"])
	}
	// Each workspace and what the sandbox wrote in it belong to its uid.
	owners := map[int]bool{}
	ents, _ := os.ReadDir(filepath.Join(root, "workspaces"))
	for _, de := range ents {
		for _, rel := range []string{"", "mine.txt"} {
			fi, err := os.Lstat(filepath.Join(root, "workspaces", de.Name(), rel))
			if err != nil {
				t.Fatal(err)
			}
			owners[int(fi.Sys().(*syscall.Stat_t).Uid)] = true
		}
	}
	if len(owners) != 2 || !owners[ids["uid-a"]] || !owners[ids["uid-b"]] {
		t.Fatalf("workspace owners %v, session uids %v", owners, ids)
	}
	b.Stop(t)
	b2 := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: env})
	c2 := b2.Client(t, testToken)
	r, _ := run(t, c2, map[string]any{"session_id": "uid-a", "language": "python",
		"code": "import os\nopen('mine.txt', 'a').write('y')\nprint(os.getuid(), open('mine.txt').read().split())"})
	if want := fmt.Sprintf("%d ['x', 'y']", ids["uid-a"]); strings.TrimSpace(r.Stdout) != want {
		t.Fatalf("after a restart: %q, want %q", r.Stdout, want)
	}
}
