package config

import (
	"encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestDefaults(t *testing.T) {
	c, err := Load(nil, envOf(nil))
	if err != nil {
		t.Fatalf("defaults do not validate: %v", err)
	}
	if !reflect.DeepEqual(c, Defaults()) {
		t.Errorf("Load with no input = %+v, want %+v", c, Defaults())
	}
	if c.Transport != "http" || c.Addr != "127.0.0.1:8080" || c.APITier != "pro" || c.LogLevel != "info" ||
		c.Root != "./data" || c.MaxRequestBytes != 32<<20 || !reflect.DeepEqual(c.Toolsets, []string{"all"}) || !c.IsLoopback() {
		t.Errorf("defaults %+v", c)
	}
}

const (
	apiToken   = "api-token-0123456789abcdef"
	fileSecret = "file-secret-0123456789abcdef0123456789"
	hmacKey    = "hmac-key-0123456789abcdef0123456789abcdef"
)

func TestEnvParsing(t *testing.T) {
	KnownToolsets["files"], KnownToolsets["sandbox"] = true, true
	t.Cleanup(func() { delete(KnownToolsets, "files"); delete(KnownToolsets, "sandbox") })
	env := map[string]string{
		"MCP_TRANSPORT":            "stdio",
		"MCP_HTTP_ADDR":            "0.0.0.0:0",
		"MCP_API_TOKEN":            apiToken,
		"MCP_API_PRINCIPAL":        "ci-bot@example.com",
		"MCP_API_TIER":             "free",
		"MCP_TOKENS_FILE":          "/etc/broker/tokens.json",
		"SANDBOX_ROOT":             "/srv/broker",
		"SANDBOX_ROOT_OVERLAY":     "off",
		"FILE_SECRET":              fileSecret,
		"PUBLIC_BASE_URL":          "https://broker.example.com/base",
		"RATE_LIMIT_PER_MINUTE":    " 42 ",
		"LOG_LEVEL":                "debug",
		"AUDIT_HMAC_KEY":           hmacKey,
		"MCP_ALLOWED_HOSTS":        "broker.example.com, 10.0.0.1,,",
		"MCP_ALLOWED_ORIGINS":      "https://a.example.com,http://localhost:3000",
		"MCP_TOOLSETS":             "files, sandbox",
		"MCP_READ_ONLY":            "true",
		"MCP_MAX_REQUEST_BYTES":    "4096",
		"SANDBOX_BACKEND":          "none",
		"SANDBOX_K8S_CA_SECRET":    "k8s-ca-secret-0123456789abcdef0123456789",
		"SANDBOX_K8S_NAMESPACE":    "sbx-ns",
		"SANDBOX_K8S_BROKER_CIDR":  "10.1.0.0/16",
		"SANDBOX_TIMEOUT":          "30",
		"SANDBOX_IDLE_TIMEOUT_MS":  "60000",
		"SANDBOX_POOL_SIZE":        "0",
		"FILE_SECRET_PREVIOUS":     fileSecret + "-old",
		"SANDBOX_MAX_CONCURRENT":   "4",
		"SANDBOX_MAX_PER_SESSION":  "2",
		"CSB_API_KEY":              "csb_v1_0123456789",
		"CSB_API_URL":              "http://127.0.0.1:9/",
		"CSB_RUNNER_TEMPLATE":      "runtpl42",
		"CSB_VM_TIER":              "Nano",
		"CSB_VM_NETWORK":           "allow",
		"SANDBOX_FALLBACK":         "docker",
		"PREVIEW_ADDR":             "127.0.0.1:9000",
		"PREVIEW_BASE_URL":         "https://*.preview.example.net",
		"PROJECT_BUILD_WAIT_S":     "20",
		"GITHUB_REPOS_FILE":        "/etc/broker/repos.json",
		"OAUTH_MODE":               "external",
		"OAUTH_ISSUER":             "https://idp.example.com/",
		"OAUTH_AUDIENCE":           "api://sandbox-broker",
		"OAUTH_SCOPE":              "sandbox",
		"OAUTH_PRINCIPAL_CLAIM":    "email",
		"OAUTH_TIER_CLAIM":         "broker_tier",
		"OAUTH_TIERS_FILE":         "/etc/broker/tiers.json",
		"OAUTH_DEFAULT_TIER":       "none",
		"OAUTH_ACCESS_TOKEN_TTL_S": "600",
		"ANTHROPIC_API_KEY":        "sk-ant-test-0123456789",
		"ANTHROPIC_API_URL":        "http://127.0.0.1:9",
		"AGENT_MODELS":             "m-big, m-small",
		"AGENT_SMALL_MODEL":        "m-small",
		"AGENT_TIMEOUT_S":          "120",
		"AGENT_TIERS":              `{"free":{"network":"none"}}`,
		"CONSOLE":                  "off",
	}
	c, err := Load(nil, envOf(env))
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		Transport: "stdio", Addr: "0.0.0.0:0", APIToken: apiToken, APIPrincipal: "ci-bot@example.com", APITier: "free",
		TokensFile: "/etc/broker/tokens.json", Root: "/srv/broker", RootOverlay: "off", FileSecret: fileSecret,
		PublicBaseURL: "https://broker.example.com/base", RateLimitPerMinute: 42, LogLevel: "debug", AuditHMACKey: hmacKey,
		AllowedHosts: []string{"broker.example.com", "10.0.0.1"}, AllowedOrigins: []string{"https://a.example.com", "http://localhost:3000"},
		Toolsets: []string{"files", "sandbox"}, ReadOnly: true, MaxRequestBytes: 4096,
		Backend: "none", TimeoutS: 30, MaxTimeoutS: 600, IdleTimeoutMS: 60000, MaxAgeS: 86400, PoolSize: 0, IdleReleaseMS: 60000,
		MemoryMB: 512, CPUs: 1000, PidsLimit: 256, MaxFiles: 1000, MaxWorkspaceMB: 512, FileURLTTLS: 3600, FileSecretPrev: fileSecret + "-old", FileUploadMinKBps: 64,
		MaxConcurrent: 4, MaxPerSession: 2, JobLogMaxBytes: 8 << 20, SandboxUID: 1_900_000_000, SandboxUIDs: 65536, MaxContainers: 12, EgressMaxConns: 32, EgressMaxMB: 256,
		CSBAPIKey: "csb_v1_0123456789", CSBAPIURL: "http://127.0.0.1:9/", GitHubReposFile: "/etc/broker/repos.json",
		CSBRunnerTemplate: "runtpl42", CSBVMTier: "Nano", CSBVMNetwork: "allow", Fallback: "docker",
		GitHubAPIURL: "https://api.github.com/",
		PreviewAddr:  "127.0.0.1:9000", PreviewBaseURL: "https://*.preview.example.net", BuildWaitS: 20,
		MaxConns: 1024, UnauthPerAddr: 64, BodyTimeoutS: 60,
		OAuthMode: "external", OAuthIssuer: "https://idp.example.com/", OAuthAudience: "api://sandbox-broker", OAuthScope: "sandbox",
		OAuthPrincipalClaim: "email", OAuthTierClaim: "broker_tier", OAuthTiersFile: "/etc/broker/tiers.json", OAuthDefaultTier: "none",
		OAuthAccessTTLS: 600, OAuthRefreshTTLS: 30 * 24 * 3600, OAuthKeyMaxAgeS: 30 * 24 * 3600,
		AnthropicAPIKey: "sk-ant-test-0123456789", AnthropicAPIURL: "http://127.0.0.1:9", AgentModels: []string{"m-big", "m-small"},
		AgentSmallModel: "m-small", AgentTimeoutS: 120, AgentMaxTurns: 50, AgentMemoryMB: 4096, AgentCPUsMilli: 2000, AgentMaxRequestMB: 8,
		AgentTiers:   `{"free":{"network":"none"}}`,
		Console:      "off",
		K8sNamespace: "sbx-ns", K8sRunners: Defaults().K8sRunners, K8sAgentImage: "sandbox-broker:latest", K8sPullPolicy: "IfNotPresent",
		K8sSeccomp: "RuntimeDefault", K8sUID: 65532, K8sBrokerLabels: "app.kubernetes.io/name=sandbox-broker", K8sBrokerCIDR: "10.1.0.0/16",
		K8sWarmPoolPrefix: "sandbox-broker-", K8sCASecret: "k8s-ca-secret-0123456789abcdef0123456789",
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got  %#v\nwant %#v", c, want)
	}
	if c.IsLoopback() {
		t.Error("0.0.0.0 is not loopback")
	}
	if got := c.SecretValues(); !reflect.DeepEqual(got, []string{apiToken, fileSecret, fileSecret + "-old", hmacKey, "csb_v1_0123456789", "sk-ant-test-0123456789", "", "k8s-ca-secret-0123456789abcdef0123456789"}) {
		t.Errorf("SecretValues = %v", got)
	}
}

// The process backend's old uid range variables now apply to both
// backends under new names; setting an old one is an error, not ignored.
func TestRenamedUIDVariablesRefused(t *testing.T) {
	for old, name := range map[string]string{"SANDBOX_PROCESS_UID": "SANDBOX_UID", "SANDBOX_PROCESS_UIDS": "SANDBOX_UIDS"} {
		_, err := Load(nil, envOf(map[string]string{old: "2000000000"}))
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: %v, want an error naming %s", old, err, name)
		}
	}
}

func TestFlagsOverrideEnv(t *testing.T) {
	KnownToolsets["files"] = true
	t.Cleanup(func() { delete(KnownToolsets, "files") })
	env := map[string]string{"MCP_TRANSPORT": "http", "MCP_HTTP_ADDR": "127.0.0.1:1", "SANDBOX_ROOT": "/env", "LOG_LEVEL": "warn", "MCP_TOOLSETS": "all"}
	c, err := Load([]string{"--transport=stdio", "--addr", "[::1]:9000", "--root", "/flag", "--log-level=error", "--toolsets", "files", "--read-only"}, envOf(env))
	if err != nil {
		t.Fatal(err)
	}
	if c.Transport != "stdio" || c.Addr != "[::1]:9000" || c.Root != "/flag" || c.LogLevel != "error" || !c.ReadOnly ||
		!reflect.DeepEqual(c.Toolsets, []string{"files"}) || !c.IsLoopback() {
		t.Errorf("%+v", c)
	}
	// Without flags the environment stands.
	c, err = Load(nil, envOf(env))
	if err != nil || c.Root != "/env" || c.LogLevel != "warn" {
		t.Errorf("%+v %v", c, err)
	}
	for _, args := range [][]string{{"--nope"}, {"extra"}, {"--addr"}} {
		if _, err := Load(args, envOf(nil)); err == nil {
			t.Errorf("Load(%q) accepted", args)
		}
	}
}

func TestInvalidVariablesAreNamed(t *testing.T) {
	cases := []struct{ name, value string }{
		{"MCP_TRANSPORT", "carrier-pigeon"},
		{"MCP_HTTP_ADDR", "localhost"},
		{"MCP_HTTP_ADDR", "127.0.0.1:65536"},
		{"MCP_HTTP_ADDR", "127.0.0.1:http"},
		{"MCP_HTTP_ADDR", "bad host!:80"},
		{"RATE_LIMIT_PER_MINUTE", "many"},
		{"RATE_LIMIT_PER_MINUTE", "-1"},
		{"RATE_LIMIT_PER_MINUTE", "100001"},
		{"LOG_LEVEL", "verbose"},
		{"LOG_LEVEL", "INFO"},
		{"PUBLIC_BASE_URL", "ftp://example.com"},
		{"PUBLIC_BASE_URL", "https://example.com/?q=1"},
		{"PUBLIC_BASE_URL", "https://example.com/#frag"},
		{"PUBLIC_BASE_URL", "https://example.com/?"},
		{"MCP_TOOLSETS", "all,nonexistent"},
		{"MCP_API_PRINCIPAL", "has space"},
		{"MCP_API_TIER", "enterprise"},
		{"MCP_ALLOWED_HOSTS", "ok.example.com,bad_host!"},
		{"MCP_ALLOWED_ORIGINS", "not a url"},
		{"MCP_READ_ONLY", "maybe"},
		{"CONSOLE", "maybe"},
		{"MCP_MAX_REQUEST_BYTES", "1"},
		{"MCP_MAX_CONNS", "8"},
		{"MCP_MAX_UNAUTH_CONNS_PER_ADDR", "0"},
		{"MCP_MAX_UNAUTH_CONNS_PER_ADDR", "2000"}, // above MCP_MAX_CONNS
		{"MCP_BODY_TIMEOUT_S", "0"},
		{"ANTHROPIC_API_URL", "http://api.anthropic.com"}, // the key would travel in clear
		{"ANTHROPIC_API_URL", "ftp://127.0.0.1"},
		{"AGENT_MODELS", "has space"},
		{"AGENT_SMALL_MODEL", "claude-not-in-the-list"},
		{"AGENT_MEMORY_MB", "10"},
		{"AGENT_TIERS", "{not json"},
	}
	for _, c := range cases {
		_, err := Load(nil, envOf(map[string]string{c.name: c.value}))
		if err == nil {
			t.Errorf("%s=%q accepted", c.name, c.value)
			continue
		}
		if !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s=%q: error %q does not name the variable", c.name, c.value, err)
		}
	}
	// Port 0 (any free port) and an empty host are fine.
	for _, addr := range []string{"127.0.0.1:0", ":0", ":8080", "localhost:1234", "[::1]:0"} {
		if _, err := Load(nil, envOf(map[string]string{"MCP_HTTP_ADDR": addr})); err != nil {
			t.Errorf("MCP_HTTP_ADDR=%q: %v", addr, err)
		}
	}
}

func TestSecretValuesNeverInErrors(t *testing.T) {
	const marker = "Zq9xSECRETVALUEx"
	cases := []struct{ name, value string }{
		{"MCP_API_TOKEN", marker[:12]},                 // too short
		{"MCP_API_TOKEN", marker + "\x01" + marker},    // not printable ASCII
		{"MCP_API_TOKEN", strings.Repeat(marker, 40)},  // too long
		{"FILE_SECRET", marker},                        // too short
		{"FILE_SECRET", strings.Repeat(marker, 40)},    // too long
		{"AUDIT_HMAC_KEY", marker},                     // too short
		{"AUDIT_HMAC_KEY", strings.Repeat(marker, 40)}, // too long
		// Credentials inside a URL are not echoed either.
		{"PUBLIC_BASE_URL", "https://admin:" + marker + "@example.com/"},
		{"PUBLIC_BASE_URL", "https://example.com/?token=" + marker},
		{"PUBLIC_BASE_URL", "https://admin:" + marker + "@exa mple.com/"},
		{"MCP_ALLOWED_ORIGINS", "https://admin:" + marker + "@exa mple.com"},
		{"ANTHROPIC_API_KEY", marker[:6]},
		{"ANTHROPIC_API_URL", "https://admin:" + marker + "@example.com/"},
	}
	for _, c := range cases {
		_, err := Load(nil, envOf(map[string]string{c.name: c.value}))
		if err == nil {
			t.Errorf("%s accepted", c.name)
			continue
		}
		if !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s: error %q does not name the variable", c.name, err)
		}
		if strings.Contains(err.Error(), marker) || strings.Contains(err.Error(), c.value) {
			t.Errorf("%s: error %q reveals the value", c.name, err)
		}
	}
}

func TestSecretNeverPrints(t *testing.T) {
	s := Secret(apiToken)
	c := Defaults()
	c.APIToken, c.FileSecret, c.AuditHMACKey = s, Secret(fileSecret), Secret(hmacKey)
	j, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	txt, _ := s.MarshalText()
	outs := []string{
		s.String(), s.GoString(), string(txt), string(j),
		fmt.Sprint(s), fmt.Sprintf("%v|%+v|%#v|%s|%q|%x|%X|%10.3s", s, s, s, s, s, s, s, s),
		fmt.Sprintf("%v|%+v|%#v", c, c, c),
		fmt.Sprintf("%v|%#v", &c, []Secret{s}),
	}
	for _, o := range outs {
		for _, v := range []string{apiToken, fileSecret, hmacKey, fmt.Sprintf("%x", apiToken)} {
			if strings.Contains(o, v) {
				t.Errorf("output %q reveals a secret", o)
			}
		}
	}
	if !strings.Contains(string(j), `"APIToken":"[REDACTED]"`) {
		t.Errorf("json %s", j)
	}
	if s.Reveal() != apiToken {
		t.Error("Reveal")
	}
}

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:80": true, "[::1]:80": true, "LOCALHOST:1": true, "127.5.5.5:0": true,
		"0.0.0.0:80": false, ":80": false, "example.com:80": false, "garbage": false, "[::]:1": false,
	} {
		c := Config{Addr: addr}
		if got := c.IsLoopback(); got != want {
			t.Errorf("IsLoopback(%q) = %v", addr, got)
		}
	}
}

func FuzzLoadEnv(f *testing.F) {
	f.Add("http", "127.0.0.1:0", "abcdefghijklmnop-secret", "https://x.example/", "60", "all", "info")
	f.Add("stdio", ":0", "short", "https://u:p@x/?q", "-1", "all,,x", "INFO")
	f.Add("", "[::1]:65535", "tok\x00en-0123456789abcdef", "http://[::1", "9999999999999999999999", " ", "trace")
	f.Add("http\n", "localhost:+80", "\xff\xfe-0123456789abcdef", "https://%zz", "0x10", "all,all", "")
	f.Add("x", "host:-0", "Zq9xSECRETVALUEx", "HTTPS://EXAMPLE.COM/%2A", "1e3", "ALL", "debug ")
	f.Fuzz(func(t *testing.T, transport, addr, secret, baseURL, rate, toolsets, level string) {
		const tag = "Zq9x"
		secretVal := tag + secret
		others := []string{transport, addr, baseURL, rate, toolsets, level}
		env := map[string]string{
			"MCP_TRANSPORT": transport, "MCP_HTTP_ADDR": addr, "PUBLIC_BASE_URL": baseURL,
			"RATE_LIMIT_PER_MINUTE": rate, "MCP_TOOLSETS": toolsets, "LOG_LEVEL": level,
		}
		for _, name := range []string{"MCP_API_TOKEN", "FILE_SECRET", "AUDIT_HMAC_KEY"} {
			env[name] = secretVal
			c, err := Load(nil, envOf(env))
			delete(env, name)
			if err == nil {
				if err := Validate(c); err != nil {
					t.Fatalf("Load accepted what Validate refuses: %v", err)
				}
				continue
			}
			msg := err.Error()
			echoed := false
			for _, o := range others {
				if strings.Contains(o, secretVal) {
					echoed = true // the same text was given in a visible variable
				}
			}
			if !echoed && strings.Contains(msg, secretVal) {
				t.Fatalf("%s: error %q reveals the secret", name, msg)
			}
		}
	})
}

func TestHTTPLimitsEnv(t *testing.T) {
	c, err := Load(nil, envOf(map[string]string{"MCP_MAX_CONNS": "200", "MCP_MAX_UNAUTH_CONNS_PER_ADDR": "200", "MCP_BODY_TIMEOUT_S": "5"}))
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxConns != 200 || c.UnauthPerAddr != 200 || c.BodyTimeoutS != 5 {
		t.Fatalf("%d %d %d", c.MaxConns, c.UnauthPerAddr, c.BodyTimeoutS)
	}
}

func TestOAuthMode(t *testing.T) {
	base := Defaults()
	for _, tc := range []struct {
		name, mode, publicURL, issuer, want, err string
	}{
		{name: "no base URL", want: "off"},
		{name: "http base URL", publicURL: "http://broker.example.com", want: "off"},
		{name: "https base URL", publicURL: "https://broker.example.com", want: "embedded"},
		{name: "explicit off", mode: "off", publicURL: "https://broker.example.com", want: "off"},
		{name: "loopback embedded", mode: "embedded", publicURL: "http://127.0.0.1:8080", want: "embedded"},
		{name: "localhost embedded", mode: "embedded", publicURL: "http://localhost:8080/", want: "embedded"},
		{name: "embedded without URL", mode: "embedded", err: "needs PUBLIC_BASE_URL"},
		{name: "embedded on plain http", mode: "embedded", publicURL: "http://broker.example.com", err: "https PUBLIC_BASE_URL"},
		{name: "https base URL with a path", publicURL: "https://example.com/broker", want: "off"},
		{name: "embedded with a path", mode: "embedded", publicURL: "https://example.com/broker", err: "without a path"},
		{name: "external without issuer", mode: "external", publicURL: "https://broker.example.com", err: "OAUTH_ISSUER"},
		{name: "external http issuer", mode: "external", publicURL: "https://broker.example.com", issuer: "http://idp.example.com", err: "OAUTH_ISSUER must be https"},
		{name: "external", mode: "external", publicURL: "https://broker.example.com/base", issuer: "https://idp.example.com/", want: "external"},
	} {
		c := base
		c.OAuthMode, c.PublicBaseURL, c.OAuthIssuer = tc.mode, tc.publicURL, tc.issuer
		err := Validate(c)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: error %v, want %q", tc.name, err, tc.err)
			}
			continue
		}
		if err != nil || c.EffectiveOAuthMode() != tc.want {
			t.Errorf("%s: mode %q (%v), want %q", tc.name, c.EffectiveOAuthMode(), err, tc.want)
		}
	}
	c := base
	c.Transport, c.PublicBaseURL = "stdio", "https://broker.example.com"
	if c.EffectiveOAuthMode() != "off" {
		t.Error("OAuth on stdio")
	}
	if got := (Config{PublicBaseURL: "https://b.example.com/"}).OAuthResource(); got != "https://b.example.com/mcp" {
		t.Errorf("resource %q", got)
	}
}
