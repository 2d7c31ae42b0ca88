package github_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/github/ghfake"
)

// GitHub names a fine-grained token's expiry in a header on every answer;
// the manager keeps it and warns once when it is ExpiryWarning or less away.
func TestTokenExpiryIsKeptAndWarnedOnce(t *testing.T) {
	exp := time.Now().Add(3 * 24 * time.Hour).Truncate(time.Second).UTC()
	e := setupWith(t, allowList, map[string]string{env: token}, func(f *ghfake.Fake) { f.SetTokenExpiry(token, exp) })
	if got := e.m.TokenExpiries()[repoID]; !got.Equal(exp) {
		t.Fatalf("expiry %v, want %v (from the start-up check)", got, exp)
	}
	e.m.WarnExpiring(time.Now())
	if _, _, _, err := e.m.ReadFile(context.Background(), repoID, "README.md", ""); err != nil {
		t.Fatal(err)
	}
	logs := e.logs.String()
	if n := strings.Count(logs, "github_token_expiring"); n != 1 {
		t.Fatalf("%d expiring warnings, want 1:\n%s", n, logs)
	}
	if !strings.Contains(logs, `"repo_ids":["widgets"]`) || strings.Contains(logs, token) {
		t.Fatalf("warning: %s", logs)
	}
	e.m.WarnExpiring(exp.Add(time.Second))
	e.m.WarnExpiring(exp.Add(time.Minute))
	if n := strings.Count(e.logs.String(), "github_token_expired"); n != 1 {
		t.Fatalf("%d expired errors, want 1", n)
	}

	// A token with no expiry is absent; one further away is not warned about.
	far := setupWith(t, allowList, map[string]string{env: token}, func(f *ghfake.Fake) { f.SetTokenExpiry(token, time.Now().Add(30*24*time.Hour)) })
	far.m.WarnExpiring(time.Now())
	if strings.Contains(far.logs.String(), "github_token_expir") || far.m.TokenExpiries()[repoID].IsZero() {
		t.Fatalf("far: %v %s", far.m.TokenExpiries(), far.logs.String())
	}
	if never := setup(t, true); len(never.m.TokenExpiries()) != 0 {
		t.Fatalf("no expiry announced, got %v", never.m.TokenExpiries())
	}
}

// Past its expiry GitHub refuses the token; the repo is not ready.
func TestExpiredTokenIsRejected(t *testing.T) {
	e := setupWith(t, allowList, map[string]string{env: token}, func(f *ghfake.Fake) { f.SetTokenExpiry(token, time.Now().Add(-time.Minute)) })
	if s := e.m.Status()[repoID]; s != "token rejected" {
		t.Fatalf("status %q", s)
	}
}
