package oauth

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// TestPrune: unused registrations expire, used ones stay while they have
// grants; expired refresh tokens and dead grants go; lookups then fail closed.
func TestPrune(t *testing.T) { eachStore(t, testPrune) }

func testPrune(t *testing.T, dbPath func(testing.TB) string) {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s, err := OpenStore(ctx, dbPath(t), func() time.Time { return now })
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	reg := Registration{RedirectURIs: []string{"https://a.example/cb"}, GrantTypes: []string{"authorization_code", "refresh_token"}}
	for _, id := range []string{"unused", "used"} {
		if err := s.CreateClient(ctx, Client{ID: id, Metadata: reg, CreatedAt: now}, 10); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.CreateGrant(ctx, Grant{ID: "g1", ClientID: "used", Principal: "alice", Scopes: []string{Scope}, Audience: "x"}, "rt-1", 48*time.Hour); err != nil {
		t.Fatal(err)
	}
	// A day later: the unused registration expires, the used one stays.
	now = now.Add(25 * time.Hour)
	if err := s.Prune(ctx, 15*time.Minute, clientUnusedTTL); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Client(ctx, "unused"); !errors.Is(err, ErrNotFound) {
		t.Errorf("unused registration survived: %v", err)
	}
	if _, err := s.Client(ctx, "used"); err != nil {
		t.Errorf("used registration pruned: %v", err)
	}
	if _, err := s.RefreshGrant(ctx, "rt-1"); err != nil {
		t.Errorf("live refresh token: %v", err)
	}
	// Past the refresh token's life: token, grant, then client go.
	now = now.Add(48 * time.Hour)
	if _, err := s.RefreshGrant(ctx, "rt-1"); !errors.Is(err, ErrExpired) {
		t.Errorf("expired refresh token: %v", err)
	}
	if err := s.Prune(ctx, 15*time.Minute, clientUnusedTTL); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ActiveGrant(ctx, "g1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("dead grant survived: %v", err)
	}
	if _, err := s.Client(ctx, "used"); !errors.Is(err, ErrNotFound) {
		t.Errorf("idle registration without grants survived: %v", err)
	}
	// The cap on unused registrations.
	for i := 0; i < 3; i++ {
		err := s.CreateClient(ctx, Client{ID: "c" + string(rune('a'+i)), Metadata: reg, CreatedAt: now}, 2)
		if (i < 2) != (err == nil) {
			t.Errorf("registration %d: %v", i, err)
		}
	}
}

// eachStore runs fn once per store (a state.db file, a PostgreSQL
// database), handing it that store's location maker.
func eachStore(t *testing.T, fn func(t *testing.T, loc func(testing.TB) string)) {
	statedbtest.Run(t, func(t *testing.T, st statedbtest.Store) { fn(t, st.Loc) })
}
