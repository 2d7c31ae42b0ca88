package files

import (
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// MinMasterBytes is the minimum length of a master secret.
const MinMasterBytes = 32

// hkdfInfo separates signed-URL keys from anything else derived from the
// same master.
const hkdfInfo = "sandbox-broker signed-url v1"

// Key is one master secret with an optional explicit kid. An empty KID is
// derived: the first 8 hex digits of SHA-256 of the derived key.
type Key struct {
	KID    string
	Master []byte
}

// Keyring holds the active signing key and every accepted key, by kid.
// Rotation: put the new master first and the old one in previous, keep the
// old one for at least Signer.MaxTTL, then drop it. It is immutable after
// construction and safe for concurrent use.
type Keyring struct {
	active string
	keys   map[string][]byte
}

// NewKeyring derives keys from masters (each at least MinMasterBytes) with
// derived kids; active signs, active and previous verify.
func NewKeyring(active []byte, previous ...[]byte) (*Keyring, error) {
	prev := make([]Key, len(previous))
	for i, p := range previous {
		prev[i] = Key{Master: p}
	}
	return NewKeyringKeys(Key{Master: active}, prev...)
}

// NewKeyringKeys is NewKeyring with explicit kids where KID is set. A kid
// is 1 to 32 characters of [A-Za-z0-9_-]; two different keys with the same
// kid are an error.
func NewKeyringKeys(active Key, previous ...Key) (*Keyring, error) {
	k := &Keyring{keys: make(map[string][]byte)}
	for i, key := range append([]Key{active}, previous...) {
		if len(key.Master) < MinMasterBytes {
			return nil, fmt.Errorf("files: master secret %d is shorter than %d bytes", i, MinMasterBytes)
		}
		derived, err := hkdf.Key(sha256.New, key.Master, nil, hkdfInfo, sha256.Size)
		if err != nil {
			return nil, fmt.Errorf("files: deriving key: %w", err)
		}
		kid := key.KID
		if kid == "" {
			sum := sha256.Sum256(derived)
			kid = hex.EncodeToString(sum[:4])
		} else if !validKID(kid) {
			return nil, fmt.Errorf("files: invalid kid %q", kid)
		}
		if old, ok := k.keys[kid]; ok {
			if string(old) != string(derived) {
				return nil, fmt.Errorf("files: two different keys share kid %q", kid)
			}
		} else {
			k.keys[kid] = derived
		}
		if i == 0 {
			k.active = kid
		}
	}
	return k, nil
}

// ActiveKID is the kid new URLs are signed with.
func (k *Keyring) ActiveKID() string { return k.active }

// Accepts reports whether kid verifies.
func (k *Keyring) Accepts(kid string) bool {
	_, ok := k.keys[kid]
	return ok
}

func (k *Keyring) key(kid string) ([]byte, bool) {
	b, ok := k.keys[kid]
	return b, ok
}

func validKID(s string) bool {
	if len(s) == 0 || len(s) > 32 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// secretFile is where LoadOrCreateSecret keeps the master, under dir.
const secretFile = "keys/file_secret"

// LoadOrCreateSecret returns the signed links' master secret (see
// LoadOrCreateKey), kept in <dir>/keys/file_secret.
func LoadOrCreateSecret(dir string) ([]byte, error) {
	return LoadOrCreateKey(dir, filepath.Base(secretFile))
}

// LoadOrCreateKey returns the secret kept in <dir>/keys/<key>, creating it
// (32 bytes from crypto/rand, mode 0600, directory 0700) if it does not
// exist: a secret the operator did not set (FILE_SECRET,
// SANDBOX_K8S_CA_SECRET). An existing file must be a regular file (not a
// symlink), not readable or writable by group or others, and hold at least
// MinMasterBytes bytes. Concurrent callers agree on one secret: the file
// appears complete or not at all (link(2) of a fully written temporary
// file).
func LoadOrCreateKey(dir, key string) ([]byte, error) {
	kdir := filepath.Join(dir, filepath.Dir(secretFile))
	if err := os.MkdirAll(kdir, 0o700); err != nil {
		return nil, fmt.Errorf("files: creating key directory: %w", err)
	}
	name := filepath.Join(kdir, key)
	if b, err := readSecret(name); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return b, err
	}
	secret := make([]byte, MinMasterBytes)
	if _, err := rand.Read(secret); err != nil {
		return nil, fmt.Errorf("files: generating secret: %w", err)
	}
	tmp, err := os.CreateTemp(kdir, "."+key+"-*")
	if err != nil {
		return nil, fmt.Errorf("files: writing secret: %w", err)
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.Write(secret)
	if err == nil {
		err = tmp.Chmod(0o600)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("files: writing secret: %w", err)
	}
	if err := os.Link(tmp.Name(), name); err != nil {
		if errors.Is(err, fs.ErrExist) { // another process won
			return readSecret(name)
		}
		return nil, fmt.Errorf("files: writing secret: %w", err)
	}
	return secret, nil
}

func readSecret(name string) ([]byte, error) {
	f, err := os.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("files: %s is not a regular file", name)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("files: %s is accessible by group or others (mode %v); chmod 600 it", name, fi.Mode().Perm())
	}
	b, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return nil, err
	}
	if len(b) < MinMasterBytes {
		return nil, fmt.Errorf("files: %s holds %d bytes, want at least %d", name, len(b), MinMasterBytes)
	}
	return b, nil
}
