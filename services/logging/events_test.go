package logging

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
)

// eventName finds zerolog event names in Go source: .Msg("name").
var eventName = regexp.MustCompile(`\.Msgf?\("([a-z0-9_]+)"`)

// TestEventNamesSurviveRedaction: every log line passes through the
// redactor, whose token shapes (csb_…, gh…, long hex) must not eat the
// event names themselves, or the log says "[REDACTED]" where it should say
// what happened (csb_session_connected once did).
func TestEventNamesSurviveRedaction(t *testing.T) {
	r := redact.New([]string{"configured-secret-0123456789"}, []string{"/srv/sandbox-broker"})
	names := map[string]string{}
	err := filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) && path != "../.." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range eventName.FindAllSubmatch(src, -1) {
			names[string(m[1])] = path
		}
		return nil
	})
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
