package logging

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/tests/srcscan"
)

// eventName finds zerolog event names in Go source: .Msg("name").
var eventName = regexp.MustCompile(`\.Msgf?\("([a-z0-9_]+)"`)

// TestEventNamesSurviveRedaction: every log line passes through the
// redactor, whose token shapes (csb_…, gh…, long hex) must not eat the
// event names themselves, or the log says "[REDACTED]" where it should say
// what happened (csb_session_connected once did).
func TestEventNamesSurviveRedaction(t *testing.T) {
	r := redact.New([]string{"configured-secret-0123456789"}, []string{"/srv/sandbox-broker"})
	names, err := srcscan.Submatches("../..", eventName)
	if err != nil {
		t.Fatal(err)
	}
	if len(names) < 50 {
		t.Fatalf("found only %d event names; the pattern or the walk is wrong", len(names))
	}
	for name, path := range names {
		var out bytes.Buffer
		l := New(&out, "debug", r)
		l.Info().Msg(name)
		if !strings.Contains(out.String(), `"message":"`+name+`"`) {
			t.Errorf("event %s (%s) is logged as %s", name, path, strings.TrimSpace(out.String()))
		}
	}
}
