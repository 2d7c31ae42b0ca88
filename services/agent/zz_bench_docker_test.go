//go:build agentbench

package agent

import (
	"context"
	"os"
	"sort"
	"testing"
	"time"
)

func benchOne(t *testing.T, name, code string, n int) {
	sock := "/tmp/agentbench/run/agent.sock"
	ctx := context.Background()
	for i := 0; i < 5; i++ {
		r, err := Run(ctx, sock, Request{Code: code, TimeoutMS: 20000})
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("%v %+v %s", err, r, r.Stderr)
		}
	}
	var rt, ag []float64
	for i := 0; i < n; i++ {
		t0 := time.Now()
		r, err := Run(ctx, sock, Request{Code: code, TimeoutMS: 20000})
		d := time.Since(t0)
		if err != nil || r.ExitCode != 0 || !r.Zygote {
			t.Fatalf("%v %+v %s", err, r, r.Stderr)
		}
		rt = append(rt, float64(d.Microseconds())/1000)
		ag = append(ag, float64(r.DurationMS))
	}
	sort.Float64s(rt)
	sort.Float64s(ag)
	p := func(xs []float64, q float64) float64 { return xs[int(q*float64(len(xs)-1))] }
	t.Logf("%s: roundtrip p50 %.2f p95 %.2f min %.2f | agent dur p50 %.0f p95 %.0f", name, p(rt, .5), p(rt, .95), rt[0], p(ag, .5), p(ag, .95))
}

func TestDockerBench(t *testing.T) {
	n := 60
	if os.Getenv("BENCH_N") != "" {
		n = 200
	}
	benchOne(t, "print(1)", "print(1)", n)
	benchOne(t, "pandas+mpl", `import pandas as pd, numpy as np, matplotlib.pyplot as plt
df = pd.DataFrame({"x": np.arange(100), "y": np.random.rand(100)})
fig, ax = plt.subplots()
df.plot(x="x", y="y", ax=ax)
fig.savefig("/tmp/out.png")
print(df["y"].mean())
`, n/2)
	benchOne(t, "print(1) again", "print(1)", n)
}
