// Package logging builds the broker's zerolog loggers: JSON lines, one child
// logger per component, every line passed through the redactor.
package logging

import (
	"io"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
)

// New returns a root logger writing redacted JSON lines to w.
func New(w io.Writer, level string, r *redact.Redactor) zerolog.Logger {
	lvl, err := zerolog.ParseLevel(level)
	if err != nil {
		lvl = zerolog.InfoLevel
	}
	return zerolog.New(&redactingWriter{w: w, r: r}).Level(lvl).With().Timestamp().Logger()
}

// Component returns a child logger tagged with its component.
func Component(l zerolog.Logger, name string) zerolog.Logger {
	return l.With().Str("component", name).Logger()
}

type redactingWriter struct {
	w io.Writer
	r *redact.Redactor
}

// Write redacts one event. It reports len(p) so zerolog sees no short write
// when the redacted line is shorter or longer.
func (rw *redactingWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(rw.w, rw.r.String(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}
