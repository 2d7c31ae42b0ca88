package broker

import (
	"net"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/egress"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
)

// egressQuotas holds one connection and byte allowance per session, shared
// by every execution of that session with network access.
type egressQuotas struct {
	mu     sync.Mutex
	m      map[string]*egressQuota
	maxAge time.Duration // a session never outlives this
}

type egressQuota struct {
	q       *egress.Quota
	created time.Time
}

// get returns session key's quota, dropping those older than any session
// can be (their sessions are gone).
func (e *egressQuotas) get(key string, maxConns int, maxBytes int64) *egress.Quota {
	e.mu.Lock()
	defer e.mu.Unlock()
	now := time.Now()
	if e.m == nil {
		e.m = map[string]*egressQuota{}
	}
	for k, q := range e.m {
		if now.Sub(q.created) > e.maxAge {
			delete(e.m, k)
		}
	}
	q := e.m[key]
	if q == nil {
		q = &egressQuota{q: egress.NewQuota(maxConns, maxBytes), created: now}
		e.m[key] = q
	}
	return q.q
}

// egressFor returns an execution's egress proxy for policy. It resolves
// and dials from the broker's host, re-checking every address it connects
// to against the blocked ranges; its caps are the session's. Each verdict
// goes to onDecision (the job records refusals for the model).
func (b *Broker) egressFor(principal, sessionKey string, policy egress.Policy, onDecision func(egress.Decision)) (func(net.Listener), error) {
	log := logging.Component(b.log, "egress").With().Str("principal", principal).Str("workspace", sessionKey).Logger()
	p, err := egress.New(egress.Options{
		Policy: policy,
		Quota:  b.egress.get(sessionKey, b.cfg.EgressMaxConns, b.cfg.EgressMaxMB<<20),
		Log:    log,
		OnDecision: func(d egress.Decision) {
			b.decisions.egress(principal, d)
			b.pm.egressDecision(d)
			if onDecision != nil {
				onDecision(d)
			}
		},
	})
	if err != nil {
		return nil, err
	}
	return func(ln net.Listener) { _ = p.Serve(ln) }, nil
}
