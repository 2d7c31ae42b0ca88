package agent_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/podca"
)

// podAgent is an agent in pod mode on loopback, enrolled or not.
type podAgent struct {
	ca      *podca.CA
	addr    string
	workDir string
	csr     *x509.CertificateRequest
	client  *tls.Certificate
}

func newCA(t *testing.T) *podca.CA {
	t.Helper()
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	ca, err := podca.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// lockedBuffer is the agent's stdout: written by Serve's goroutine.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func startPodAgent(t *testing.T) *podAgent {
	t.Helper()
	ca := newCA(t)
	dir := t.TempDir()
	work := filepath.Join(dir, "work")
	if err := os.Mkdir(work, 0o700); err != nil {
		t.Fatal(err)
	}
	var out lockedBuffer
	p, ln, err := agent.StartPod("127.0.0.1:0", ca.CertPEM(), &out)
	if err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(&out.b).ReadString('\n')
	csr, err := podca.ParseCSRLine(line)
	if err != nil {
		t.Fatalf("first line %q: %v", line, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- agent.Serve(ctx, agent.Options{Listener: ln, Pod: p, Language: agent.LangBash, WorkDir: work,
			TmpDir: dir, Sweep: agent.SweepDescendants, NoZygote: true, Log: io.Discard})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	client, err := ca.ClientCert(time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return &podAgent{ca: ca, addr: ln.Addr().String(), workDir: work, csr: csr, client: client}
}

func (a *podAgent) clientTLS(cert *tls.Certificate) *tls.Config {
	cfg := &tls.Config{RootCAs: a.ca.Pool(), ServerName: agent.PodServerName("ns", "pod-1"), MinVersion: tls.VersionTLS13}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	return cfg
}

func (a *podAgent) enroll(t *testing.T) *agent.PodClient {
	t.Helper()
	chain, err := a.ca.IssuePod(a.csr, "ns", "pod-1", "uid-1", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := agent.Enroll(ctx, a.addr, a.clientTLS(a.client), a.csr.PublicKey, chain); err != nil {
		t.Fatalf("Enroll: %v", err)
	}
	return &agent.PodClient{Addr: a.addr, TLS: a.clientTLS(a.client)}
}

func run(ctx context.Context, p *agent.PodClient, code string) (agent.Response, error) {
	return agent.RunVia(ctx, p.Dial, agent.Request{Language: agent.LangBash, Code: code, TimeoutMS: 10_000})
}

// The agent serves only the broker, over mutual TLS with a certificate
// for its own key from the broker CA; before enrolment nothing verifies.
func TestPodModeMutualTLS(t *testing.T) {
	a := startPodAgent(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	verified := &agent.PodClient{Addr: a.addr, TLS: a.clientTLS(a.client)}
	if _, err := run(ctx, verified, "echo hi"); err == nil {
		t.Fatal("a run verified the agent's self-signed enrolment certificate")
	}

	// Enrolment pins the key the agent published: another key is refused.
	other := startPodAgent(t)
	chain, err := a.ca.IssuePod(a.csr, "ns", "pod-1", "uid-1", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := agent.Enroll(ctx, a.addr, a.clientTLS(a.client), other.csr.PublicKey, chain); err == nil {
		t.Fatal("Enroll accepted a server whose key is not the pinned one")
	}
	// A certificate for another key is refused by the agent.
	otherChain, err := a.ca.IssuePod(other.csr, "ns", "pod-1", "uid-1", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := agent.Enroll(ctx, a.addr, a.clientTLS(a.client), a.csr.PublicKey, otherChain); err == nil || !strings.Contains(err.Error(), "not for this agent's key") {
		t.Fatalf("installing a certificate for another key: %v", err)
	}

	p := a.enroll(t)
	resp, err := run(ctx, p, "echo hi")
	if err != nil || string(resp.Stdout) != "hi\n" {
		t.Fatalf("run after enrolment: %+v, %v", resp, err)
	}
	// The wrong name fails verification, as for another pod's agent.
	wrong := a.clientTLS(a.client)
	wrong.ServerName = agent.PodServerName("ns", "pod-2")
	if _, err := run(ctx, &agent.PodClient{Addr: a.addr, TLS: wrong}, "echo hi"); err == nil {
		t.Fatal("the agent's certificate verified for another pod's name")
	}

	// Clients: none, another CA's, and a pod's own certificate (server
	// authentication only) are all refused.
	stranger, err := newCA(t).ClientCert(time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	podKeyCert := podCertificate(t, a.ca)
	for name, cert := range map[string]*tls.Certificate{"no certificate": nil, "another CA": stranger, "a pod certificate": podKeyCert} {
		resp, err := run(ctx, &agent.PodClient{Addr: a.addr, TLS: a.clientTLS(cert)}, "echo hi")
		if err == nil {
			t.Errorf("%s: the agent ran code: %+v", name, resp)
		}
	}
}

// podCertificate is a pod's server certificate with its key, as a
// compromised pod would hold it.
func podCertificate(t *testing.T, ca *podca.CA) *tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := podca.ParseCSRLine(agent.CSRPrefix + base64.StdEncoding.EncodeToString(der))
	if err != nil {
		t.Fatal(err)
	}
	chain, err := ca.IssuePod(csr, "ns", "pod-9", "uid-9", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(chain)
	return &tls.Certificate{Certificate: [][]byte{block.Bytes}, PrivateKey: key}
}

// Files go both ways through os.Root on the agent's side; the broker's
// side validates what comes back.
func TestPodModeFiles(t *testing.T) {
	a := startPodAgent(t)
	p := a.enroll(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src := map[string]string{"a.txt": "alpha", "dir/sub/b.txt": "bravo"}
	open := func(path string) (io.ReadCloser, int64, error) {
		return io.NopCloser(strings.NewReader(src[path])), int64(len(src[path])), nil
	}
	files, err := p.Put(ctx, []string{"a.txt", "dir/sub/b.txt"}, nil, open)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || files[0].Path != "a.txt" || files[1].Path != "dir/sub/b.txt" || files[1].Size != 5 {
		t.Fatalf("manifest after put: %+v", files)
	}
	if b, _ := os.ReadFile(filepath.Join(a.workDir, "dir/sub/b.txt")); string(b) != "bravo" {
		t.Fatalf("file in the pod workspace: %q", b)
	}
	// A symlink out of the workspace is neither listed nor sent.
	if err := os.Symlink("/etc/passwd", filepath.Join(a.workDir, "link")); err != nil {
		t.Fatal(err)
	}
	if _, err := run(ctx, p, "printf charlie > c.txt"); err != nil {
		t.Fatal(err)
	}
	files, err = p.Manifest(ctx)
	if err != nil || len(files) != 3 || files[1].Path != "c.txt" {
		t.Fatalf("manifest: %+v, %v", files, err)
	}
	got := map[string]string{}
	err = p.Get(ctx, []string{"a.txt", "c.txt", "link", "missing"}, 1<<20, func(path string, size int64, r io.Reader) error {
		b, err := io.ReadAll(r)
		got[path] = string(b)
		return err
	})
	if err != nil || len(got) != 2 || got["a.txt"] != "alpha" || got["c.txt"] != "charlie" {
		t.Fatalf("get: %v, %v", got, err)
	}
	// A file larger than the caller's cap is an error, not a truncation.
	if err := p.Get(ctx, []string{"c.txt"}, 3, func(string, int64, io.Reader) error { return nil }); err == nil {
		t.Fatal("get accepted a file over its cap")
	}
	// Remove, and paths that try to leave the workspace.
	if files, err = p.Put(ctx, nil, []string{"a.txt"}, open); err != nil || len(files) != 2 {
		t.Fatalf("remove: %+v, %v", files, err)
	}
	for _, bad := range []string{"../escape.txt", "/abs.txt", "link/x"} {
		src[bad] = "x"
		if _, err := p.Put(ctx, []string{bad}, nil, open); err == nil {
			t.Errorf("put %q was accepted", bad)
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(a.workDir), "escape.txt")); err == nil {
		t.Fatal("a put wrote outside the workspace")
	}
}

// A job's egress rides on tunnels the broker opens to the agent: the pod
// itself opens no connection.
func TestPodModeEgressTunnel(t *testing.T) {
	a := startPodAgent(t)
	p := a.enroll(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	token := strings.Repeat("ab", 8)
	var out lockedBuffer
	job, err := agent.StartJobVia(ctx, p.Dial, agent.JobRequest{
		Command:      `p=${HTTP_PROXY##*:}; exec 3<>/dev/tcp/127.0.0.1/$p; echo ping >&3; read -r line <&3; echo "got:$line"`,
		TimeoutMS:    20_000,
		EgressTunnel: token,
	}, func(stream string, d []byte) { _, _ = out.Write(d) })
	if err != nil {
		t.Fatal(err)
	}
	conn, err := p.Tunnel(ctx, token)
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || line != "ping\n" {
		t.Fatalf("tunnel read %q, %v", line, err)
	}
	if _, err := conn.Write([]byte("pong\n")); err != nil {
		t.Fatal(err)
	}
	<-job.Done()
	conn.Close()
	if ex := job.Exit(); ex.ExitCode != 0 || ex.Err != nil {
		t.Fatalf("job exit %+v", ex)
	}
	out.mu.Lock()
	got := out.b.String()
	out.mu.Unlock()
	if got != "got:pong\n" {
		t.Fatalf("job output %q", got)
	}
	// A tunnel for a token no job holds is refused at once.
	if _, err := p.Tunnel(ctx, strings.Repeat("cd", 8)); err == nil {
		t.Fatal("a tunnel for an unknown job was accepted")
	}
	// A job without pod mode's token format is refused.
	if _, err := agent.StartJobVia(ctx, p.Dial, agent.JobRequest{Command: "true", EgressTunnel: "x"}, nil); err == nil {
		t.Fatal("a job with a malformed tunnel token started")
	}
}
