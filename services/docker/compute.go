package docker

import (
	"sort"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

var _ sandbox.Describer = (*Session)(nil)

// Compute lists the session's containers, one per language it ran.
func (s *Session) Compute() []sandbox.Compute {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]sandbox.Compute, 0, len(s.ctrs))
	for lang, c := range s.ctrs {
		out = append(out, sandbox.Compute{Kind: "container", ID: shortID(c.dockerID), Language: lang})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Language < out[j].Language })
	return out
}
