package identity_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

func entry(p, tier, token string) identity.TokenEntry {
	return identity.TokenEntry{Principal: p, Tier: tier, TokenSHA256: identity.HashToken(token)}
}

func TestContext(t *testing.T) {
	if _, ok := identity.FromContext(context.Background()); ok {
		t.Error("empty context has a principal")
	}
	if _, ok := identity.FromContext(identity.WithPrincipal(context.Background(), identity.Principal{Tier: quota.TierPro})); ok {
		t.Error("a principal without an ID counts")
	}
	p := identity.Principal{ID: "alice", Tier: quota.TierFree}
	got, ok := identity.FromContext(identity.WithPrincipal(context.Background(), p))
	if !ok || got != p {
		t.Errorf("got %+v %v", got, ok)
	}
}

func TestHashToken(t *testing.T) {
	// sha256("abc")
	if got := identity.HashToken("abc"); got != "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad" {
		t.Errorf("HashToken = %s", got)
	}
}

func TestNewRegistryRejects(t *testing.T) {
	good := entry("alice", "pro", "token-a")
	cases := map[string][]identity.TokenEntry{
		"none":               nil,
		"empty name":         {entry("", "pro", "t")},
		"name with slash":    {entry("a/b", "pro", "t")},
		"name with space":    {entry("a b", "pro", "t")},
		"name leading dot":   {entry(".alice", "pro", "t")},
		"name newline":       {entry("alice\n", "pro", "t")},
		"name too long":      {entry(strings.Repeat("a", 65), "pro", "t")},
		"unknown tier":       {entry("alice", "gold", "t")},
		"tier case":          {entry("alice", "Pro", "t")},
		"empty tier":         {entry("alice", "", "t")},
		"short hash":         {{Principal: "alice", Tier: "pro", TokenSHA256: "abcd"}},
		"non-hex hash":       {{Principal: "alice", Tier: "pro", TokenSHA256: strings.Repeat("g", 64)}},
		"long hash":          {{Principal: "alice", Tier: "pro", TokenSHA256: strings.Repeat("a", 66)}},
		"raw token as hash":  {{Principal: "alice", Tier: "pro", TokenSHA256: "token-a"}},
		"duplicate name":     {good, entry("alice", "free", "token-b")},
		"duplicate token":    {good, entry("bob", "pro", "token-a")},
		"duplicate hex case": {good, {Principal: "bob", Tier: "pro", TokenSHA256: strings.ToUpper(good.TokenSHA256)}},
	}
	for name, entries := range cases {
		if r, err := identity.NewRegistry(entries); err == nil {
			t.Errorf("%s: accepted (%v)", name, r.Principals())
		} else if strings.Contains(err.Error(), "token-a") {
			t.Errorf("%s: error %q echoes a token", name, err)
		}
	}
	ok := []identity.TokenEntry{good, entry("bob.smith@example.com", "free", "token-b"),
		entry(strings.Repeat("z", 64), "pro", "token-c"),
		{Principal: "carol", Tier: "pro", TokenSHA256: strings.ToUpper(identity.HashToken("token-d"))}}
	r, err := identity.NewRegistry(ok)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Principals(); len(got) != 4 || got[0].ID != "alice" || got[1].Tier != quota.TierFree {
		t.Errorf("Principals = %+v", got)
	}
	// An upper-case hash authenticates like a lower-case one.
	if p, ok := r.Authenticate("token-d"); !ok || p.ID != "carol" {
		t.Errorf("upper-case hash: %+v %v", p, ok)
	}
}

func TestAuthenticate(t *testing.T) {
	var entries []identity.TokenEntry
	tokens := map[string]string{}
	for i := 0; i < 50; i++ {
		p, tok := fmt.Sprintf("user%02d", i), fmt.Sprintf("sbk_token_%02d_0123456789abcdef", i)
		tier := "free"
		if i%2 == 0 {
			tier = "pro"
		}
		entries = append(entries, entry(p, tier, tok))
		tokens[p] = tok
	}
	r, err := identity.NewRegistry(entries)
	if err != nil {
		t.Fatal(err)
	}
	for p, tok := range tokens {
		got, ok := r.Authenticate(tok)
		if !ok || got.ID != p {
			t.Errorf("token of %s authenticated as %+v %v", p, got, ok)
		}
	}
	if got, _ := r.Authenticate(tokens["user07"]); got.Tier != quota.TierFree {
		t.Errorf("tier %q", got.Tier)
	}
	tok := tokens["user13"]
	for _, near := range []string{
		"", tok[:len(tok)-1], tok + "x", " " + tok, tok + "\n", strings.ToUpper(tok), tok[:len(tok)-1] + "0",
		identity.HashToken(tok), entries[13].TokenSHA256,
	} {
		if got, ok := r.Authenticate(near); ok || got != (identity.Principal{}) {
			t.Errorf("near miss %q authenticated as %+v", near, got)
		}
	}
	var nilReg *identity.Registry
	if _, ok := nilReg.Authenticate(tok); ok {
		t.Error("nil registry authenticated")
	}
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tokens.json")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadTokensFile(t *testing.T) {
	h := identity.HashToken("tok")
	got, err := identity.LoadTokensFile(writeFile(t, `[{"principal":"alice","tier":"pro","token_sha256":"`+h+`"}]`+"\n"))
	if err != nil || len(got) != 1 || got[0] != (identity.TokenEntry{Principal: "alice", Tier: "pro", TokenSHA256: h}) {
		t.Fatalf("%+v %v", got, err)
	}
	for name, content := range map[string]string{
		"unknown field":  `[{"principal":"alice","tier":"pro","token_sha256":"` + h + `","token":"tok"}]`,
		"object":         `{"principal":"alice"}`,
		"not json":       `principal=alice`,
		"trailing array": `[{"principal":"alice","tier":"pro","token_sha256":"` + h + `"}] [{"principal":"bob"}]`,
		"trailing junk":  `[] x`,
		"wrong type":     `[{"principal":1}]`,
		"truncated":      `[{"principal":"alice"`,
		"empty":          ``,
	} {
		if _, err := identity.LoadTokensFile(writeFile(t, content)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := identity.LoadTokensFile(filepath.Join(t.TempDir(), "missing.json")); err == nil {
		t.Error("missing file accepted")
	}
}

func TestLoadOrCreateToken(t *testing.T) {
	dir := t.TempDir()
	tok, created, err := identity.LoadOrCreateToken(dir)
	if err != nil || !created {
		t.Fatalf("create: %v %v", created, err)
	}
	if !strings.HasPrefix(tok, "sbk_") || len(tok) != 4+43 {
		t.Errorf("token %q", tok)
	}
	path := filepath.Join(dir, identity.TokenFileName)
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600", fi.Mode().Perm())
	}
	again, created, err := identity.LoadOrCreateToken(dir)
	if err != nil || created || again != tok {
		t.Errorf("reuse: %q %v %v", again, created, err)
	}
	// Another directory gets another token.
	other, _, err := identity.LoadOrCreateToken(t.TempDir())
	if err != nil || other == tok {
		t.Errorf("second token %q %v", other, err)
	}
	// A hand-written file with surrounding whitespace is trimmed.
	long := strings.Repeat("k", 40)
	if err := os.WriteFile(path, []byte("  "+long+"\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, _, err := identity.LoadOrCreateToken(dir); err != nil || got != long {
		t.Errorf("trimmed: %q %v", got, err)
	}
	// Too short is refused, not replaced, and not echoed.
	if err := os.WriteFile(path, []byte("shortsecret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := identity.LoadOrCreateToken(dir); err == nil || strings.Contains(err.Error(), "shortsecret") {
		t.Errorf("short token: %v", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "shortsecret\n" {
		t.Error("short token file was modified")
	}
	// A directory that does not exist is an error, not a panic.
	if _, _, err := identity.LoadOrCreateToken(filepath.Join(dir, "missing")); err == nil {
		t.Error("missing dir accepted")
	}
}

func TestAdminAndLookup(t *testing.T) {
	h := identity.HashToken("tok-admin")
	got, err := identity.LoadTokensFile(writeFile(t, `[{"principal":"ops","tier":"pro","token_sha256":"`+h+`","admin":true},`+
		`{"principal":"alice","tier":"free","token_sha256":"`+identity.HashToken("tok-alice")+`"}]`))
	if err != nil {
		t.Fatal(err)
	}
	r, err := identity.NewRegistry(got)
	if err != nil {
		t.Fatal(err)
	}
	if p, ok := r.Authenticate("tok-admin"); !ok || !p.Admin || p.ID != "ops" {
		t.Errorf("admin token: %+v %v", p, ok)
	}
	if p, ok := r.Principal("alice"); !ok || p.Admin || p.Tier != quota.TierFree {
		t.Errorf("lookup alice: %+v %v", p, ok)
	}
	if _, ok := r.Principal("mallory"); ok {
		t.Error("unknown principal found")
	}
	var nilReg *identity.Registry
	if _, ok := nilReg.Principal("alice"); ok {
		t.Error("nil registry found a principal")
	}
	for id, want := range map[string]bool{"alice": true, "a.b@c-d_e": true, "": false, "a/b": false, "auth0|123": false, ".x": false} {
		if identity.ValidPrincipal(id) != want {
			t.Errorf("ValidPrincipal(%q) = %v", id, !want)
		}
	}
}
