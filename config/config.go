// Package config parses the broker's settings once, from environment
// variables and flags, into a typed and validated Config.
package config

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/go-playground/validator/v10"
)

// Secret is a string that never prints or marshals its value.
type Secret string

func (Secret) String() string                 { return "[REDACTED]" }
func (Secret) GoString() string               { return "[REDACTED]" }
func (Secret) MarshalJSON() ([]byte, error)   { return []byte(`"[REDACTED]"`), nil }
func (s Secret) Reveal() string               { return string(s) }
func (s Secret) MarshalText() ([]byte, error) { return []byte("[REDACTED]"), nil }

// Config is everything `serve` needs. The env tag names the variable that
// sets each field; flags (the flag tag), where they exist, override the
// environment.
type Config struct {
	Transport    string `env:"MCP_TRANSPORT" flag:"transport" validate:"oneof=stdio http"`
	Addr         string `env:"MCP_HTTP_ADDR" flag:"addr" validate:"listen_addr"`
	APIToken     Secret `env:"MCP_API_TOKEN" validate:"omitempty,min=16,max=512,printascii"`
	APIPrincipal string `env:"MCP_API_PRINCIPAL" validate:"principal"`
	APITier      string `env:"MCP_API_TIER" validate:"oneof=free pro"`
	TokensFile   string `env:"MCP_TOKENS_FILE" validate:"omitempty,filepath"`
	Root         string `env:"SANDBOX_ROOT" flag:"root" validate:"required"`
	// DatabaseURL puts the shared state and the audit log in PostgreSQL
	// (broker replicas share it); empty keeps them in SQLite under Root.
	DatabaseURL        Secret   `env:"DATABASE_URL" validate:"omitempty,max=2048,postgres_url"`
	FileSecret         Secret   `env:"FILE_SECRET" validate:"omitempty,min=32,max=512"`
	PublicBaseURL      string   `env:"PUBLIC_BASE_URL" validate:"omitempty,http_url"`
	RateLimitPerMinute int      `env:"RATE_LIMIT_PER_MINUTE" validate:"min=0,max=100000"`
	LogLevel           string   `env:"LOG_LEVEL" flag:"log-level" validate:"oneof=trace debug info warn error"`
	LogFile            string   `env:"LOG_FILE" validate:"omitempty,filepath"`
	AuditHMACKey       Secret   `env:"AUDIT_HMAC_KEY" validate:"omitempty,min=32,max=512"`
	AuditHMACKeyFile   string   `env:"AUDIT_HMAC_KEY_FILE" validate:"omitempty,filepath"`
	AllowedHosts       []string `env:"MCP_ALLOWED_HOSTS" validate:"dive,hostname_rfc1123|ip"`
	AllowedOrigins     []string `env:"MCP_ALLOWED_ORIGINS" validate:"dive,http_url"`
	Toolsets           []string `env:"MCP_TOOLSETS" flag:"toolsets" validate:"dive,toolset"`
	ReadOnly           bool     `env:"MCP_READ_ONLY" flag:"read-only"`
	MaxRequestBytes    int      `env:"MCP_MAX_REQUEST_BYTES" validate:"min=4096,max=268435456"`
	// HTTP connection limits (services/connguard) and the body deadline.
	MaxConns      int `env:"MCP_MAX_CONNS" validate:"min=16,max=1000000"`
	UnauthPerAddr int `env:"MCP_MAX_UNAUTH_CONNS_PER_ADDR" validate:"min=1,max=1000000,ltefield=MaxConns"`
	BodyTimeoutS  int `env:"MCP_BODY_TIMEOUT_S" validate:"min=1,max=3600"`
	// Sandbox engine.
	// Backend "auto" picks docker when its daemon answers, else process;
	// "codesandbox" runs sessions in hosted VMs (CSB_API_KEY,
	// CSB_RUNNER_TEMPLATE), falling back to docker per call when
	// SANDBOX_FALLBACK=docker and CodeSandbox cannot be reached;
	// "kubernetes" runs them as pods (SANDBOX_K8S_*).
	Backend        string `env:"SANDBOX_BACKEND" validate:"oneof=auto docker process codesandbox kubernetes none"`
	Fallback       string `env:"SANDBOX_FALLBACK" validate:"oneof=none docker"`
	Runtime        string `env:"SANDBOX_RUNTIME" validate:"omitempty,oneof=runc runsc"`
	RootOverlay    string `env:"SANDBOX_ROOT_OVERLAY" validate:"oneof=auto off"` // see services/rootfs
	RunnersDir     string `env:"SANDBOX_RUNNERS_DIR" validate:"omitempty,max=4096"`
	TimeoutS       int    `env:"SANDBOX_TIMEOUT" validate:"min=1,max=3600"`
	MaxTimeoutS    int    `env:"SANDBOX_MAX_TIMEOUT" validate:"min=1,max=3600,gtefield=TimeoutS"`
	IdleTimeoutMS  int64  `env:"SANDBOX_IDLE_TIMEOUT_MS" validate:"min=1000,max=604800000"`
	MaxAgeS        int64  `env:"SANDBOX_MAX_AGE_S" validate:"min=60,max=2592000"`
	PoolSize       int    `env:"SANDBOX_POOL_SIZE" validate:"min=0,max=32"`
	IdleReleaseMS  int64  `env:"SANDBOX_IDLE_RELEASE_MS" validate:"min=0,max=86400000"`
	MemoryMB       int64  `env:"SANDBOX_MEMORY_MB" validate:"min=64,max=65536"`
	CPUs           int    `env:"SANDBOX_CPUS_MILLI" validate:"min=100,max=64000"`
	PidsLimit      int64  `env:"SANDBOX_PIDS_LIMIT" validate:"min=16,max=65536"`
	MaxFiles       int    `env:"SANDBOX_MAX_FILES" validate:"min=1,max=1000000"`
	MaxWorkspaceMB int64  `env:"SANDBOX_MAX_WORKSPACE_MB" validate:"min=1,max=1048576"`
	FileURLTTLS    int64  `env:"FILE_URL_TTL_S" validate:"min=60,max=86400"`
	FileSecretPrev Secret `env:"FILE_SECRET_PREVIOUS" validate:"omitempty,min=32,max=512"`
	// Signed links: the largest file one serves or accepts (0: the
	// workspace quota), and the slowest average rate an upload may keep
	// after MCP_BODY_TIMEOUT_S.
	FileURLMaxMB      int64 `env:"FILE_URL_MAX_MB" validate:"min=0,max=1048576"`
	FileUploadMinKBps int64 `env:"FILE_UPLOAD_MIN_KBPS" validate:"min=1,max=1048576"`
	// Jobs (execute_code and friends).
	MaxConcurrent  int   `env:"SANDBOX_MAX_CONCURRENT" validate:"min=1,max=1000"`
	MaxPerSession  int   `env:"SANDBOX_MAX_PER_SESSION" validate:"min=1,max=100,ltefield=MaxConcurrent"`
	JobLogMaxBytes int64 `env:"SANDBOX_JOB_LOG_MAX_BYTES" validate:"min=65536,max=1073741824"`
	// SandboxUID..+SandboxUIDs are the host uids sandboxes run as, one per
	// session, on both backends.
	SandboxUID     int   `env:"SANDBOX_UID" validate:"min=1,max=4294967294"`
	SandboxUIDs    int   `env:"SANDBOX_UIDS" validate:"min=1,max=16777216"`
	MaxContainers  int   `env:"SANDBOX_MAX_CONTAINERS" validate:"min=1,max=10000"`
	EgressMaxConns int   `env:"EGRESS_MAX_CONNS" validate:"min=1,max=10000"`
	EgressMaxMB    int64 `env:"EGRESS_MAX_MB" validate:"min=1,max=1048576"`
	// Kubernetes backend (services/kube): sessions as pods in K8sNamespace,
	// reached over mutual TLS with certificates from a CA derived from
	// K8sCASecret (generated under SANDBOX_ROOT when unset).
	Kubeconfig         string `env:"KUBECONFIG" validate:"omitempty,filepath"`
	K8sNamespace       string `env:"SANDBOX_K8S_NAMESPACE" validate:"max=63,hostname_rfc1123"`
	K8sRunners         string `env:"SANDBOX_K8S_RUNNERS" validate:"max=4096"`
	K8sAgentImage      string `env:"SANDBOX_K8S_AGENT_IMAGE" validate:"max=512,printascii,excludesall= "`
	K8sPullPolicy      string `env:"SANDBOX_K8S_IMAGE_PULL_POLICY" validate:"oneof=Always IfNotPresent Never"`
	K8sRuntimeClass    string `env:"SANDBOX_K8S_RUNTIME_CLASS" validate:"omitempty,max=63,hostname_rfc1123"`
	K8sSeccomp         string `env:"SANDBOX_K8S_SECCOMP" validate:"max=512,printascii"`
	K8sUID             int64  `env:"SANDBOX_K8S_UID" validate:"min=1,max=2147483647"`
	K8sBrokerLabels    string `env:"SANDBOX_K8S_BROKER_LABELS" validate:"max=1024,printascii"`
	K8sBrokerNamespace string `env:"SANDBOX_K8S_BROKER_NAMESPACE" validate:"omitempty,max=63,hostname_rfc1123"`
	K8sBrokerCIDR      string `env:"SANDBOX_K8S_BROKER_CIDR" validate:"omitempty,cidr"`
	K8sWarmPoolPrefix  string `env:"SANDBOX_K8S_WARM_POOL_PREFIX" validate:"max=200,printascii"`
	K8sCASecret        Secret `env:"SANDBOX_K8S_CA_SECRET" validate:"omitempty,min=32,max=512"`
	// Hosted project sandboxes; without CSB_API_KEY projects run locally.
	CSBAPIKey Secret `env:"CSB_API_KEY" validate:"omitempty,min=8,max=512,printascii"`
	CSBAPIURL string `env:"CSB_API_URL" validate:"omitempty,http_url"`
	// CSBTemplates maps project templates to CodeSandbox templates:
	// {"react": {"id": "…", "port": 5173}, …}; unset ones fork the
	// universal image.
	CSBTemplates string `env:"CSB_TEMPLATES" validate:"omitempty,max=4096,json"`
	// Hosted sessions (SANDBOX_BACKEND=codesandbox): the runner template
	// every session VM forks, its tier, and whether commands in it keep
	// the VM's network.
	CSBRunnerTemplate string `env:"CSB_RUNNER_TEMPLATE" validate:"omitempty,max=128,printascii"`
	CSBVMTier         string `env:"CSB_VM_TIER" validate:"oneof=Pico Nano Micro Small Medium Large XLarge"`
	CSBVMNetwork      string `env:"CSB_VM_NETWORK" validate:"oneof=deny allow"`
	// Previews of local projects: their own listener and origin (see
	// preview.go); the build_output wait before a build continues as an
	// execution.
	PreviewAddr    string `env:"PREVIEW_ADDR" validate:"omitempty,eq=off|listen_addr"`
	PreviewBaseURL string `env:"PREVIEW_BASE_URL" validate:"omitempty,http_url,max=512"`
	BuildWaitS     int    `env:"PROJECT_BUILD_WAIT_S" validate:"min=1,max=50"`
	// GitHub: the repository allow-list; tokens come from the env variables
	// or files each entry names.
	GitHubReposFile string `env:"GITHUB_REPOS_FILE" validate:"omitempty,filepath"`
	GitHubAPIURL    string `env:"GITHUB_API_URL" validate:"http_url"`
	// Agent tasks (execute_task, services/broker/agent.go): on with a model
	// API key; the gateway's upstream and allow-list, the agent runner's
	// limits, and each tier's task policy (AGENT_TIERS, JSON).
	AnthropicAPIKey   Secret   `env:"ANTHROPIC_API_KEY" validate:"omitempty,min=8,max=512,printascii"`
	AnthropicAPIURL   string   `env:"ANTHROPIC_API_URL" validate:"http_url,max=512"`
	AgentKeysFile     string   `env:"AGENT_KEYS_FILE" validate:"omitempty,filepath"`
	AgentModels       []string `env:"AGENT_MODELS" validate:"dive,model_name"`
	AgentSmallModel   string   `env:"AGENT_SMALL_MODEL" validate:"model_name"`
	AgentTimeoutS     int      `env:"AGENT_TIMEOUT_S" validate:"min=1,max=3600"`
	AgentMaxTurns     int      `env:"AGENT_MAX_TURNS" validate:"min=1,max=1000"`
	AgentMemoryMB     int64    `env:"AGENT_MEMORY_MB" validate:"min=256,max=65536"`
	AgentCPUsMilli    int      `env:"AGENT_CPUS_MILLI" validate:"min=100,max=64000"`
	AgentMaxRequestMB int64    `env:"AGENT_MAX_REQUEST_MB" validate:"min=1,max=32"`
	AgentTiers        string   `env:"AGENT_TIERS" validate:"omitempty,max=4096,json"`
	// OAuth for remote connectors (see EffectiveOAuthMode).
	OAuthMode           string `env:"OAUTH_MODE" validate:"omitempty,oneof=embedded external off"`
	OAuthIssuer         string `env:"OAUTH_ISSUER" validate:"omitempty,http_url,max=512"`
	OAuthAudience       string `env:"OAUTH_AUDIENCE" validate:"omitempty,max=512,printascii"`
	OAuthScope          string `env:"OAUTH_SCOPE" validate:"omitempty,max=128,printascii,excludesall= "`
	OAuthPrincipalClaim string `env:"OAUTH_PRINCIPAL_CLAIM" validate:"required,max=64,printascii"`
	OAuthTierClaim      string `env:"OAUTH_TIER_CLAIM" validate:"omitempty,max=64,printascii"`
	OAuthTiersFile      string `env:"OAUTH_TIERS_FILE" validate:"omitempty,filepath"`
	OAuthDefaultTier    string `env:"OAUTH_DEFAULT_TIER" validate:"oneof=free pro none"`
	OAuthAccessTTLS     int    `env:"OAUTH_ACCESS_TOKEN_TTL_S" validate:"min=60,max=86400"`
	OAuthRefreshTTLS    int    `env:"OAUTH_REFRESH_TOKEN_TTL_S" validate:"min=3600,max=31536000"`
	OAuthKeyMaxAgeS     int    `env:"OAUTH_KEY_MAX_AGE_S" validate:"min=3600,max=31536000"`
	// Console turns the web console at / on or off (HTTP only).
	Console string `env:"CONSOLE" validate:"oneof=on off"`
}

// Defaults are the embedded defaults: loopback HTTP, state under ./data.
func Defaults() Config {
	return Config{
		Transport:       "http",
		Addr:            "127.0.0.1:8080",
		APIPrincipal:    "default",
		APITier:         "pro",
		Root:            "./data",
		LogLevel:        "info",
		Toolsets:        []string{"all"},
		MaxRequestBytes: 32 << 20, // create_sandbox_for_project takes 20 files of 1 MB
		MaxConns:        1024,
		UnauthPerAddr:   64,
		BodyTimeoutS:    60,
		Backend:         "auto",
		Fallback:        "none",
		CSBVMTier:       "Pico",
		CSBVMNetwork:    "deny",
		RootOverlay:     "auto",
		TimeoutS:        60,
		MaxTimeoutS:     600,
		IdleTimeoutMS:   30 * 60 * 1000,
		MaxAgeS:         24 * 3600,
		PoolSize:        1,
		IdleReleaseMS:   60_000,
		MemoryMB:        512,
		CPUs:            1000,
		PidsLimit:       256,
		MaxFiles:        1000,
		MaxWorkspaceMB:  512,
		FileURLTTLS:     3600,
		MaxConcurrent:   10,
		MaxPerSession:   5,
		JobLogMaxBytes:  8 << 20,
		SandboxUID:      1_900_000_000,
		SandboxUIDs:     65536,
		MaxContainers:   12,
		EgressMaxConns:  32,
		EgressMaxMB:     256,
		K8sNamespace:    "sandboxes",
		K8sRunners:      "python=sandbox-broker/runner-python:latest,typescript=sandbox-broker/runner-typescript:latest,javascript=sandbox-broker/runner-typescript:latest,bash=sandbox-broker/runner-bash:latest",
		K8sAgentImage:   "sandbox-broker:latest",
		K8sPullPolicy:   "IfNotPresent",
		K8sSeccomp:      "RuntimeDefault",
		K8sUID:          65532,
		K8sBrokerLabels: "app.kubernetes.io/name=sandbox-broker",

		K8sWarmPoolPrefix: "sandbox-broker-",
		GitHubAPIURL:      "https://api.github.com/",
		BuildWaitS:        50,

		AnthropicAPIURL:   "https://api.anthropic.com",
		AgentModels:       []string{"claude-sonnet-4-5", "claude-haiku-4-5"},
		AgentSmallModel:   "claude-haiku-4-5",
		AgentTimeoutS:     300,
		AgentMaxTurns:     50,
		AgentMemoryMB:     4096,
		AgentCPUsMilli:    2000,
		AgentMaxRequestMB: 8,
		FileUploadMinKBps: 64,

		OAuthPrincipalClaim: "sub",
		OAuthDefaultTier:    "free",
		OAuthAccessTTLS:     900,
		OAuthRefreshTTLS:    30 * 24 * 3600,
		OAuthKeyMaxAgeS:     30 * 24 * 3600,
		Console:             "on",
	}
}

// SecretValues lists every configured secret, for the redactor.
func (c Config) SecretValues() []string {
	return []string{c.APIToken.Reveal(), c.FileSecret.Reveal(), c.FileSecretPrev.Reveal(), c.AuditHMACKey.Reveal(), c.CSBAPIKey.Reveal(),
		c.AnthropicAPIKey.Reveal(), c.DatabaseURL.Reveal(), c.K8sCASecret.Reveal()}
}

// StatePath is where the shared state lives: DATABASE_URL, or state.db
// under Root.
func (c Config) StatePath() string {
	if c.DatabaseURL != "" {
		return c.DatabaseURL.Reveal()
	}
	return filepath.Join(c.Root, "state.db")
}

// AuditPath is where the audit log lives: DATABASE_URL, or audit.db under
// Root. Its checkpoints stay under Root either way (per replica).
func (c Config) AuditPath() string {
	if c.DatabaseURL != "" {
		return c.DatabaseURL.Reveal()
	}
	return filepath.Join(c.Root, "audit.db")
}

// TasksEnabled reports whether agent tasks are configured: a model API key
// for everyone or per principal.
func (c Config) TasksEnabled() bool {
	return c.AnthropicAPIKey.Reveal() != "" || c.AgentKeysFile != ""
}

// IsLoopback reports whether the HTTP listener binds only loopback.
func (c Config) IsLoopback() bool {
	host, _, err := net.SplitHostPort(c.Addr)
	return err == nil && IsLoopbackHost(host)
}

// EffectiveOAuthMode is OAUTH_MODE, or its default: embedded when
// PUBLIC_BASE_URL is an https origin (the embedded issuer must be a root),
// off otherwise. OAuth applies to HTTP only.
func (c Config) EffectiveOAuthMode() string {
	if c.Transport != "http" {
		return "off"
	}
	if c.OAuthMode != "" {
		return c.OAuthMode
	}
	if u, err := url.Parse(c.PublicBaseURL); err == nil && u.Scheme == "https" && strings.Trim(u.Path, "/") == "" {
		return "embedded"
	}
	return "off"
}

// OAuthResource is the protected resource's identifier: the /mcp URL.
func (c Config) OAuthResource() string {
	return strings.TrimSuffix(c.PublicBaseURL, "/") + "/mcp"
}

// KnownToolsets is filled by the tools package so config can validate names
// without importing it.
var KnownToolsets = map[string]bool{"all": true}

// Load applies the environment (via getenv) and then serve's flags (args)
// over the defaults, and validates the result.
func Load(args []string, getenv func(string) string) (Config, error) {
	c := Defaults()
	if err := applyEnv(&c, getenv); err != nil {
		return Config{}, err
	}
	for old, name := range map[string]string{"SANDBOX_PROCESS_UID": "SANDBOX_UID", "SANDBOX_PROCESS_UIDS": "SANDBOX_UIDS"} {
		if getenv(old) != "" { // not silently ignored: it placed sandboxes' uids
			return Config{}, fmt.Errorf("config: %s is now %s (it applies to both backends)", old, name)
		}
	}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(discard{})
	var names []string
	lists := map[*[]string]*string{} // comma-separated, split after parsing
	v := reflect.ValueOf(&c).Elem()
	for i := 0; i < v.NumField(); i++ {
		f := v.Type().Field(i)
		name := f.Tag.Get("flag")
		if name == "" {
			continue
		}
		names = append(names, "--"+name)
		switch p := v.Field(i).Addr().Interface().(type) {
		case *string:
			fs.StringVar(p, name, *p, f.Tag.Get("env"))
		case *bool:
			fs.BoolVar(p, name, *p, f.Tag.Get("env"))
		case *[]string:
			lists[p] = fs.String(name, strings.Join(*p, ","), f.Tag.Get("env"))
		}
	}
	if err := fs.Parse(args); err != nil {
		return Config{}, fmt.Errorf("config: %w (flags: %s)", err, strings.Join(names, ", "))
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("config: unexpected argument %q (flags: %s)", fs.Arg(0), strings.Join(names, ", "))
	}
	for p, s := range lists {
		*p = splitList(*s)
	}
	return c, Validate(c)
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

func applyEnv(c *Config, getenv func(string) string) error {
	v := reflect.ValueOf(c).Elem()
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		name := t.Field(i).Tag.Get("env")
		raw := getenv(name)
		if name == "" || raw == "" {
			continue
		}
		f := v.Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString(raw)
		case reflect.Int, reflect.Int64:
			n, err := strconv.ParseInt(strings.TrimSpace(raw), 10, 64)
			if err != nil {
				return fmt.Errorf("config: %s=%q is invalid: must be an integer (accepted: %s)", name, raw,
					acceptedRange(tagsOf(t.Field(i).Tag.Get("validate")), f.Type()))
			}
			f.SetInt(n)
		case reflect.Bool:
			b, err := strconv.ParseBool(strings.TrimSpace(raw))
			if err != nil {
				return fmt.Errorf("config: %s=%q is invalid: must be true or false", name, raw)
			}
			f.SetBool(b)
		case reflect.Slice:
			f.Set(reflect.ValueOf(splitList(raw)))
		}
	}
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

var validate = newValidator()

func newValidator() *validator.Validate {
	v := validator.New(validator.WithRequiredStructEnabled())
	_ = v.RegisterValidation("principal", func(fl validator.FieldLevel) bool {
		s := fl.Field().String()
		if s == "" || len(s) > 64 {
			return false
		}
		for _, r := range s {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("_.@-", r)) {
				return false
			}
		}
		return true
	})
	// host:port where port 0 (any free port) is allowed, unlike hostname_port.
	_ = v.RegisterValidation("listen_addr", func(fl validator.FieldLevel) bool {
		host, port, err := net.SplitHostPort(fl.Field().String())
		if err != nil {
			return false
		}
		n, err := strconv.Atoi(port)
		if err != nil || n < 0 || n > 65535 {
			return false
		}
		return host == "" || net.ParseIP(host) != nil || v.Var(host, "hostname_rfc1123") == nil
	})
	// A URL pgx can parse (postgres:// or postgresql://); checked by
	// statedb's parser when the broker opens it.
	_ = v.RegisterValidation("postgres_url", func(fl validator.FieldLevel) bool {
		s := fl.Field().String()
		u, err := url.Parse(s)
		return err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") && u.Host != ""
	})
	_ = v.RegisterValidation("model_name", func(fl validator.FieldLevel) bool {
		return modelName.MatchString(fl.Field().String())
	})
	_ = v.RegisterValidation("toolset", func(fl validator.FieldLevel) bool {
		return KnownToolsets[fl.Field().String()]
	})
	return v
}

// Validate checks c and names the first bad variable. Secret values are
// never echoed; other values are quoted so typos are visible.
func Validate(c Config) error {
	err := validate.Struct(c)
	var verrs validator.ValidationErrors
	if errors.As(err, &verrs) && len(verrs) > 0 {
		return fieldMessage(c, verrs[0])
	}
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if err := validateOAuth(c); err != nil {
		return err
	}
	if err := validatePreview(c); err != nil {
		return err
	}
	if err := validateAgent(c); err != nil {
		return err
	}
	if c.PublicBaseURL != "" {
		// The value is not echoed: user info or a query may hold a credential.
		u, err := url.Parse(c.PublicBaseURL)
		if err != nil {
			return errors.New("config: PUBLIC_BASE_URL is not a valid URL; its value is not shown")
		}
		if u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || u.User != nil {
			return fmt.Errorf("config: PUBLIC_BASE_URL (%s://%s%s...) must be a plain origin and path, with no query, fragment or user info",
				u.Scheme, u.Host, u.EscapedPath())
		}
	}
	return nil
}

// validateOAuth checks what OAuth needs: a public https base URL (or
// loopback http, for tests and local use), and an issuer in external mode.
func validateOAuth(c Config) error {
	mode := c.EffectiveOAuthMode()
	if mode == "off" {
		return nil
	}
	if c.PublicBaseURL == "" {
		return fmt.Errorf("config: OAUTH_MODE=%s needs PUBLIC_BASE_URL (the https URL clients reach the broker at)", mode)
	}
	u, err := url.Parse(c.PublicBaseURL)
	if err != nil || !(u.Scheme == "https" || u.Scheme == "http" && IsLoopbackHost(u.Hostname())) {
		return fmt.Errorf("config: OAUTH_MODE=%s needs an https PUBLIC_BASE_URL (http only on 127.0.0.1, [::1] or localhost)", mode)
	}
	switch mode {
	case "embedded":
		if strings.Trim(u.Path, "/") != "" {
			return errors.New("config: OAUTH_MODE=embedded needs PUBLIC_BASE_URL to be an origin without a path (the issuer must be the root)")
		}
	case "external":
		if c.OAuthIssuer == "" {
			return errors.New("config: OAUTH_MODE=external needs OAUTH_ISSUER (the identity provider's issuer URL)")
		}
		iu, err := url.Parse(c.OAuthIssuer)
		if err != nil || !(iu.Scheme == "https" || iu.Scheme == "http" && IsLoopbackHost(iu.Hostname())) {
			return errors.New("config: OAUTH_ISSUER must be https (http only on loopback)")
		}
	}
	return nil
}

// validateAgent checks what the model gateway needs: the key travels to
// ANTHROPIC_API_URL, so plain http only to loopback (a local fake), and
// the small model must be one the gateway allows.
func validateAgent(c Config) error {
	u, err := url.Parse(c.AnthropicAPIURL)
	if err != nil || u.User != nil || u.RawQuery != "" || u.Fragment != "" ||
		!(u.Scheme == "https" || u.Scheme == "http" && IsLoopbackHost(u.Hostname())) {
		return errors.New("config: ANTHROPIC_API_URL must be an https URL (http only on loopback) without user info, query or fragment; its value is not shown")
	}
	if len(c.AgentModels) > maxAgentModels {
		return fmt.Errorf("config: AGENT_MODELS lists %d models; at most %d are accepted", len(c.AgentModels), maxAgentModels)
	}
	if !slices.Contains(c.AgentModels, c.AgentSmallModel) {
		return fmt.Errorf("config: AGENT_SMALL_MODEL=%q must be one of AGENT_MODELS", c.AgentSmallModel)
	}
	return nil
}

// maxAgentModels bounds AGENT_MODELS.
const maxAgentModels = 16

// modelName is what a model name in AGENT_MODELS may look like.
var modelName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$`)

// IsLoopbackHost reports whether a URL's or address's host is localhost or
// a loopback IP: the one place plain http is allowed.
func IsLoopbackHost(h string) bool {
	if strings.EqualFold(h, "localhost") {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// fieldName takes "Config.AllowedHosts[0]" to "AllowedHosts".
func fieldName(ns string) string {
	if i := strings.IndexByte(ns, '.'); i >= 0 {
		ns = ns[i+1:]
	}
	if i := strings.IndexByte(ns, '['); i >= 0 {
		ns = ns[:i]
	}
	return ns
}

func param(p string) string {
	if p == "" {
		return ""
	}
	return " " + p
}
