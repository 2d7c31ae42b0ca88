package broker

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// A start-up failure keeps the broker's own advice (a path to use) in the
// log, while secrets, the known roots and host paths from wrapped causes
// are still removed.
func TestCauseTextKeepsTheBrokersAdvice(t *testing.T) {
	const secret = "s3cret-value-0123456789"
	r := redact.New([]string{secret}, []string{"/srv/broker-root"})
	advice := brokererr.New(brokererr.Unavailable,
		"SANDBOX_ROOT is below a directory that uid 1900000000 cannot traverse; use a SANDBOX_ROOT such as /var/lib/sandbox-broker, or give its parents o+x")
	if got := causeText(r, fmt.Errorf("process: %w", advice), 300); !strings.Contains(got, "such as /var/lib/sandbox-broker, or give") {
		t.Errorf("advice lost: %q", got)
	}
	wrapped := brokererr.Wrap(errors.New("stat /var/lib/docker/overlay2/abc: permission denied; token "+secret),
		brokererr.Unavailable, "the Docker daemon is not reachable from /srv/broker-root/run")
	got := causeText(r, wrapped, 300)
	for _, leak := range []string{"/var/lib/docker", secret, "/srv/broker-root"} {
		if strings.Contains(got, leak) {
			t.Errorf("%q leaks %q", got, leak)
		}
	}
	if !strings.Contains(got, "the Docker daemon is not reachable from [PATH]") || !strings.Contains(got, "permission denied") {
		t.Errorf("cause %q", got)
	}
	if got := causeText(r, errors.New("open /etc/shadow: denied"), 300); strings.Contains(got, "/etc") {
		t.Errorf("plain error %q keeps a host path", got)
	}
}
