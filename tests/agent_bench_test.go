package tests

import (
	"bufio"
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"

	fake "github.com/sandbox-broker/sandbox-broker/services/modelgw/anthropicfake"
)

// BenchmarkAgentTasks runs AGENT_BENCH_SESSIONS (default 100) execute_task
// calls at once, each in a session of its own, on one broker: the real
// Claude Code CLI in the agent runner against the fake model, three model
// calls and two tools a task (the summary case of TestAgentTasks). It
// reports wall time, errors, task latency p50/p95 against one task alone
// in the same run, the broker's peak RSS, and the agent containers' peak
// memory per session; then it cleans every session up and fails on any
// container left behind. Not part of `make test`: `make bench-agent`.
func BenchmarkAgentTasks(b *testing.B) {
	requireAgentImage(b)
	n := 100
	if v, err := strconv.Atoi(os.Getenv("AGENT_BENCH_SESSIONS")); err == nil && v > 0 {
		n = v
	}
	probe := ""
	f := fake.New(fake.Options{Key: realModelKey, Script: agentScript(&probe)})
	b.Cleanup(f.Close)
	tokensFile, tokens := writeTokens(b, map[string]string{"alice": "pro", "bob": "pro"})
	broker := StartHTTP(b, BrokerOpts{Env: map[string]string{
		"SANDBOX_BACKEND": "docker", "SANDBOX_POOL_SIZE": "0", "MCP_TOKENS_FILE": tokensFile, "RATE_LIMIT_PER_MINUTE": "100000",
		"SANDBOX_MAX_CONTAINERS": strconv.Itoa(n + 10), "SANDBOX_MAX_CONCURRENT": strconv.Itoa(n + 10),
		"MCP_MAX_UNAUTH_CONNS_PER_ADDR": "1024", // every client comes from 127.0.0.1 at once
		"ANTHROPIC_API_KEY":             realModelKey, "ANTHROPIC_API_URL": f.URL, "LOG_LEVEL": "info",
	}})
	csv := base64.StdEncoding.EncodeToString([]byte("a,b\n1,2\n3,4\n5,6\n"))
	args := map[string]any{"task": caseSummary + " Summarise data.csv into summary.txt.", "timeout": 600,
		"files": []map[string]any{{"path": "data.csv", "content": csv}}}
	names := []string{"alice", "bob"}

	for i := 0; i < b.N; i++ {
		// Baseline: one task alone, three times.
		c := broker.Client(b, tokens["alice"])
		var alone []time.Duration
		var sessions []string
		for k := 0; k < 3; k++ {
			start := time.Now()
			r, err := benchTask(b, c, args)
			if err != nil {
				b.Fatalf("baseline task: %v", err)
			}
			alone = append(alone, time.Since(start))
			sessions = append(sessions, r.SessionID)
		}
		cleanupSessions(b, c, sessions)

		// n at once, each with its own MCP client (half per principal).
		clients := make([]*client.Client, n)
		for k := range clients {
			clients[k] = broker.Client(b, tokens[names[k%2]])
		}
		stop := make(chan struct{})
		peaks := sampleMemory(broker, stop)
		var mu sync.Mutex
		var lat []time.Duration
		var failures []string
		sessionsOf := make([][]string, 2)
		var wg sync.WaitGroup
		start := time.Now()
		for k := 0; k < n; k++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				t0 := time.Now()
				r, err := benchTask(b, clients[k], args)
				d := time.Since(t0)
				mu.Lock()
				defer mu.Unlock()
				if r.SessionID != "" {
					sessionsOf[k%2] = append(sessionsOf[k%2], r.SessionID)
				}
				if err != nil {
					failures = append(failures, err.Error())
					return
				}
				lat = append(lat, d)
			}()
		}
		wg.Wait()
		wall := time.Since(start)
		close(stop)
		pk := <-peaks
		// CPU the agent containers used (cpuacct), against the two cores'
		// capacity over the wall time: the run is CPU-bound when they meet.
		var cpu time.Duration
		for _, id := range containerIDs(broker.Root) {
			if v, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpuacct/docker", id, "cpuacct.usage")); err == nil {
				ns, _ := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
				cpu += time.Duration(ns)
			}
		}

		for k, name := range names {
			cleanupSessions(b, broker.Client(b, tokens[name]), sessionsOf[k])
		}
		if left := agentContainers(b, broker.Root); len(left) != 0 {
			b.Fatalf("%d agent containers left after cleanup_session", len(left))
		}
		b.ReportMetric(wall.Seconds(), "wall-s")
		b.ReportMetric(float64(len(failures)), "errors")
		b.ReportMetric(ms(percentile(lat, 50)), "task-p50-ms")
		b.ReportMetric(ms(percentile(lat, 95)), "task-p95-ms")
		b.ReportMetric(ms(percentile(alone, 50)), "alone-p50-ms")
		b.ReportMetric(float64(pk.brokerRSS)/(1<<20), "broker-peak-rss-MiB")
		b.ReportMetric(float64(pk.containerRSS)/float64(max(pk.containers, 1))/(1<<20), "rss-per-session-MiB")
		b.ReportMetric(float64(pk.containerUsage)/float64(max(pk.containers, 1))/(1<<20), "mem-per-session-MiB")
		b.ReportMetric(cpu.Seconds()/float64(n), "cpu-s-per-task")
		b.ReportMetric(0, "ns/op")
		fmt.Printf("summary: %d concurrent tasks in %.1f s, %d errors; task p50 %.1f s p95 %.1f s (one task alone: p50 %.1f s); "+
			"broker peak RSS %.0f MiB; at the peak %d agent containers held %.0f MiB RSS (%.0f MiB each) and %.0f MiB with page cache (%.0f MiB each); host MemAvailable fell by %.0f MiB; the agent containers used %.0f CPU-s (%.2f a task; %d cores give %.0f CPU-s in the wall time)\n",
			n, wall.Seconds(), len(failures), percentile(lat, 50).Seconds(), percentile(lat, 95).Seconds(), percentile(alone, 50).Seconds(),
			float64(pk.brokerRSS)/(1<<20), pk.containers, float64(pk.containerRSS)/(1<<20), float64(pk.containerRSS)/float64(max(pk.containers, 1))/(1<<20),
			float64(pk.containerUsage)/(1<<20), float64(pk.containerUsage)/float64(max(pk.containers, 1))/(1<<20), float64(pk.hostDrop)/(1<<20),
			cpu.Seconds(), cpu.Seconds()/float64(n), runtime.NumCPU(), wall.Seconds()*float64(runtime.NumCPU()))
		if len(failures) > 0 {
			b.Errorf("%d of %d tasks failed; first: %s", len(failures), n, failures[0])
		}
	}
}

// benchTask runs one task to its end (following it past execute_task's
// wait when the machine is slow) and returns its outcome.
func benchTask(b *testing.B, c *client.Client, args map[string]any) (taskResult, error) {
	// Longer than callTool allows: a client's own limit is not what is
	// measured here (execute_task answers within 50 s of its start).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var req mcp.CallToolRequest
	req.Params.Name, req.Params.Arguments = "execute_task", args
	res, err := c.CallTool(ctx, req)
	if err != nil {
		return taskResult{}, err
	}
	var r taskResult
	resultJSON(b, res, &r)
	if res.IsError {
		return r, fmt.Errorf("execute_task refused: %+v", res.Content)
	}
	if r.Status == "running" {
		sess := r.SessionID
		r, _ = followTask(b, c, r)
		r.SessionID = sess
	}
	if r.Status != "completed" || !strings.Contains(r.Output, "rows=3 mean_b=4.00") {
		return r, fmt.Errorf("task %s: %s %s; output %.300q", r.ExecutionID, r.Status, r.Error, r.Output)
	}
	return r, nil
}

func cleanupSessions(b *testing.B, c *client.Client, ids []string) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if res := callTool(b, c, "cleanup_session", map[string]any{"session_id": id}); res.IsError {
				b.Errorf("cleanup_session %s: %+v", id, res.Content)
			}
		}()
	}
	wg.Wait()
}

type memPeaks struct {
	brokerRSS      int64
	containers     int   // agent containers at the container-memory peak
	containerRSS   int64 // their anonymous memory (memory.stat total_rss)
	containerUsage int64 // with page cache (memory.usage_in_bytes)
	hostDrop       int64 // largest fall of MemAvailable from the start
}

// sampleMemory polls every 250 ms until stop and sends the peaks.
func sampleMemory(broker *Broker, stop <-chan struct{}) <-chan memPeaks {
	out := make(chan memPeaks, 1)
	go func() {
		var p memPeaks
		base := meminfo("MemAvailable")
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			p.brokerRSS = max(p.brokerRSS, procStatus(broker.cmd.Process.Pid, "VmRSS"))
			p.hostDrop = max(p.hostDrop, base-meminfo("MemAvailable"))
			var rss, usage int64
			ids := containerIDs(broker.Root)
			for _, id := range ids {
				dir := filepath.Join("/sys/fs/cgroup/memory/docker", id)
				rss += statField(filepath.Join(dir, "memory.stat"), "total_rss")
				if v, err := os.ReadFile(filepath.Join(dir, "memory.usage_in_bytes")); err == nil {
					n, _ := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
					usage += n
				}
			}
			if rss > p.containerRSS {
				p.containerRSS, p.containerUsage, p.containers = rss, usage, len(ids)
			}
			select {
			case <-stop:
				out <- p
				return
			case <-t.C:
			}
		}
	}()
	return out
}

// containerIDs lists the full IDs of the broker's agent containers.
func containerIDs(root string) []string {
	out, err := exec.Command("docker", "ps", "-q", "--no-trunc", "--filter", "label=sandbox.root="+root, "--filter", "label=sandbox.language=agent").Output()
	if err != nil {
		return nil
	}
	return strings.Fields(string(out))
}

// procStatus reads a /proc/<pid>/status field in bytes.
func procStatus(pid int, field string) int64 {
	return kbField(fmt.Sprintf("/proc/%d/status", pid), field+":")
}

func meminfo(field string) int64 { return kbField("/proc/meminfo", field+":") }

func kbField(path, key string) int64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), key); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return n << 10
		}
	}
	return 0
}

func statField(path, key string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, key+" "); ok {
			n, _ := strconv.ParseInt(rest, 10, 64)
			return n
		}
	}
	return 0
}
