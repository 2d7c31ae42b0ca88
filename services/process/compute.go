package process

import (
	"slices"
	"strconv"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

var _ sandbox.Describer = (*Session)(nil)

// Compute is the session's running bubblewrap sandboxes, by the host pid
// of bwrap.
func (s *Session) Compute() []sandbox.Compute {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := []sandbox.Compute{}
	for _, sb := range s.sbs {
		if sb.alive() {
			out = append(out, sandbox.Compute{Kind: "bwrap", ID: "pid " + strconv.Itoa(sb.pid)})
		}
	}
	slices.SortFunc(out, func(a, b sandbox.Compute) int { return strings.Compare(a.ID, b.ID) })
	return out
}
