package hosted

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// Latencies injected into the fake: every management API answer, and
// every message the VM's agent sends, is held back this long.
const (
	benchREST  = 50 * time.Millisecond
	benchAgent = 20 * time.Millisecond
)

// BenchmarkHostedSession measures a hosted session against the fake with
// injected latencies: create → first command (fork, join, helper, run)
// and a warm command's round trip, beside the fake's own latency as the
// baseline: one management API call, one agent call, and a bare command
// through the agent as the SDK runs it (no helper, no file sync).
func BenchmarkHostedSession(b *testing.B) {
	e := newEnv(b, nil, csbfake.WithLatency(benchREST, benchAgent))
	e.fake.SetLimits(csbfake.Limits{RequestsHourly: 1 << 30, SandboxesHourly: 1 << 20, ConcurrentVMs: 1000})
	warm := e.open(wid1, "alice")
	echo := sandbox.ExecRequest{Language: "bash", Code: "echo hi", Timeout: 30 * time.Second}
	exec := func(b *testing.B, s *Session) {
		res, err := s.Exec(ctx(b), echo)
		if err != nil || string(res.Stdout) != "hi\n" {
			b.Fatalf("run: %+v %v", res, err)
		}
	}
	exec(b, warm)
	start, err := e.b.c.Start(ctx(b), warm.v.id(), codesandbox.StartOptions{})
	if err != nil {
		b.Fatal(err)
	}
	bare, err := codesandbox.DialPitcher(ctx(b), start.PitcherURL, start.PitcherToken, codesandbox.PitcherOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer bare.Close()

	p50 := map[string]time.Duration{}
	cases := []struct {
		name string
		call func(b *testing.B) time.Duration
	}{
		{"create_to_first_command", func(b *testing.B) time.Duration {
			s := e.open(newWID(), "bench")
			d := timed(func() { exec(b, s) })
			if err := s.Destroy(ctx(b)); err != nil {
				b.Fatal(err)
			}
			return d
		}},
		{"warm_command", func(b *testing.B) time.Duration {
			return timed(func() { exec(b, warm) })
		}},
		{"baseline_rest_call", func(b *testing.B) time.Duration {
			return timed(func() {
				if _, err := e.b.c.MetaInfo(ctx(b)); err != nil {
					b.Fatal(err)
				}
			})
		}},
		{"baseline_agent_call", func(b *testing.B) time.Duration {
			return timed(func() {
				if _, err := bare.Stat(ctx(b), "/project/workspace"); err != nil {
					b.Fatal(err)
				}
			})
		}},
		{"baseline_bare_agent_command", func(b *testing.B) time.Duration {
			return timed(func() { bareRun(b, bare) })
		}},
		// The same two without the injected latency: what the helper and
		// the file sync cost on their own.
		{"warm_command_no_latency", func(b *testing.B) time.Duration {
			e.fake.SetLatency(0, 0)
			defer e.fake.SetLatency(benchREST, benchAgent)
			return timed(func() { exec(b, warm) })
		}},
		{"baseline_bare_agent_command_no_latency", func(b *testing.B) time.Duration {
			e.fake.SetLatency(0, 0)
			defer e.fake.SetLatency(benchREST, benchAgent)
			return timed(func() { bareRun(b, bare) })
		}},
	}
	for _, cs := range cases {
		b.Run(cs.name, func(b *testing.B) {
			lat := make([]time.Duration, 0, b.N)
			for i := 0; i < b.N; i++ {
				lat = append(lat, cs.call(b))
			}
			q50, q95 := percentile(lat, 50), percentile(lat, 95)
			p50[cs.name] = q50
			b.ReportMetric(ms(q50), "p50-ms")
			b.ReportMetric(ms(q95), "p95-ms")
			b.ReportMetric(0, "ns/op") // the percentiles are the figures
		})
	}
	if p50["warm_command"] > 0 && p50["baseline_agent_call"] > 0 {
		fmt.Printf("summary: hosted session (fake latency %v per API answer, %v per agent message): create to first command p50 %.0f ms (%.1f API calls + %.1f agent calls' worth), warm command p50 %.0f ms vs a bare command through the agent %.0f ms and one agent call %.0f ms\n",
			benchREST, benchAgent, ms(p50["create_to_first_command"]), float64(p50["create_to_first_command"])/float64(p50["baseline_rest_call"]),
			float64(p50["create_to_first_command"]-p50["baseline_rest_call"])/float64(p50["baseline_agent_call"]),
			ms(p50["warm_command"]), ms(p50["baseline_bare_agent_command"]), ms(p50["baseline_agent_call"]))
		fmt.Printf("summary: without injected latency, warm command p50 %.0f ms vs a bare command through the agent %.0f ms\n",
			ms(p50["warm_command_no_latency"]), ms(p50["baseline_bare_agent_command_no_latency"]))
	}
}

// bareRun runs `echo hi` through the agent as the SDK does.
func bareRun(b *testing.B, p *codesandbox.Pitcher) {
	if r, err := p.Run(ctx(b), "echo hi", "/project/workspace", 0); err != nil || r.ExitCode != 0 {
		b.Fatalf("%+v %v", r, err)
	}
}

func newWID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func timed(f func()) time.Duration {
	start := time.Now()
	f()
	return time.Since(start)
}

func percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
