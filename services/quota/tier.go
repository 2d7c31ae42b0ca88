package quota

import (
	"fmt"
	"time"
)

// Tier is a principal's plan.
type Tier string

// Known tiers.
const (
	TierFree Tier = "free"
	TierPro  Tier = "pro"
)

// ParseTier accepts exactly "free" or "pro" (lowercase); anything else is an
// error so a typo in configuration cannot silently pick a plan.
func ParseTier(s string) (Tier, error) {
	switch Tier(s) {
	case TierFree, TierPro:
		return Tier(s), nil
	}
	return "", fmt.Errorf("quota: unknown tier %q (want %q or %q)", s, TierFree, TierPro)
}

// Limits are the budgets enforced for one principal.
type Limits struct {
	CallsPerMinute   int           `json:"calls_per_minute"`
	SandboxesPerHour int           `json:"sandboxes_per_hour"`
	ExecutionPerDay  time.Duration `json:"-"`
}

// LimitsFor returns the product-spec limits for t. A positive
// callsPerMinuteOverride (RATE_LIMIT_PER_MINUTE) replaces CallsPerMinute for
// every tier; 0 or negative means no override. An unknown tier gets the free
// limits: failing towards the most restrictive plan.
func LimitsFor(t Tier, callsPerMinuteOverride int) Limits {
	l := Limits{CallsPerMinute: 10, SandboxesPerHour: 5, ExecutionPerDay: time.Hour}
	if t == TierPro {
		l = Limits{CallsPerMinute: 100, SandboxesPerHour: 100, ExecutionPerDay: 24 * time.Hour}
	}
	if callsPerMinuteOverride > 0 {
		l.CallsPerMinute = callsPerMinuteOverride
	}
	return l
}
