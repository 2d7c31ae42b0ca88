package process

import (
	"testing"
	"time"
)

// BenchmarkExecPrint1 is a warm python print(1) through the backend alone
// (no MCP, no audit): the sandbox's share of run_code's latency.
func BenchmarkExecPrint1(b *testing.B) {
	be := newBackend(b, nil)
	s := open(b, be)
	waitZygote(b, s)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if res := exec1(b, s, "python", "print(1)", 10*time.Second); string(res.Stdout) != "1\n" {
			b.Fatalf("%+v", res)
		}
	}
}
