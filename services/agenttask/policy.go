package agenttask

import (
	"bytes"
	"encoding/json"
	"fmt"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/egress"
	"github.com/sandbox-broker/sandbox-broker/services/modelgw"
)

// Policy is what one tier's tasks may do.
type Policy struct {
	MaxTimeout time.Duration
	// Network is the widest egress a task may ask for beside the model
	// gateway: none, allow (domains the caller lists) or public ("YOLO
	// level 2"; private and metadata ranges stay refused).
	Network egress.Mode
	Budget  modelgw.Limits
}

// DefaultPolicies apply to tiers AGENT_TIERS leaves out, and to the fields
// it leaves out. Tasks get the model gateway only unless the operator
// opens more.
var DefaultPolicies = map[string]Policy{
	"free": {MaxTimeout: 5 * time.Minute, Network: egress.ModeNone, Budget: modelgw.Limits{RequestsPerDay: 200, TokensPerDay: 2_000_000}},
	"pro":  {MaxTimeout: 10 * time.Minute, Network: egress.ModeNone, Budget: modelgw.Limits{RequestsPerDay: 5000, TokensPerDay: 50_000_000}},
}

// tierJSON is one tier in AGENT_TIERS.
type tierJSON struct {
	MaxTimeoutS    *int    `json:"max_timeout_s"`
	Network        *string `json:"network"`
	RequestsPerDay *int64  `json:"requests_per_day"`
	TokensPerDay   *int64  `json:"tokens_per_day"`
}

// ParsePolicies reads AGENT_TIERS, a JSON object from tier to
// {"max_timeout_s", "network": "none"|"allow"|"public", "requests_per_day",
// "tokens_per_day"}, each field optional, over DefaultPolicies. Unknown
// tiers or keys are refused.
func ParsePolicies(raw string) (map[string]Policy, error) {
	out := map[string]Policy{}
	for k, v := range DefaultPolicies {
		out[k] = v
	}
	if raw == "" {
		return out, nil
	}
	dec := json.NewDecoder(bytes.NewReader([]byte(raw)))
	dec.DisallowUnknownFields()
	var in map[string]tierJSON
	if err := dec.Decode(&in); err != nil {
		return nil, fmt.Errorf("AGENT_TIERS: %v", err)
	}
	for tier, t := range in {
		p, ok := out[tier]
		if !ok {
			return nil, fmt.Errorf("AGENT_TIERS: unknown tier %q (known: free, pro)", tier)
		}
		if t.MaxTimeoutS != nil {
			if *t.MaxTimeoutS < 1 || *t.MaxTimeoutS > 3600 {
				return nil, fmt.Errorf("AGENT_TIERS: %s.max_timeout_s must be 1 to 3600", tier)
			}
			p.MaxTimeout = time.Duration(*t.MaxTimeoutS) * time.Second
		}
		if t.Network != nil {
			switch m := egress.Mode(*t.Network); m {
			case egress.ModeNone, egress.ModeAllow, egress.ModePublic:
				p.Network = m
			default:
				return nil, fmt.Errorf("AGENT_TIERS: %s.network must be none, allow or public", tier)
			}
		}
		if t.RequestsPerDay != nil {
			if *t.RequestsPerDay < 0 {
				return nil, fmt.Errorf("AGENT_TIERS: %s.requests_per_day must not be negative", tier)
			}
			p.Budget.RequestsPerDay = *t.RequestsPerDay
		}
		if t.TokensPerDay != nil {
			if *t.TokensPerDay < 0 {
				return nil, fmt.Errorf("AGENT_TIERS: %s.tokens_per_day must not be negative", tier)
			}
			p.Budget.TokensPerDay = *t.TokensPerDay
		}
		out[tier] = p
	}
	return out, nil
}
