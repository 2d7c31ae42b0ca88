package audit

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoadKeysCreatesAndReloads(t *testing.T) {
	root := t.TempDir()
	cfg := KeyConfig{Root: root}
	k1, err := LoadKeys(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(k1.HMACKey) != 32 || len(k1.KeyID) != 8 || k1.Signer == nil || k1.Verifier == nil {
		t.Fatalf("keys: kid %q len %d", k1.KeyID, len(k1.HMACKey))
	}
	if k1.Signer.Name() != KeyName || k1.Verifier.Name() != KeyName {
		t.Errorf("key names %q %q", k1.Signer.Name(), k1.Verifier.Name())
	}
	modes := map[string]os.FileMode{"keys": 0o700, "keys/audit_hmac.key": 0o600, "keys/audit_checkpoint.key": 0o600, "keys/audit_checkpoint.pub": 0o644}
	for p, want := range modes {
		st, err := os.Stat(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != want {
			t.Errorf("%s: mode %o, want %o", p, st.Mode().Perm(), want)
		}
	}
	k2, err := LoadKeys(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(k1.HMACKey, k2.HMACKey) || k1.KeyID != k2.KeyID || k1.Signer.KeyHash() != k2.Signer.KeyHash() {
		t.Fatal("reload produced different keys")
	}
	v, err := LoadVerifyKeys(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(v.HMACKey, k1.HMACKey) || v.Signer != nil || v.Verifier.KeyHash() != k1.Verifier.KeyHash() {
		t.Fatal("LoadVerifyKeys mismatch")
	}
}

func TestLoadKeysFromEnv(t *testing.T) {
	raw := make([]byte, 48)
	if _, err := rand.Read(raw); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{hex.EncodeToString(raw), base64.StdEncoding.EncodeToString(raw), base64.RawURLEncoding.EncodeToString(raw)} {
		root := t.TempDir()
		k, err := LoadKeys(KeyConfig{Root: root, HMACKey: s})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(k.HMACKey, raw) {
			t.Fatalf("decoded key differs for %d-char input", len(s))
		}
		if _, err := os.Stat(filepath.Join(root, "keys", "audit_hmac.key")); !os.IsNotExist(err) {
			t.Errorf("HMAC key file created although the env key was given: %v", err)
		}
	}
}

func TestHMACKeyErrorsHideMaterial(t *testing.T) {
	secret := "c2VjcmV0LXNob3J0LWtleQ" // base64 of a 16-byte key
	_, err := LoadKeys(KeyConfig{Root: t.TempDir(), HMACKey: secret})
	if err == nil || strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "secret-short-key") {
		t.Fatalf("err = %v", err)
	}
	bad := "zz-not-a-key-zz!"
	_, err = LoadKeys(KeyConfig{Root: t.TempDir(), HMACKey: bad})
	if err == nil || strings.Contains(err.Error(), bad) {
		t.Fatalf("err = %v", err)
	}
	// A short key file is rejected without echoing it.
	root := t.TempDir()
	p := filepath.Join(root, "short.key")
	if err := os.WriteFile(p, []byte("abcdef0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = LoadKeys(KeyConfig{Root: root, HMACKeyFile: p})
	if err == nil || strings.Contains(err.Error(), "abcdef0123") {
		t.Fatalf("err = %v", err)
	}
}

func TestRawHMACKeyFile(t *testing.T) {
	root := t.TempDir()
	p := filepath.Join(root, "raw.key")
	raw := append([]byte{0xff, 0x00}, bytes.Repeat([]byte{0x80}, 30)...)
	if err := os.WriteFile(p, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := LoadKeys(KeyConfig{Root: root, HMACKeyFile: p})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(k.HMACKey, raw) {
		t.Fatal("raw key not used as-is")
	}
}

func TestLoadVerifyKeysNeverCreates(t *testing.T) {
	root := t.TempDir()
	if _, err := LoadVerifyKeys(KeyConfig{Root: root}); err == nil {
		t.Fatal("LoadVerifyKeys succeeded without keys")
	}
	if _, err := os.Stat(filepath.Join(root, "keys")); !os.IsNotExist(err) {
		t.Fatalf("LoadVerifyKeys created files: %v", err)
	}
	if _, err := LoadVerifyKeys(KeyConfig{}); err == nil {
		t.Fatal("LoadVerifyKeys succeeded with no root and no paths")
	}
}

func TestLoadKeysRefusesOrphanedVerifier(t *testing.T) {
	root := t.TempDir()
	if _, err := LoadKeys(KeyConfig{Root: root}); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, "keys", "audit_checkpoint.key")); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadKeys(KeyConfig{Root: root}); err == nil {
		t.Fatal("LoadKeys replaced a signing key whose verifier key is still present")
	}
}

func TestLoadKeysRederivesVerifier(t *testing.T) {
	root := t.TempDir()
	k1, err := LoadKeys(KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	pub := filepath.Join(root, "keys", "audit_checkpoint.pub")
	want, err := os.ReadFile(pub)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(pub); err != nil {
		t.Fatal(err)
	}
	k2, err := LoadKeys(KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(pub)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) || k2.Verifier.KeyHash() != k1.Verifier.KeyHash() {
		t.Fatalf("re-derived verifier key %q, want %q", got, want)
	}
}

func TestLoadKeysRejectsMismatchedPair(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	if _, err := LoadKeys(KeyConfig{Root: a}); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadKeys(KeyConfig{Root: b}); err != nil {
		t.Fatal(err)
	}
	_, err := LoadKeys(KeyConfig{Root: a, VerifierKeyFile: filepath.Join(b, "keys", "audit_checkpoint.pub")})
	if err == nil || !strings.Contains(err.Error(), "does not match") {
		t.Fatalf("err = %v", err)
	}
}
