package broker

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/egress"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// maxDecisions is how many recent decisions the operator view keeps.
const maxDecisions = 200

// decisionLog keeps the reaper's and egress proxies' latest decisions in
// memory, newest last (a ring: old ones drop off).
type decisionLog struct {
	mu   sync.Mutex
	ring []tools.Decision
	next int
}

func (l *decisionLog) add(d tools.Decision) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.ring) < maxDecisions {
		l.ring = append(l.ring, d)
		return
	}
	l.ring[l.next] = d
	l.next = (l.next + 1) % maxDecisions
}

// list returns the decisions newest first.
func (l *decisionLog) list() []tools.Decision {
	l.mu.Lock()
	out := append(append([]tools.Decision{}, l.ring[l.next:]...), l.ring[:l.next]...)
	l.mu.Unlock()
	slices.Reverse(out)
	return out
}

func (l *decisionLog) reaped(r sessions.Reaped) {
	l.add(tools.Decision{At: r.At, Source: "reaper", Action: r.Action, Principal: r.Principal, Subject: r.SessionID})
}

func (l *decisionLog) egress(principal string, d egress.Decision) {
	action := "denied"
	if d.Allowed {
		action = "allowed"
	}
	subject := d.Host
	if d.Port != 0 {
		subject = fmt.Sprintf("%s:%d", d.Host, d.Port)
	}
	l.add(tools.Decision{At: time.Now().UTC(), Source: "egress", Action: action, Principal: principal, Subject: subject, Reason: d.Reason})
}
