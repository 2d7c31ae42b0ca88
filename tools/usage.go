package tools

import (
	"context"
	"time"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// UsageReader reads a principal's consumption.
type UsageReader interface {
	Usage(ctx context.Context, principal string, l quota.Limits) (quota.Usage, error)
}

// GetUsageArgs takes no arguments.
type GetUsageArgs struct{}

// UsageResult is get_usage's structured output.
type UsageResult struct {
	Principal string      `json:"principal"`
	Tier      quota.Tier  `json:"tier"`
	Limits    UsageLimits `json:"limits"`
	Used      UsageCounts `json:"used"`
	Remaining UsageCounts `json:"remaining"`
}

// UsageLimits are a tier's limits in client-friendly units.
type UsageLimits struct {
	CallsPerMinute   int   `json:"calls_per_minute"`
	SandboxesPerHour int   `json:"sandboxes_per_hour"`
	ExecutionSPerDay int64 `json:"execution_seconds_per_day"`
}

// UsageCounts are used or remaining amounts in the current windows.
type UsageCounts struct {
	CallsThisMinute   int64 `json:"calls_this_minute"`
	SandboxesThisHour int64 `json:"sandboxes_this_hour"`
	ExecutionSToday   int64 `json:"execution_seconds_today"`
}

// GetUsage reports the caller's principal, tier, limits and what remains.
func GetUsage(usage UsageReader, limits func(identity.Principal) quota.Limits) ServerTool {
	return newTool("get_usage",
		"Report your principal, tier, rate limits and quotas, and how much of each remains.",
		0, readAnnotations("Get usage"),
		func(ctx context.Context, p identity.Principal, _ *GetUsageArgs) (*mcp.CallToolResult, error) {
			l := limits(p)
			u, err := usage.Usage(ctx, p.ID, l)
			if err != nil {
				return nil, brokererr.Wrap(err, brokererr.Unavailable, "usage is unavailable right now")
			}
			out := UsageResult{
				Principal: p.ID, Tier: p.Tier,
				Limits: UsageLimits{CallsPerMinute: l.CallsPerMinute, SandboxesPerHour: l.SandboxesPerHour,
					ExecutionSPerDay: int64(l.ExecutionPerDay / time.Second)},
				Used: UsageCounts{CallsThisMinute: u.CallsUsedLastMinute, SandboxesThisHour: u.SandboxesUsedLastHour,
					ExecutionSToday: int64(u.ExecutionUsedToday / time.Second)},
				Remaining: UsageCounts{CallsThisMinute: u.CallsRemaining, SandboxesThisHour: u.SandboxesRemaining,
					ExecutionSToday: int64(u.ExecutionRemaining / time.Second)},
			}
			return jsonResult(out)
		})
}
