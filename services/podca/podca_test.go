package podca

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

func secret(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

// Replicas given the same secret have the same CA; another secret, another.
func TestCADerivedFromSecret(t *testing.T) {
	a, err := New(secret(1))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := New(secret(1))
	c, _ := New(secret(2))
	if !bytes.Equal(a.CertPEM(), b.CertPEM()) {
		t.Fatal("the same secret gave two CAs")
	}
	if bytes.Equal(a.CertPEM(), c.CertPEM()) {
		t.Fatal("two secrets gave one CA")
	}
	if _, err := New(make([]byte, 31)); err == nil {
		t.Fatal("a short secret was accepted")
	}
}

func csrLine(t *testing.T, key any) string {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	if err != nil {
		t.Fatal(err)
	}
	return agent.CSRPrefix + base64.StdEncoding.EncodeToString(der) + "\n"
}

// A pod's certificate verifies for its name, for server authentication
// only; the broker's for client authentication with its URI.
func TestIssuedCertificates(t *testing.T) {
	ca, _ := New(secret(1))
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, err := ParseCSRLine(csrLine(t, key))
	if err != nil {
		t.Fatal(err)
	}
	chain, err := ca.IssuePod(csr, "ns", "sbx-1", "uid", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(chain)
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	opts := x509.VerifyOptions{Roots: ca.Pool(), DNSName: agent.PodServerName("ns", "sbx-1"), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	if _, err := leaf.Verify(opts); err != nil {
		t.Fatalf("pod certificate: %v", err)
	}
	opts.DNSName = agent.PodServerName("ns", "sbx-2")
	if _, err := leaf.Verify(opts); err == nil {
		t.Fatal("a pod's certificate verified for another pod")
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Fatal("a pod's certificate is good for client authentication")
	}
	other, _ := New(secret(2))
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: other.Pool(), DNSName: agent.PodServerName("ns", "sbx-1")}); err == nil {
		t.Fatal("another CA verified the pod")
	}
	client, err := ca.ClientCert(time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Leaf.Verify(x509.VerifyOptions{Roots: ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("broker certificate: %v", err)
	}
	if len(client.Leaf.URIs) != 1 || client.Leaf.URIs[0].String() != agent.BrokerIdentity {
		t.Fatalf("broker certificate URIs %v", client.Leaf.URIs)
	}
}

func TestParseCSRLineRefuses(t *testing.T) {
	ec, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	rsaKey, _ := rsa.GenerateKey(rand.Reader, 2048)
	good := csrLine(t, ec)
	der, _ := base64.StdEncoding.DecodeString(strings.TrimSpace(strings.TrimPrefix(good, agent.CSRPrefix)))
	der[len(der)-5] ^= 0xff // the signature
	for name, line := range map[string]string{
		"no prefix":        strings.TrimPrefix(good, agent.CSRPrefix),
		"not base64":       agent.CSRPrefix + "!!!",
		"not a request":    agent.CSRPrefix + base64.StdEncoding.EncodeToString([]byte("hello")),
		"bad signature":    agent.CSRPrefix + base64.StdEncoding.EncodeToString(der),
		"RSA key":          csrLine(t, rsaKey),
		"P-384 key":        csrLine(t, p384),
		"other log output": "panic: something\n",
	} {
		if _, err := ParseCSRLine(line); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := ParseCSRLine(good); err != nil {
		t.Fatalf("good line: %v", err)
	}
}

// FuzzParseCSRLine: whatever a pod prints, parsing never panics, and what
// it accepts has a checked signature over an accepted key.
func FuzzParseCSRLine(f *testing.F) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, _ := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	f.Add(agent.CSRPrefix + base64.StdEncoding.EncodeToString(der))
	f.Add(agent.CSRPrefix + "AAAA")
	f.Add("")
	f.Fuzz(func(t *testing.T, line string) {
		csr, err := ParseCSRLine(line)
		if err != nil {
			return
		}
		if csr.CheckSignature() != nil {
			t.Fatal("accepted a request with a bad signature")
		}
	})
}
