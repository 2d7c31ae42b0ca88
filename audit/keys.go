package audit

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/mod/sumdb/note"
)

// KeyName is the note key name and checkpoint origin.
const KeyName = "sandbox-broker/audit"

const minHMACKey = 32

// Keys holds the audit key material. HMACKey never leaves this package except
// through the caller that loaded it.
type Keys struct {
	HMACKey  []byte        // >= 32 bytes
	KeyID    string        // kid stored in every row: first 8 hex of sha256(HMACKey)
	Signer   note.Signer   // checkpoint signer (nil for verify-only keys)
	Verifier note.Verifier // checkpoint verifier
}

// KeyConfig says where keys come from. Empty file paths default to files in
// <Root>/keys. HMACKey (from AUDIT_HMAC_KEY) wins over HMACKeyFile.
type KeyConfig struct {
	Root            string
	HMACKey         string // hex or base64 of >= 32 bytes; empty = use the file
	HMACKeyFile     string // default <Root>/keys/audit_hmac.key
	SigningKeyFile  string // default <Root>/keys/audit_checkpoint.key
	VerifierKeyFile string // default <Root>/keys/audit_checkpoint.pub
}

// path returns p, or <Root>/keys/name when p is empty.
func (c KeyConfig) path(p, name string) (string, error) {
	if p != "" {
		return p, nil
	}
	if c.Root == "" {
		return "", fmt.Errorf("audit: key config: %s path not set and no root", name)
	}
	return filepath.Join(c.Root, "keys", name), nil
}

// LoadKeys resolves the HMAC key and the checkpoint key pair, creating any
// missing key file (HMAC: hex of 32 random bytes, 0600; signing key:
// note.GenerateKey text, 0600; verifier key: note verifier text, 0644).
// It refuses to invent a new signing key when a verifier key already exists,
// because that would orphan every checkpoint signed so far.
func LoadKeys(cfg KeyConfig) (Keys, error) {
	skFile, err := cfg.path(cfg.SigningKeyFile, "audit_checkpoint.key")
	if err != nil {
		return Keys{}, err
	}
	vkFile, err := cfg.path(cfg.VerifierKeyFile, "audit_checkpoint.pub")
	if err != nil {
		return Keys{}, err
	}
	k, err := loadHMACKey(cfg, true)
	if err != nil {
		return Keys{}, err
	}

	if _, err := os.Stat(skFile); errors.Is(err, fs.ErrNotExist) {
		if _, err := os.Stat(vkFile); err == nil {
			return Keys{}, fmt.Errorf("audit: signing key %s is missing but verifier key %s exists", skFile, vkFile)
		}
		skey, vkey, err := note.GenerateKey(rand.Reader, KeyName)
		if err != nil {
			return Keys{}, fmt.Errorf("audit: generate checkpoint key: %w", err)
		}
		if err := createIfMissing(skFile, 0o600, func() ([]byte, error) { return []byte(skey + "\n"), nil }); err != nil {
			return Keys{}, err
		}
		if err := createIfMissing(vkFile, 0o644, func() ([]byte, error) { return []byte(vkey + "\n"), nil }); err != nil {
			return Keys{}, err
		}
	}
	if _, err := os.Stat(vkFile); errors.Is(err, fs.ErrNotExist) {
		// The public half can always be re-derived from the private key.
		if err := createIfMissing(vkFile, 0o644, func() ([]byte, error) { return deriveVerifierKey(skFile) }); err != nil {
			return Keys{}, err
		}
	}
	if k.Signer, err = readSigner(skFile); err != nil {
		return Keys{}, err
	}
	if k.Verifier, err = readVerifier(vkFile); err != nil {
		return Keys{}, err
	}
	if err := checkPair(k.Signer, k.Verifier); err != nil {
		return Keys{}, fmt.Errorf("audit: %s and %s: %w", skFile, vkFile, err)
	}
	return k, nil
}

// LoadVerifyKeys loads the HMAC key and the verifier key without creating
// anything; Signer stays nil.
func LoadVerifyKeys(cfg KeyConfig) (Keys, error) {
	k, err := loadHMACKey(cfg, false)
	if err != nil {
		return Keys{}, err
	}
	vkFile, err := cfg.path(cfg.VerifierKeyFile, "audit_checkpoint.pub")
	if err != nil {
		return Keys{}, err
	}
	if k.Verifier, err = readVerifier(vkFile); err != nil {
		return Keys{}, err
	}
	return k, nil
}

// loadHMACKey returns Keys with the HMAC key and its ID: AUDIT_HMAC_KEY,
// or the key file, which create makes (hex of 32 random bytes, 0600) when
// it is missing.
func loadHMACKey(cfg KeyConfig, create bool) (Keys, error) {
	key, err := hmacKey(cfg, create)
	if err != nil {
		return Keys{}, err
	}
	return Keys{HMACKey: key, KeyID: keyID(key)}, nil
}

func hmacKey(cfg KeyConfig, create bool) ([]byte, error) {
	if cfg.HMACKey != "" {
		k, err := decodeHMACKey([]byte(cfg.HMACKey))
		if err != nil {
			return nil, fmt.Errorf("audit: AUDIT_HMAC_KEY: %w", err)
		}
		return k, nil
	}
	hmacFile, err := cfg.path(cfg.HMACKeyFile, "audit_hmac.key")
	if err != nil {
		return nil, err
	}
	if create {
		if err := createIfMissing(hmacFile, 0o600, func() ([]byte, error) {
			b := make([]byte, minHMACKey)
			if _, err := rand.Read(b); err != nil {
				return nil, err
			}
			return []byte(hex.EncodeToString(b) + "\n"), nil
		}); err != nil {
			return nil, err
		}
	}
	return readHMACKeyFile(hmacFile)
}

func keyID(key []byte) string {
	s := sha256.Sum256(key)
	return hex.EncodeToString(s[:4])
}

// decodeHMACKey accepts hex or (std/url, padded or not) base64. Errors never
// echo the input.
func decodeHMACKey(b []byte) ([]byte, error) {
	s := strings.TrimSpace(string(b))
	var out []byte
	if d, err := hex.DecodeString(s); err == nil {
		out = d
	} else {
		for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
			if d, err := enc.DecodeString(s); err == nil {
				out = d
				break
			}
		}
	}
	if out == nil {
		return nil, errors.New("key is neither hex nor base64")
	}
	if len(out) < minHMACKey {
		return nil, fmt.Errorf("key must decode to at least %d bytes", minHMACKey)
	}
	return out, nil
}

// readHMACKeyFile reads hex/base64 text, or raw bytes (e.g. head -c32
// /dev/urandom) when the content is not valid text encoding.
func readHMACKeyFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("audit: read HMAC key: %w", err)
	}
	if k, err := decodeHMACKey(b); err == nil {
		return k, nil
	}
	if len(b) >= minHMACKey && !isPrintable(b) {
		return b, nil
	}
	return nil, fmt.Errorf("audit: HMAC key file %s: want hex or base64 of at least %d bytes", path, minHMACKey)
}

func isPrintable(b []byte) bool {
	for _, c := range b {
		if c < 0x20 && c != '\n' && c != '\r' && c != '\t' || c > 0x7e {
			return false
		}
	}
	return true
}

func readSigner(path string) (note.Signer, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("audit: read signing key: %w", err)
	}
	s, err := note.NewSigner(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("audit: signing key file %s is malformed", path)
	}
	return s, nil
}

// deriveVerifierKey rebuilds the verifier key text from a note signer key
// ("PRIVATE+KEY+<name>+<hash>+<base64(0x01 || ed25519 seed)>").
func deriveVerifierKey(skFile string) ([]byte, error) {
	b, err := os.ReadFile(skFile)
	if err != nil {
		return nil, err
	}
	bad := fmt.Errorf("signing key file %s is malformed", skFile)
	parts := strings.SplitN(strings.TrimSpace(string(b)), "+", 5) // base64 may contain "+"
	if len(parts) != 5 || parts[0] != "PRIVATE" || parts[1] != "KEY" {
		return nil, bad
	}
	raw, err := base64.StdEncoding.DecodeString(parts[4])
	if err != nil || len(raw) != 1+ed25519.SeedSize || raw[0] != 1 {
		return nil, bad
	}
	pub := ed25519.NewKeyFromSeed(raw[1:]).Public().(ed25519.PublicKey)
	vkey, err := note.NewEd25519VerifierKey(parts[2], pub)
	if err != nil {
		return nil, bad
	}
	return []byte(vkey + "\n"), nil
}

func readVerifier(path string) (note.Verifier, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("audit: read verifier key: %w", err)
	}
	v, err := note.NewVerifier(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("audit: verifier key file %s: %w", path, err)
	}
	return v, nil
}

// checkPair signs a probe so a mismatched key pair fails at start-up rather
// than at the next verification.
func checkPair(s note.Signer, v note.Verifier) error {
	msg, err := note.Sign(&note.Note{Text: "audit key check\n"}, s)
	if err != nil {
		return fmt.Errorf("sign probe: %w", err)
	}
	if _, err := note.Open(msg, note.VerifierList(v)); err != nil {
		return errors.New("signing key does not match verifier key")
	}
	return nil
}

// createIfMissing writes a new file atomically and without clobbering: the
// content goes to a temp file that is hard-linked into place, so a crash or
// a concurrent creator never leaves a half-written key.
func createIfMissing(path string, mode os.FileMode, content func() ([]byte, error)) error {
	if _, err := os.Lstat(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("audit: stat %s: %w", path, err)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("audit: create key dir: %w", err)
	}
	data, err := content()
	if err != nil {
		return fmt.Errorf("audit: generate %s: %w", path, err)
	}
	tmp, err := os.CreateTemp(dir, ".tmp-audit-key-*")
	if err != nil {
		return fmt.Errorf("audit: create %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	_, werr := tmp.Write(data)
	if werr == nil {
		werr = tmp.Chmod(mode)
	}
	if werr == nil {
		werr = tmp.Sync()
	}
	if cerr := tmp.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return fmt.Errorf("audit: write %s: %w", path, werr)
	}
	if err := os.Link(tmp.Name(), path); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("audit: create %s: %w", path, err)
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("audit: sync dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("audit: sync dir %s: %w", dir, err)
	}
	return nil
}
