package broker

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/egress"
)

// productMetrics are the broker's series beyond the tool chain's own
// (middleware.Metrics): the warm pool, egress decisions, audit appends,
// and the requests made to GitHub and CodeSandbox. Every label has a
// bounded set of values.
type productMetrics struct {
	acquire     *prometheus.HistogramVec // language, source
	egress      *prometheus.CounterVec   // decision, reason
	auditAppend *prometheus.HistogramVec // outcome
	upstream    *prometheus.CounterVec   // service, outcome
	upstreamDur *prometheus.HistogramVec // service
}

func (b *Broker) registerMetrics(reg prometheus.Registerer) *productMetrics {
	m := &productMetrics{
		acquire: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sandbox_container_acquire_seconds", Help: "How long a session waited for its sandbox container: warm from the pool, or a cold start.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}, []string{"language", "source"}),
		egress: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandbox_egress_requests_total", Help: "Egress proxy decisions, by decision and reason.",
		}, []string{"decision", "reason"}),
		auditAppend: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sandbox_audit_append_seconds", Help: "Audit row appends (durable commit), by outcome.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5},
		}, []string{"outcome"}),
		upstream: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sandbox_upstream_requests_total", Help: "Requests to GitHub and CodeSandbox, by outcome (ok, client_error, rate_limited, server_error, network_error).",
		}, []string{"service", "outcome"}),
		upstreamDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "sandbox_upstream_request_duration_seconds", Help: "Duration of requests to GitHub and CodeSandbox.",
			Buckets: []float64{.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"service"}),
	}
	reg.MustRegister(m.acquire, m.egress, m.auditAppend, m.upstream, m.upstreamDur, poolCollector{b})
	return m
}

// poolCollector reports the warm pool at scrape time.
type poolCollector struct{ b *Broker }

var (
	poolReadyDesc  = prometheus.NewDesc("sandbox_pool_ready", "Warm sandbox containers ready to claim, per language.", []string{"language"}, nil)
	poolTargetDesc = prometheus.NewDesc("sandbox_pool_target", "Warm containers each pool keeps at least (SANDBOX_POOL_SIZE; demand raises a pool to up to 4 times that).", nil, nil)
)

func (p poolCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- poolReadyDesc
	ch <- poolTargetDesc
}

func (p poolCollector) Collect(ch chan<- prometheus.Metric) {
	if p.b.poolStats == nil {
		return
	}
	for lang, n := range p.b.poolStats() {
		ch <- prometheus.MustNewConstMetric(poolReadyDesc, prometheus.GaugeValue, float64(n), lang)
	}
	ch <- prometheus.MustNewConstMetric(poolTargetDesc, prometheus.GaugeValue, float64(p.b.cfg.PoolSize))
}

func (m *productMetrics) acquired(language, source string, d time.Duration) {
	m.acquire.WithLabelValues(language, source).Observe(d.Seconds())
}

func (m *productMetrics) egressDecision(d egress.Decision) {
	decision := "denied"
	if d.Allowed {
		decision = "allowed"
	}
	m.egress.WithLabelValues(decision, d.Reason).Inc()
}

// auditor is the audit log as every writer gets it: appends are timed.
func (b *Broker) auditor() timedAuditor { return timedAuditor{log: b.audit, m: b.pm} }

// timedAuditor measures every append, whoever writes it (the tool chain,
// the OAuth server, the console's logins).
type timedAuditor struct {
	log *audit.Log
	m   *productMetrics
}

func (a timedAuditor) Append(ctx context.Context, r audit.Record) (int64, error) {
	start := time.Now()
	seq, err := a.log.Append(ctx, r)
	outcome := "ok"
	if err != nil {
		outcome = "error"
	}
	a.m.auditAppend.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	return seq, err
}

// instrument counts a client's requests to service by outcome.
func (m *productMetrics) instrument(service string, rt http.RoundTripper) http.RoundTripper {
	if rt == nil {
		rt = http.DefaultTransport
	}
	return upstreamTransport{service: service, base: rt, m: m}
}

type upstreamTransport struct {
	service string
	base    http.RoundTripper
	m       *productMetrics
}

func (t upstreamTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	start := time.Now()
	resp, err := t.base.RoundTrip(r)
	t.m.upstreamDur.WithLabelValues(t.service).Observe(time.Since(start).Seconds())
	t.m.upstream.WithLabelValues(t.service, upstreamOutcome(resp, err)).Inc()
	return resp, err
}

// upstreamOutcome classes a response; rate limits are told apart because
// they are what an operator acts on (GitHub answers some with 403 and no
// remaining quota).
func upstreamOutcome(resp *http.Response, err error) string {
	switch {
	case err != nil || resp == nil:
		if errors.Is(err, context.Canceled) {
			return "cancelled"
		}
		return "network_error"
	case resp.StatusCode == http.StatusTooManyRequests,
		resp.StatusCode == http.StatusForbidden && resp.Header.Get("X-Ratelimit-Remaining") == "0":
		return "rate_limited"
	case resp.StatusCode >= 500:
		return "server_error"
	case resp.StatusCode >= 400:
		return "client_error"
	}
	return "ok"
}
