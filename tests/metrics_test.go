package tests

import (
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

// metricValue sums the samples of a series whose labels include every
// one in labels (`name{a="b"}` lines of the text exposition).
func metricValue(t *testing.T, text, name string, labels ...string) float64 {
	t.Helper()
	line := regexp.MustCompile(`^` + regexp.QuoteMeta(name) + `(\{[^}]*\})? ([0-9.e+-]+)$`)
	sum, found := 0.0, false
	for _, l := range strings.Split(text, "\n") {
		m := line.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		ok := true
		for _, lb := range labels {
			ok = ok && strings.Contains(m[1], lb)
		}
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			t.Fatalf("%s: %v", l, err)
		}
		sum, found = sum+v, true
	}
	if !found {
		t.Errorf("no %s%v in /metrics", name, labels)
	}
	return sum
}

// TestMetricsUpstreamRequests: requests to GitHub and CodeSandbox are
// counted by outcome, a rate limit apart from other refusals; every
// audit append is timed.
func TestMetricsUpstreamRequests(t *testing.T) {
	t.Run("github", func(t *testing.T) {
		b, fake := githubBroker(t, fineGrainedPAT, nil)
		c := b.Client(t, testToken)
		callTool(t, c, "read_github_file", map[string]any{"repo_id": "site", "file_path": "README.md"})
		fake.LimitNext(1, ghfake.TooManyRequests)
		callTool(t, c, "read_github_file", map[string]any{"repo_id": "site", "file_path": "README.md"})
		m := get(t, b, testToken, "/metrics")
		if metricValue(t, m, "sandbox_upstream_requests_total", `service="github"`, `outcome="ok"`) < 1 ||
			metricValue(t, m, "sandbox_upstream_requests_total", `service="github"`, `outcome="rate_limited"`) != 1 {
			t.Errorf("github outcomes:\n%s", grepLines(m, "sandbox_upstream"))
		}
		if metricValue(t, m, "sandbox_audit_append_seconds_count", `outcome="ok"`) < 4 {
			t.Errorf("audit appends:\n%s", grepLines(m, "sandbox_audit_append"))
		}
	})
	t.Run("codesandbox", func(t *testing.T) {
		fake := csbfake.New(t, csbKey)
		b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"CSB_API_KEY": csbKey, "CSB_API_URL": fake.URL(), "SANDBOX_BACKEND": "none"}})
		c := b.Client(t, testToken)
		callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "m", "template": "node"})
		fake.Inject(csbfake.Fault{Status: 500, N: 1})
		callTool(t, c, "list_sandboxes", nil)
		callTool(t, c, "create_sandbox_for_project", map[string]any{"project_name": "m2", "template": "node"})
		m := get(t, b, testToken, "/metrics")
		if metricValue(t, m, "sandbox_upstream_requests_total", `service="codesandbox"`, `outcome="ok"`) < 1 ||
			metricValue(t, m, "sandbox_upstream_requests_total", `service="codesandbox"`, `outcome="server_error"`) != 1 {
			t.Errorf("codesandbox outcomes:\n%s", grepLines(m, "sandbox_upstream"))
		}
	})
}

// TestMetricsPoolAndEgress: the warm pool's size per language, how long
// sessions waited for a container (claimed warm, or started cold), and
// the egress proxy's decisions by reason.
func TestMetricsPoolAndEgress(t *testing.T) {
	requireDocker(t)
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "1"}})
	c := b.Client(t, testToken)
	waitPool(t, b, map[string]int{"python": 1})
	var first runResult
	resultJSON(t, callTool(t, c, "run_code", map[string]any{"language": "python", "code": "print(1)"}), &first)
	resultJSON(t, callTool(t, c, "run_code", map[string]any{"language": "bash", "code": "echo 1", "session_id": first.SessionID}), &struct{}{})
	probe := `python3 -c 'import urllib.request
try: urllib.request.urlopen("http://blocked.example.net/", timeout=10)
except Exception as e: print(e)'`
	callTool(t, c, "execute_code", map[string]any{"command": probe, "session_id": first.SessionID,
		"sandbox_config": map[string]any{"network": map[string]any{"allowed_domains": []string{"*.example.org"}}}})
	m := get(t, b, testToken, "/metrics")
	if metricValue(t, m, "sandbox_pool_target") != 1 {
		t.Errorf("pool target:\n%s", grepLines(m, "sandbox_pool"))
	}
	metricValue(t, m, "sandbox_pool_ready", `language="python"`)
	if metricValue(t, m, "sandbox_container_acquire_seconds_count", `language="python"`, `source="pool"`) != 1 ||
		metricValue(t, m, "sandbox_container_acquire_seconds_count", `language="bash"`) != 1 {
		t.Errorf("acquisitions:\n%s", grepLines(m, "sandbox_container_acquire_seconds_count"))
	}
	if metricValue(t, m, "sandbox_egress_requests_total", `decision="denied"`, `reason="not_in_allowed_domains"`) != 1 {
		t.Errorf("egress:\n%s", grepLines(m, "sandbox_egress"))
	}
}
