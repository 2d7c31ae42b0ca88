package oauth

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"sync"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/lestrrat-go/jwx/v3/jwa"
	"github.com/lestrrat-go/jwx/v3/jwk"
)

// signingAlg is the only algorithm the embedded server signs with and its
// verifier accepts.
const signingAlg = jose.ES256

// signingKey is one ES256 key pair kept in the key directory.
type signingKey struct {
	id      string
	created time.Time
	priv    *ecdsa.PrivateKey
}

func (k *signingKey) SignatureAlgorithm() jose.SignatureAlgorithm { return signingAlg }
func (k *signingKey) Key() any                                    { return k.priv }
func (k *signingKey) ID() string                                  { return k.id }

// publicKey is a signing key as published in the JWKS.
type publicKey struct{ k *signingKey }

func (p publicKey) ID() string                         { return p.k.id }
func (p publicKey) Algorithm() jose.SignatureAlgorithm { return signingAlg }
func (p publicKey) Use() string                        { return "sig" }
func (p publicKey) Key() any                           { return &p.k.priv.PublicKey }

func (p publicKey) jwk() jose.JSONWebKey {
	return jose.JSONWebKey{Key: p.Key(), KeyID: p.ID(), Algorithm: string(signingAlg), Use: "sig"}
}

// String keeps the private key out of any %v.
func (k *signingKey) String() string   { return "oauth signing key " + k.id }
func (k *signingKey) GoString() string { return k.String() }
func (k *signingKey) fileName() string { return fmt.Sprintf("%d-%s.pem", k.created.Unix(), k.id) }

var keyFile = regexp.MustCompile(`^([0-9]{1,12})-([0-9a-f]{32})\.pem$`)

// Keys is the embedded server's signing keys, persisted as PEM files (mode
// 0600) in one directory. The newest signs; older ones still verify until
// the tokens they signed have expired, then they are deleted.
type Keys struct {
	dir    string
	maxAge time.Duration // rotate when the signing key is older
	retain time.Duration // keep a replaced key this long (access-token lifetime)
	now    func() time.Time

	mu   sync.RWMutex
	keys []*signingKey // oldest first
	jwks jwk.Set       // public keys for the verifier, rebuilt on change
}

// OpenKeys loads the keys in dir (created 0700 if missing), creating the
// first one when there is none.
func OpenKeys(dir string, maxAge, retain time.Duration, now func() time.Time) (*Keys, error) {
	if now == nil {
		now = time.Now
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("oauth keys: %w", err)
	}
	k := &Keys{dir: dir, maxAge: maxAge, retain: retain, now: now}
	if err := k.load(); err != nil {
		return nil, err
	}
	if len(k.keys) == 0 {
		if err := k.Rotate(); err != nil {
			return nil, err
		}
	}
	return k, nil
}

func (k *Keys) load() error {
	entries, err := os.ReadDir(k.dir)
	if err != nil {
		return fmt.Errorf("oauth keys: %w", err)
	}
	var keys []*signingKey
	for _, e := range entries {
		m := keyFile.FindStringSubmatch(e.Name())
		if m == nil || !e.Type().IsRegular() {
			continue
		}
		sec, _ := strconv.ParseInt(m[1], 10, 64)
		raw, err := os.ReadFile(filepath.Join(k.dir, e.Name()))
		if err != nil {
			return fmt.Errorf("oauth keys: %w", err)
		}
		block, _ := pem.Decode(raw)
		if block == nil || block.Type != "PRIVATE KEY" {
			return fmt.Errorf("oauth keys: %s is not a PEM private key", e.Name())
		}
		parsed, err := x509.ParsePKCS8PrivateKey(block.Bytes)
		priv, ok := parsed.(*ecdsa.PrivateKey)
		if err != nil || !ok || priv.Curve != elliptic.P256() {
			return fmt.Errorf("oauth keys: %s is not a P-256 key", e.Name())
		}
		keys = append(keys, &signingKey{id: m[2], created: time.Unix(sec, 0), priv: priv})
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].created.Before(keys[j].created) })
	k.mu.Lock()
	defer k.mu.Unlock()
	k.keys = keys
	return k.rebuildLocked()
}

// rebuildLocked refreshes the verifier's key set after a change.
func (k *Keys) rebuildLocked() error {
	set := jwk.NewSet()
	for _, key := range k.keys {
		pub, err := jwk.Import(&key.priv.PublicKey)
		if err != nil {
			return fmt.Errorf("oauth keys: %w", err)
		}
		if err := errors.Join(pub.Set(jwk.KeyIDKey, key.id), pub.Set(jwk.AlgorithmKey, jwa.ES256()), set.AddKey(pub)); err != nil {
			return fmt.Errorf("oauth keys: %w", err)
		}
	}
	k.jwks = set
	return nil
}

// set is the public key set the verifier checks signatures with.
func (k *Keys) set() (jwk.Set, error) {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return k.jwks, nil
}

// Rotate makes a new signing key. Tokens signed by older keys stay valid
// until they expire.
func (k *Keys) Rotate() error {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return err
	}
	var id [16]byte
	if _, err := rand.Read(id[:]); err != nil {
		return err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	created := k.now().Truncate(time.Second)
	if n := len(k.keys); n > 0 && !created.After(k.keys[n-1].created) {
		created = k.keys[n-1].created.Add(time.Second) // keep file order = age order
	}
	key := &signingKey{id: hex.EncodeToString(id[:]), created: created, priv: priv}
	path := filepath.Join(k.dir, key.fileName())
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("oauth keys: %w", err)
	}
	werr := pem.Encode(f, &pem.Block{Type: "PRIVATE KEY", Bytes: der})
	if err := errors.Join(werr, f.Sync(), f.Close()); err != nil {
		os.Remove(path)
		return fmt.Errorf("oauth keys: write: %w", err)
	}
	k.keys = append(k.keys, key)
	return k.rebuildLocked()
}

// Maintain rotates a signing key older than maxAge and deletes replaced
// keys once everything they signed has expired.
func (k *Keys) Maintain() error {
	if s := k.signer(); k.now().Sub(s.created) >= k.maxAge {
		if err := k.Rotate(); err != nil {
			return err
		}
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	cutoff := k.now().Add(-k.retain)
	keep := k.keys[:0:0]
	var errs []error
	for i, key := range k.keys {
		// A key is retired when the next one was made; it may go once that
		// happened longer ago than an access token lives.
		if i+1 < len(k.keys) && k.keys[i+1].created.Before(cutoff) {
			if err := os.Remove(filepath.Join(k.dir, key.fileName())); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
				keep = append(keep, key)
			}
			continue
		}
		keep = append(keep, key)
	}
	k.keys = keep
	return errors.Join(append(errs, k.rebuildLocked())...)
}

func (k *Keys) signer() *signingKey {
	k.mu.RLock()
	defer k.mu.RUnlock()
	return k.keys[len(k.keys)-1]
}

// public lists every key that still verifies.
func (k *Keys) public() []publicKey {
	k.mu.RLock()
	defer k.mu.RUnlock()
	out := make([]publicKey, 0, len(k.keys))
	for _, key := range k.keys {
		out = append(out, publicKey{key})
	}
	return out
}

// JWKS is the public key set.
func (k *Keys) JWKS() jose.JSONWebKeySet {
	var set jose.JSONWebKeySet
	for _, p := range k.public() {
		set.Keys = append(set.Keys, p.jwk())
	}
	return set
}
