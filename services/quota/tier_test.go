package quota

import (
	"testing"
	"time"
)

func TestParseTier(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Tier
		ok   bool
	}{
		{"free", TierFree, true},
		{"pro", TierPro, true},
		{"Free", "", false},
		{"PRO", "", false},
		{" pro", "", false},
		{"", "", false},
		{"enterprise", "", false},
	} {
		got, err := ParseTier(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseTier(%q) = %q, %v; want %q, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestLimitsFor(t *testing.T) {
	for _, tc := range []struct {
		name     string
		tier     Tier
		override int
		want     Limits
	}{
		{"free", TierFree, 0, Limits{CallsPerMinute: 10, SandboxesPerHour: 5, ExecutionPerDay: time.Hour}},
		{"pro", TierPro, 0, Limits{CallsPerMinute: 100, SandboxesPerHour: 100, ExecutionPerDay: 24 * time.Hour}},
		{"free override", TierFree, 30, Limits{CallsPerMinute: 30, SandboxesPerHour: 5, ExecutionPerDay: time.Hour}},
		{"pro override", TierPro, 7, Limits{CallsPerMinute: 7, SandboxesPerHour: 100, ExecutionPerDay: 24 * time.Hour}},
		{"negative override ignored", TierPro, -1, Limits{CallsPerMinute: 100, SandboxesPerHour: 100, ExecutionPerDay: 24 * time.Hour}},
		{"unknown tier is free", Tier("gold"), 0, Limits{CallsPerMinute: 10, SandboxesPerHour: 5, ExecutionPerDay: time.Hour}},
	} {
		if got := LimitsFor(tc.tier, tc.override); got != tc.want {
			t.Errorf("%s: LimitsFor(%q, %d) = %+v; want %+v", tc.name, tc.tier, tc.override, got, tc.want)
		}
	}
}
