package identity

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// principalName keeps principal IDs safe to use in file names, labels and logs.
var principalName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$`)

// TokenEntry is one line of MCP_TOKENS_FILE. Only the token's hash is stored.
type TokenEntry struct {
	Principal   string `json:"principal"`
	Tier        string `json:"tier"`
	TokenSHA256 string `json:"token_sha256"`
	Admin       bool   `json:"admin,omitempty"`
}

// ValidPrincipal reports whether id is usable as a principal ID (safe in
// file names, labels and logs).
func ValidPrincipal(id string) bool { return principalName.MatchString(id) }

type entry struct {
	principal Principal
	hash      [sha256.Size]byte
}

// Registry authenticates bearer tokens. It is immutable after construction.
type Registry struct {
	entries []entry
}

// NewRegistry validates entries: names, tiers, 64-hex hashes, no duplicates.
func NewRegistry(entries []TokenEntry) (*Registry, error) {
	r := &Registry{}
	seenP := map[string]bool{}
	seenH := map[[sha256.Size]byte]bool{}
	for i, e := range entries {
		if !principalName.MatchString(e.Principal) {
			return nil, fmt.Errorf("entry %d: principal must match %s", i, principalName)
		}
		tier, err := quota.ParseTier(e.Tier)
		if err != nil {
			return nil, fmt.Errorf("entry %d (%s): tier must be free or pro", i, e.Principal)
		}
		raw, err := hex.DecodeString(strings.ToLower(e.TokenSHA256))
		if err != nil || len(raw) != sha256.Size {
			return nil, fmt.Errorf("entry %d (%s): token_sha256 must be 64 hex characters", i, e.Principal)
		}
		var h [sha256.Size]byte
		copy(h[:], raw)
		if seenP[e.Principal] || seenH[h] {
			return nil, fmt.Errorf("entry %d (%s): duplicate principal or token", i, e.Principal)
		}
		seenP[e.Principal], seenH[h] = true, true
		r.entries = append(r.entries, entry{principal: Principal{ID: e.Principal, Tier: tier, Admin: e.Admin}, hash: h})
	}
	if len(r.entries) == 0 {
		return nil, errors.New("no tokens configured")
	}
	return r, nil
}

// LoadTokensFile reads a JSON array of TokenEntry.
func LoadTokensFile(path string) ([]TokenEntry, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []TokenEntry
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&out); err != nil {
		return nil, fmt.Errorf("not a JSON array of {principal, tier, token_sha256, admin}: %w", err)
	}
	// A second value (say, two arrays pasted together) would otherwise be
	// ignored silently, dropping its tokens.
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("not a JSON array of {principal, tier, token_sha256, admin}: data after the array")
	}
	return out, nil
}

// HashToken is the hex SHA-256 that MCP_TOKENS_FILE stores.
func HashToken(token string) string {
	h := sha256.Sum256([]byte(token))
	return hex.EncodeToString(h[:])
}

// Authenticate maps a presented token to its principal. Every entry is
// compared, in constant time, so timing reveals neither which entry matched
// nor how much of a hash did.
func (r *Registry) Authenticate(token string) (Principal, bool) {
	if r == nil || token == "" {
		return Principal{}, false
	}
	h := sha256.Sum256([]byte(token))
	var found Principal
	match := 0
	for _, e := range r.entries {
		eq := subtle.ConstantTimeCompare(h[:], e.hash[:])
		if eq == 1 {
			found = e.principal
		}
		match |= eq
	}
	return found, match == 1
}

// Principal looks a configured principal up by ID (an OAuth grant checks
// that the principal behind its consent still exists, and its tier).
func (r *Registry) Principal(id string) (Principal, bool) {
	if r == nil {
		return Principal{}, false
	}
	for _, e := range r.entries {
		if e.principal.ID == id {
			return e.principal, true
		}
	}
	return Principal{}, false
}

// Principals lists configured principals (for docs and startup logs).
func (r *Registry) Principals() []Principal {
	out := make([]Principal, 0, len(r.entries))
	for _, e := range r.entries {
		out = append(out, e.principal)
	}
	return out
}

// TokenFileName is where a generated token is kept inside SANDBOX_ROOT.
const TokenFileName = "api_token"

// NewToken returns a fresh API token: "sbk_" and 32 random bytes.
func NewToken() string {
	var raw [32]byte
	_, _ = rand.Read(raw[:]) // crypto/rand.Read never fails (Go 1.24+)
	return "sbk_" + base64.RawURLEncoding.EncodeToString(raw[:])
}

// LoadOrCreateToken returns the token kept in dir, generating a random one
// (256 bits, mode 0600) on first start. created reports a new token.
func LoadOrCreateToken(dir string) (token string, created bool, err error) {
	path := filepath.Join(dir, TokenFileName)
	b, err := os.ReadFile(path)
	if err == nil {
		t := strings.TrimSpace(string(b))
		if len(t) < 32 {
			return "", false, fmt.Errorf("%s is too short to be a generated token; delete it to regenerate", TokenFileName)
		}
		return t, false, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return "", false, err
	}
	t := NewToken()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", false, err
	}
	if _, err := f.WriteString(t + "\n"); err != nil {
		f.Close()
		return "", false, err
	}
	return t, true, f.Close()
}
