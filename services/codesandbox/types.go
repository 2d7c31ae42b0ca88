package codesandbox

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"

	"github.com/sandbox-broker/sandbox-broker/config"
)

// Secret is a credential from the API (pitcher, reconnect, pint and preview
// tokens): the broker's one secret string type, which prints and marshals
// as "[REDACTED]" so a stray %v or log field cannot leak it; Reveal gives
// the value to the one place that sends it.
type Secret = config.Secret

// Privacy values of a sandbox (codesandbox-api.md §2.3).
const (
	PrivacyPublic   = 0
	PrivacyUnlisted = 1
	PrivacyPrivate  = 2
)

// VM tiers, smallest first (codesandbox-api.md §6.2).
var Tiers = []string{"Pico", "Nano", "Micro", "Small", "Medium", "Large", "XLarge"}

// ForkRequest is SandboxForkRequest. Privacy and PrivatePreview are
// pointers because their zero values mean something.
type ForkRequest struct {
	Title          string        `json:"title,omitempty"`
	Description    string        `json:"description,omitempty"`
	Privacy        *int          `json:"privacy,omitempty"`
	PrivatePreview *bool         `json:"private_preview,omitempty"`
	IsFrozen       *bool         `json:"is_frozen,omitempty"`
	Path           string        `json:"path,omitempty"`
	Tags           []string      `json:"tags,omitempty"`
	StartOptions   *StartOptions `json:"start_options,omitempty"`
}

// StartOptions is VMStartRequest, also fork's start_options.
type StartOptions struct {
	Tier                      string        `json:"tier,omitempty"`
	HibernationTimeoutSeconds int           `json:"hibernation_timeout_seconds,omitempty"`
	AutomaticWakeupConfig     *WakeupConfig `json:"automatic_wakeup_config,omitempty"`
	IPCountry                 string        `json:"ipcountry,omitempty"`
}

// WakeupConfig says which preview hits wake a hibernated VM.
type WakeupConfig struct {
	HTTP      bool `json:"http"`
	WebSocket bool `json:"websocket"`
}

// StartResponse is VMStartResponse's data.
type StartResponse struct {
	ID                    string `json:"id"`
	BootupType            string `json:"bootup_type"`
	Cluster               string `json:"cluster"`
	PitcherURL            string `json:"pitcher_url"`
	PitcherToken          Secret `json:"pitcher_token"`
	ReconnectToken        Secret `json:"reconnect_token"`
	PitcherVersion        string `json:"pitcher_version"`
	LatestPitcherVersion  string `json:"latest_pitcher_version"`
	PitcherManagerVersion string `json:"pitcher_manager_version"`
	WorkspacePath         string `json:"workspace_path"`
	UserWorkspacePath     string `json:"user_workspace_path"`
	UsePint               bool   `json:"use_pint"`
	PintURL               string `json:"pint_url"`
	PintToken             Secret `json:"pint_token"`
}

// ForkResponse is the fork endpoint's data; StartResponse is set when the
// request had start_options.
type ForkResponse struct {
	ID            string         `json:"id"`
	Alias         string         `json:"alias"`
	Title         string         `json:"title"`
	StartResponse *StartResponse `json:"start_response"`
}

// Sandbox is the Sandbox schema. It has no run state (§2.3).
type Sandbox struct {
	ID          string    `json:"id"`
	Title       *string   `json:"title"`
	Description *string   `json:"description"`
	Privacy     int       `json:"privacy"`
	IsFrozen    bool      `json:"is_frozen"`
	CreatedAt   time.Time `json:"created_at"`
	UpdatedAt   time.Time `json:"updated_at"`
	Tags        []string  `json:"tags"`
	Settings    struct {
		UsePint bool `json:"use_pint"`
	} `json:"settings"`
}

// ListOptions are GET /sandbox's query parameters; zero values are omitted.
type ListOptions struct {
	Tags      []string
	OrderBy   string // inserted_at | updated_at
	Direction string // asc | desc
	PageSize  int    // 1–50
	Page      int    // ≥ 1
	Running   bool   // status=running
}

// SandboxList is GET /sandbox's data.
type SandboxList struct {
	Sandboxes  []Sandbox `json:"sandboxes"`
	Pagination struct {
		CurrentPage  int  `json:"current_page"`
		NextPage     *int `json:"next_page"`
		TotalRecords int  `json:"total_records"`
	} `json:"pagination"`
}

// FlexValue is a scalar whose JSON type the reference does not document
// (a reset time, a credit basis): a string, a number, a bool or null,
// kept as text. Decoding never fails on it, so an optional field in an
// unexpected form cannot break a whole response (and Ping with it).
type FlexValue string

// UnmarshalJSON takes any JSON scalar; objects and arrays are refused.
func (f *FlexValue) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case bytes.Equal(b, []byte("null")):
		*f = ""
	case len(b) > 0 && b[0] == '"':
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		*f = FlexValue(s)
	case len(b) > 0 && (b[0] == '{' || b[0] == '['):
		return fmt.Errorf("codesandbox: expected a scalar, got %.20s", b)
	default:
		*f = FlexValue(b)
	}
	return nil
}

// Budget is one rate-limit budget in /meta/info. The SDK types Reset as a
// number (types.gen.d.ts:347); it stays a FlexValue so a string form (as
// ParseRateLimit reads from the x-csb-*-reset headers) cannot break Ping.
type Budget struct {
	Limit     int       `json:"limit"`
	Remaining int       `json:"remaining"`
	Reset     FlexValue `json:"reset,omitempty"`
}

// MetaInfo is GET /meta/info's body, MetaInformation in the SDK
// (types.gen.d.ts:320-355). It is the one response not wrapped in the
// {success, errors, data} envelope: the spec answers it with a bare
// MetaInformation (types.gen.d.ts:955-959) and the SDK's getMetaInfo
// returns it without handleResponse (dist/esm/index.js:12422). Auth and
// RateLimits are optional there, and Auth.Team may be null.
type MetaInfo struct {
	API struct {
		Name          string `json:"name"`
		LatestVersion string `json:"latest_version"`
	} `json:"api"`
	Auth struct {
		Scopes  []string `json:"scopes"`
		Team    string   `json:"team"`
		Version string   `json:"version"`
	} `json:"auth"`
	RateLimits struct {
		ConcurrentVMs   Budget `json:"concurrent_vms"`
		RequestsHourly  Budget `json:"requests_hourly"`
		SandboxesHourly Budget `json:"sandboxes_hourly"`
	} `json:"rate_limits"`
}

// RunningVMs is GET /vm/running's data.
type RunningVMs struct {
	ConcurrentVMCount int `json:"concurrent_vm_count"`
	ConcurrentVMLimit int `json:"concurrent_vm_limit"`
	VMs               []struct {
		ID               string    `json:"id"`
		LastActiveAt     Timestamp `json:"last_active_at"`
		SessionStartedAt Timestamp `json:"session_started_at"`
		// Units and number types of specs are not documented.
		Specs struct {
			CPU     float64 `json:"cpu"`
			Memory  float64 `json:"memory"`
			Storage float64 `json:"storage"`
		} `json:"specs"`
		CreditBasis FlexValue `json:"credit_basis"`
	} `json:"vms"`
}

// PreviewToken is one preview (host) token.
type PreviewToken struct {
	Token       Secret     `json:"token"`
	TokenID     string     `json:"token_id"`
	TokenPrefix string     `json:"token_prefix"`
	ExpiresAt   *time.Time `json:"expires_at"`
	LastUsedAt  *time.Time `json:"last_used_at"`
}
