package tests

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// BenchmarkUsageThroughput measures get_usage calls per second from 8
// concurrent MCP HTTP clients (the whole tool-call path: identity, rate
// limit, quota view, two audit rows), interleaved with the same clients'
// resources/templates/list requests to the same broker (transport and
// authentication, no tool path) as the same-run baseline. Each iteration is one round of each.
// Run: go test -run '^$' -bench BenchmarkUsageThroughput -benchtime 40x ./tests/
func BenchmarkUsageThroughput(b *testing.B) {
	const clients, perRound = 8, 50
	broker := StartHTTP(b, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none", "RATE_LIMIT_PER_MINUTE": "100000"}})
	cs := make([]*client.Client, clients)
	for i := range cs {
		cs[i] = broker.Client(b, testToken)
	}
	usage := func(c *client.Client) error {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		var req mcp.CallToolRequest
		req.Params.Name = "get_usage"
		res, err := c.CallTool(ctx, req)
		if err == nil && res.IsError {
			err = fmt.Errorf("get_usage: %+v", res.Content)
		}
		return err
	}
	// The baseline: a request with a small answer that skips the tool
	// path (no audit row, no quota).
	templates := func(c *client.Client) error {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		_, err := c.ListResourceTemplates(ctx, mcp.ListResourceTemplatesRequest{})
		return err
	}
	// round runs perRound calls on every client at once and returns the
	// wall time.
	round := func(call func(*client.Client) error) time.Duration {
		var wg sync.WaitGroup
		errs := make(chan error, clients)
		start := time.Now()
		for _, c := range cs {
			wg.Go(func() {
				for range perRound {
					if err := call(c); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		d := time.Since(start)
		close(errs)
		for err := range errs {
			b.Fatal(err)
		}
		return d
	}
	round(usage) // warm: connections, the principal's quota view
	var usageT, baseT time.Duration
	for i := 0; i < b.N; i++ { // interleaved: the machine's noise hits both alike
		usageT += round(usage)
		baseT += round(templates)
	}
	calls := float64(b.N * clients * perRound)
	u, p := calls/usageT.Seconds(), calls/baseT.Seconds()
	b.ReportMetric(u, "get_usage-calls/s")
	b.ReportMetric(p, "baseline_templates_list-calls/s")
	b.ReportMetric(0, "ns/op")
	if b.N > 1 { // the figures, not the 1-iteration probe
		fmt.Printf("target: get_usage with %d clients %.0f calls/s (target >= 2000) vs resources/templates/list through the same broker %.0f calls/s (%.2fx the baseline)\n",
			clients, u, p, u/p)
	}
}
