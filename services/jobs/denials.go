package jobs

import (
	"encoding/json"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
)

// EgressDenial is a network request a job's egress proxy refused: which
// host, and which rule refused it. The tools report these beside the
// output, because a program usually shows only "403".
type EgressDenial struct {
	Host   string `json:"host"`
	Port   int    `json:"port,omitempty"`
	Reason string `json:"reason"`
	Rule   string `json:"rule,omitempty"`
	Count  int    `json:"count"` // refusals of this host, port and rule
}

// EgressBuilder builds a job's network path (its Spec.Egress); deny
// records each request the path refuses.
type EgressBuilder func(deny func(EgressDenial)) (func(net.Listener), error)

// maxDenials bounds the distinct denials kept per job; later ones are
// still counted in Info.EgressDeniedOther.
const maxDenials = 20

// deniedFile keeps an ended job's denials beside its log.
const deniedFile = "egress_denied.json"

// deny records a refusal on the live job j. The first refusal of each
// host, port and rule also goes into the output log, in order with the
// output it explains.
func (m *Manager) deny(j *job, d EgressDenial) {
	j.mu.Lock()
	for i := range j.denials {
		if x := &j.denials[i]; x.Host == d.Host && x.Port == d.Port && x.Rule == d.Rule && x.Reason == d.Reason {
			x.Count++
			j.mu.Unlock()
			return
		}
	}
	if len(j.denials) >= maxDenials {
		j.deniedOther++
		j.mu.Unlock()
		return
	}
	d.Count = 1
	j.denials = append(j.denials, d)
	j.mu.Unlock()
	target := d.Host
	if d.Port != 0 {
		target = net.JoinHostPort(d.Host, strconv.Itoa(d.Port))
	}
	if _, err := j.log.append(Event{Type: EventEgressDenied, Host: d.Host, Port: d.Port, Rule: d.Rule,
		Message: "the network proxy refused " + target + " (" + d.Reason + ")"}, m.o.Now()); err != nil {
		m.o.Log.Debug().Str("execution_id", j.id).Msg("job_log_append_failed")
	}
}

// deniedRecord is what deniedFile holds.
type deniedRecord struct {
	Denials []EgressDenial `json:"denials"`
	Other   int            `json:"other,omitempty"`
}

// saveDenials writes an ending job's denials next to its log.
func (m *Manager) saveDenials(j *job) {
	j.mu.Lock()
	rec := deniedRecord{Denials: append([]EgressDenial(nil), j.denials...), Other: j.deniedOther}
	j.mu.Unlock()
	if len(rec.Denials) == 0 {
		return
	}
	b, _ := json.Marshal(rec)
	if err := os.WriteFile(filepath.Join(m.logDir(j.id), deniedFile), b, 0o600); err != nil {
		m.o.Log.Warn().Str("execution_id", j.id).Msg("job_denials_write_failed")
	}
}

// denials returns the job's refusals (and how many more there were) from
// the live job or, once it has ended, from the file beside its log. The
// caller has checked that principal owns id.
func (m *Manager) denials(principal, id string) ([]EgressDenial, int) {
	if j := m.liveJob(principal, id); j != nil {
		j.mu.Lock()
		defer j.mu.Unlock()
		return append([]EgressDenial(nil), j.denials...), j.deniedOther
	}
	b, err := os.ReadFile(filepath.Join(m.logDir(id), deniedFile))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			m.o.Log.Warn().Str("execution_id", id).Msg("job_denials_read_failed")
		}
		return nil, 0
	}
	var rec deniedRecord
	if json.Unmarshal(b, &rec) != nil {
		return nil, 0
	}
	return rec.Denials, rec.Other
}
