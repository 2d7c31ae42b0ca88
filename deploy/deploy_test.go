// Package deploy holds the Grafana dashboard and Prometheus rules; this
// test keeps them to series the broker exports.
package deploy

import (
	"encoding/json"
	"os"
	"regexp"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/tests/srcscan"
)

var (
	defined    = regexp.MustCompile(`(?:Name:\s*|NewDesc\()"(sandbox_[a-z0-9_]+)"`)
	referenced = regexp.MustCompile(`\bsandbox_[a-z0-9_]+`)
	suffix     = regexp.MustCompile(`_(bucket|count|sum)$`)
)

// TestDashboardAndRulesUseExportedSeries: every sandbox_* series the
// dashboard and the alert rules query is one the broker's code defines.
func TestDashboardAndRulesUseExportedSeries(t *testing.T) {
	names, err := srcscan.Submatches("..", defined)
	if err != nil {
		t.Fatal(err)
	}
	if len(names) < 5 {
		t.Fatalf("found only %d metric definitions: %v", len(names), names)
	}
	dash, err := os.ReadFile("grafana/dashboards/sandbox-broker.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(dash, &d); err != nil || len(d.Panels) == 0 {
		t.Fatalf("dashboard JSON: %v", err)
	}
	rules, err := os.ReadFile("prometheus/alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	for file, text := range map[string]string{"dashboard": string(dash), "alerts": string(rules)} {
		for _, ref := range referenced.FindAllString(text, -1) {
			name := suffix.ReplaceAllString(ref, "")
			if names[name] == "" && names[ref] == "" {
				t.Errorf("%s uses %s, which the broker does not export", file, ref)
			}
		}
	}
}
