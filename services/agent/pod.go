package agent

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/url"
	"slices"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Pod mode is how the agent runs in a Kubernetes pod (the kubernetes
// backend): no socket directory is shared with the broker, so the agent
// listens on TCP with mutual TLS. Its key is made in the pod and never
// leaves it; the broker reads the certificate request the agent prints as
// its first line of output through the Kubernetes API (pod logs, an
// authenticated channel), issues a certificate from its own CA for that key
// and hands it over on a first connection that pins the key. From then on
// every connection is verified by name against the broker CA, both ways.
const (
	// PodPort is the agent's TLS port in pod mode.
	PodPort = 7443
	// CAEnv holds the broker CA certificate (PEM) the agent trusts for
	// clients.
	CAEnv = "SANDBOX_AGENT_CA"
	// CSRPrefix starts the agent's first line of output: the prefix, then
	// its certificate request, DER in standard base64.
	CSRPrefix = "sandbox-agent-csr "
	// BrokerIdentity is the URI SAN of the broker's client certificate;
	// the agent accepts no other client.
	BrokerIdentity = "spiffe://sandbox-broker/broker"
)

// PodServerName is the DNS name in a pod's certificate, which the broker
// verifies on every connection after enrolment. It is a name, not an
// address: nothing resolves it.
func PodServerName(namespace, pod string) string {
	return pod + "." + namespace + ".pod.sandbox-broker.internal"
}

// PodTLS is the agent's TLS identity in pod mode.
type PodTLS struct {
	key  *ecdsa.PrivateKey
	ca   *x509.CertPool
	cert atomic.Pointer[tls.Certificate]
}

// NewPodTLS makes a fresh key and, until the broker's certificate is
// installed, a self-signed certificate for it (the broker pins the key).
// caPEM is the broker CA, trusted for client certificates only.
func NewPodTLS(caPEM []byte) (*PodTLS, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("agent: no CA certificate in " + CAEnv)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "sandbox-agent (enrolling)"},
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	p := &PodTLS{key: key, ca: pool}
	p.cert.Store(&tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key})
	return p, nil
}

// CSR returns a certificate request for the agent's key, DER-encoded. It
// names nothing: the broker decides the pod's identity.
func (p *PodTLS) CSR() ([]byte, error) {
	return x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: "sandbox-agent"},
	}, p.key)
}

// Listen listens on addr with mutual TLS (1.3 only): the client must show
// a certificate from the broker CA for client authentication that names
// BrokerIdentity.
func (p *PodTLS) Listen(addr string) (net.Listener, error) {
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return p.cert.Load(), nil
		},
		ClientAuth: tls.RequireAndVerifyClientCert,
		ClientCAs:  p.ca,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 || !hasURI(cs.PeerCertificates[0], BrokerIdentity) {
				return errors.New("agent: the client is not the broker")
			}
			return nil
		},
	}
	return tls.Listen("tcp", addr, cfg)
}

func hasURI(c *x509.Certificate, uri string) bool {
	return slices.ContainsFunc(c.URIs, func(u *url.URL) bool { return u.String() == uri })
}

// install replaces the served certificate with the broker's, given as a
// PEM chain whose leaf must be for the agent's own key, valid for server
// authentication and issued by the broker CA.
func (p *PodTLS) install(chainPEM []byte) error {
	var chain [][]byte
	for rest := chainPEM; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type == "CERTIFICATE" {
			chain = append(chain, b.Bytes)
		}
	}
	if len(chain) == 0 {
		return errors.New("no certificate in the request")
	}
	leaf, err := x509.ParseCertificate(chain[0])
	if err != nil {
		return fmt.Errorf("parse certificate: %w", err)
	}
	pub, ok := leaf.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pub.Equal(p.key.Public()) {
		return errors.New("the certificate is not for this agent's key")
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: p.ca, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		return fmt.Errorf("the certificate is not from the broker CA: %w", err)
	}
	p.cert.Store(&tls.Certificate{Certificate: chain, PrivateKey: p.key, Leaf: leaf})
	return nil
}

// StartPod sets up pod mode: the TLS identity, the listener on addr, and
// the certificate request as the first line on out.
func StartPod(addr string, caPEM []byte, out io.Writer) (*PodTLS, net.Listener, error) {
	p, err := NewPodTLS(caPEM)
	if err != nil {
		return nil, nil, err
	}
	csr, err := p.CSR()
	if err != nil {
		return nil, nil, err
	}
	ln, err := p.Listen(addr)
	if err != nil {
		return nil, nil, err
	}
	if _, err := fmt.Fprintf(out, "%s%s\n", CSRPrefix, base64.StdEncoding.EncodeToString(csr)); err != nil {
		ln.Close()
		return nil, nil, err
	}
	return p, ln, nil
}

// SetPodLimits applies the Docker engine's ulimits to the agent, whose
// runs inherit them (pods have no ulimits of their own): 1024 open files,
// 256 MiB per file written, no core dumps. Lowered hard limits cannot be
// raised again without privilege.
func SetPodLimits() error {
	for _, l := range []struct {
		res int
		v   uint64
	}{{unix.RLIMIT_NOFILE, 1024}, {unix.RLIMIT_FSIZE, 256 << 20}, {unix.RLIMIT_CORE, 0}} {
		if err := unix.Setrlimit(l.res, &unix.Rlimit{Cur: l.v, Max: l.v}); err != nil {
			return fmt.Errorf("agent: setrlimit %d: %w", l.res, err)
		}
	}
	return nil
}
