package broker

import (
	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// causeText renders a start-up failure for the operator's log. A message
// the broker wrote itself names settings and may suggest a value (such as
// a SANDBOX_ROOT path to use), so it keeps its text with only secrets and
// the known host roots removed; whatever it wraps from elsewhere (the
// Docker daemon, the kernel) loses every host path.
func causeText(r *redact.Redactor, err error, max int) string {
	e := brokererr.As(err)
	if e == nil {
		return r.Message(err.Error(), max)
	}
	s := r.String(e.Message)
	if c := e.Unwrap(); c != nil {
		s += ": " + r.Message(c.Error(), max)
	}
	return r.String(redact.Truncate(s, max))
}
