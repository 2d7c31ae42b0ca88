package middleware

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// SandboxMetrics are the sandbox series (issue 13): executions by backend
// and language, their duration, time-outs and errors, and the sessions with
// a live sandbox. Language is a runner language, "shell" for
// execute_code's commands or "agent" for tasks: a bounded set.
type SandboxMetrics struct {
	executions *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	timeouts   *prometheus.CounterVec
	errors     *prometheus.CounterVec
}

// Execution outcomes SandboxMetrics.Observe takes.
const (
	ExecOK      = "ok"
	ExecTimeout = "timeout"
	ExecError   = "error" // non-zero exit, signal, OOM, or the sandbox failed
)

// NewSandboxMetrics registers the series on m's registry; active reports
// the sessions with a live sandbox when scraped.
func (m *Metrics) NewSandboxMetrics(active func() int) *SandboxMetrics {
	labels := []string{"backend", "language"}
	s := &SandboxMetrics{
		executions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandbox_executions_total", Help: "Finished sandbox executions (run_code, execute_code, execute_task).",
		}, labels),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sandbox_duration_seconds", Help: "Sandbox execution wall time.",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600},
		}, labels),
		timeouts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandbox_timeouts_total", Help: "Sandbox executions ended by their time-out.",
		}, labels),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandbox_errors_total", Help: "Sandbox executions that failed (non-zero exit, signal, OOM, sandbox error); time-outs are counted apart.",
		}, labels),
	}
	m.Registry.MustRegister(s.executions, s.duration, s.timeouts, s.errors,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "sandbox_active_sessions", Help: "Sessions with a live sandbox.",
		}, func() float64 { return float64(active()) }))
	return s
}

// Observe records one finished execution; nil-safe.
func (s *SandboxMetrics) Observe(backend, language, outcome string, d time.Duration) {
	if s == nil {
		return
	}
	s.executions.WithLabelValues(backend, language).Inc()
	s.duration.WithLabelValues(backend, language).Observe(d.Seconds())
	switch outcome {
	case ExecTimeout:
		s.timeouts.WithLabelValues(backend, language).Inc()
	case ExecError:
		s.errors.WithLabelValues(backend, language).Inc()
	}
}
