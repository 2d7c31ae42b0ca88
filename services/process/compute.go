package process

import (
	"strconv"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

var _ sandbox.Describer = (*Session)(nil)

// Compute is the session's bubblewrap sandbox, by the host pid of bwrap,
// when one is running.
func (s *Session) Compute() []sandbox.Compute {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sb == nil || !s.sb.alive() {
		return []sandbox.Compute{}
	}
	return []sandbox.Compute{{Kind: "bwrap", ID: "pid " + strconv.Itoa(s.sb.pid)}}
}
