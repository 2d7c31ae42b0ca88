// Package podca is the broker's certificate authority for Kubernetes
// sandbox pods: it issues each pod's agent a server certificate for the key
// the agent made itself, and the broker a client certificate, so that both
// ends of every connection over the pod network are authenticated (mutual
// TLS, see services/agent/pod.go).
//
// The CA is derived from a secret: its Ed25519 key comes from HKDF of the
// secret, and its self-signed certificate has fixed fields, so every
// broker replica given the same secret has the same CA, and nothing but the
// secret needs keeping.
package podca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// MinSecretBytes is the shortest secret a CA is derived from.
const MinSecretBytes = 32

const hkdfInfo = "sandbox-broker pod CA v1"

// CA issues the certificates. It is safe for concurrent use.
type CA struct {
	key  ed25519.PrivateKey
	cert *x509.Certificate
	pem  []byte
}

// New derives the CA from secret.
func New(secret []byte) (*CA, error) {
	if len(secret) < MinSecretBytes {
		return nil, fmt.Errorf("podca: secret of %d bytes, want at least %d", len(secret), MinSecretBytes)
	}
	seed, err := hkdf.Key(sha256.New, secret, nil, hkdfInfo, ed25519.SeedSize)
	if err != nil {
		return nil, err
	}
	key := ed25519.NewKeyFromSeed(seed)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "sandbox-broker pod CA"},
		NotBefore:             time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC),
		NotAfter:              time.Date(2125, 1, 1, 0, 0, 0, 0, time.UTC),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	// Ed25519 signs deterministically: the same secret, the same DER.
	der, err := x509.CreateCertificate(nil, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{key: key, cert: cert, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// CertPEM is the CA certificate the agents trust.
func (c *CA) CertPEM() []byte { return c.pem }

// Pool holds the CA certificate, for verifying pods.
func (c *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(c.cert)
	return p
}

// ClientCert issues the broker a client certificate (a fresh P-256 key)
// naming agent.BrokerIdentity, valid for validity.
func (c *CA) ClientCert(validity time.Duration) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(agent.BrokerIdentity)
	if err != nil {
		return nil, err
	}
	der, err := c.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "sandbox-broker"},
		URIs:        []*url.URL{u},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, key.Public(), validity)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// ParseCSRLine parses an agent's first line of output (agent.CSRPrefix and
// a base64 DER request) and checks the request's signature; it returns the
// request's public key, which must be ECDSA P-256 or Ed25519.
func ParseCSRLine(line string) (*x509.CertificateRequest, error) {
	b64, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), agent.CSRPrefix)
	if !ok {
		return nil, errors.New("podca: not a certificate request line")
	}
	der, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return nil, fmt.Errorf("podca: certificate request: %w", err)
	}
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return nil, fmt.Errorf("podca: certificate request: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("podca: certificate request signature: %w", err)
	}
	switch k := csr.PublicKey.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() {
			return nil, errors.New("podca: certificate request key is not P-256")
		}
	case ed25519.PublicKey:
	default:
		return nil, errors.New("podca: certificate request key type not accepted")
	}
	return csr, nil
}

// IssuePod issues the server certificate of the agent in pod (uid) of
// namespace for the key in csr: DNS name agent.PodServerName, server
// authentication only (a pod's certificate cannot act as the broker). It
// returns the chain as PEM.
func (c *CA) IssuePod(csr *x509.CertificateRequest, namespace, pod, uid string, validity time.Duration) ([]byte, error) {
	u := &url.URL{Scheme: "spiffe", Host: "sandbox-broker", Path: "/ns/" + namespace + "/pod/" + pod + "/" + uid}
	der, err := c.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: pod},
		DNSNames:    []string{agent.PodServerName(namespace, pod)},
		URIs:        []*url.URL{u},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, csr.PublicKey, validity)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), nil
}

func (c *CA) issue(tmpl *x509.Certificate, pub crypto.PublicKey, validity time.Duration) ([]byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl.SerialNumber = serial
	tmpl.NotBefore = now.Add(-5 * time.Minute) // clock skew between nodes
	tmpl.NotAfter = now.Add(validity)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.BasicConstraintsValid = true
	return x509.CreateCertificate(rand.Reader, tmpl, c.cert, pub, c.key)
}
