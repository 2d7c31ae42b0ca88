package middleware

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics are the chain's Prometheus series, on a registry of their own so
// tests and several brokers in one process do not collide.
type Metrics struct {
	Registry      *prometheus.Registry
	calls         *prometheus.CounterVec
	duration      *prometheus.HistogramVec
	rateLimited   *prometheus.CounterVec
	auditFailures prometheus.Counter
	// auditSuppressed counts refused calls whose audit row was throttled.
	auditSuppressed prometheus.Counter
}

// NewMetrics registers the series plus Go and process collectors.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandbox_broker_tool_calls_total", Help: "Tool calls by tool and outcome.",
		}, []string{"tool", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sandbox_broker_tool_call_duration_seconds", Help: "Tool call duration.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120},
		}, []string{"tool"}),
		rateLimited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandbox_broker_rate_limit_rejections_total", Help: "Calls refused by a rate limit.",
		}, []string{"tool"}),
		auditFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sandbox_broker_audit_write_failures_total", Help: "Audit rows that could not be written.",
		}),
		auditSuppressed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "sandbox_broker_audit_rejections_suppressed_total", Help: "Refused calls whose audit row was throttled.",
		}),
	}
	m.Registry.MustRegister(m.calls, m.duration, m.rateLimited, m.auditFailures, m.auditSuppressed,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *Metrics) observe(tool, outcome string, d time.Duration) {
	m.calls.WithLabelValues(tool, outcome).Inc()
	m.duration.WithLabelValues(tool).Observe(d.Seconds())
}
