package tests

import (
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
)

// TestSIGKILLDuringAuditAppends kills the broker with SIGKILL at a random
// moment while many clients call it at once, several times over one
// SANDBOX_ROOT: after each kill `audit verify` passes on what was left,
// and the broker starts again on it (its own integrity checks pass).
func TestSIGKILLDuringAuditAppends(t *testing.T) {
	const rounds, clients = 4, 8
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, seed))
	root := brokerRoot(t)
	env := map[string]string{"SANDBOX_BACKEND": "none", "RATE_LIMIT_PER_MINUTE": "100000"}
	for round := range rounds {
		b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: env})
		var ok atomic.Int64
		var clientsOf []*client.Client
		for range clients {
			clientsOf = append(clientsOf, b.Client(t, testToken))
		}
		stop := callLoop(clientsOf, succeeded(&ok))
		// At least a few hundred rows, so kills land around checkpoints
		// (every 256 rows) as well as between them.
		target := int64(50 + rng.IntN(400))
		eventually(t, 60*time.Second, "calls under way", func() bool { return ok.Load() >= target })
		time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond)
		b.Kill()
		stop()
		t.Logf("round %d: killed after %d calls", round, ok.Load())
		if code, out := verifyCLI(t, root); code != 0 || !strings.HasPrefix(out, "OK") {
			t.Fatalf("round %d: audit verify after SIGKILL: exit %d: %s", round, code, out)
		}
	}
	b := StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: env})
	if res := callTool(t, b.Client(t, testToken), "get_usage", nil); res.IsError {
		t.Fatalf("after the last kill: %+v", res.Content)
	}
	b.Stop(t)
	if code, out := verifyCLI(t, root); code != 0 || !strings.HasPrefix(out, "OK") {
		t.Fatalf("audit verify at the end: exit %d: %s", code, out)
	}
}
