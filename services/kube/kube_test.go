package kube

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// sessionPod is the session's pod object for lang.
func sessionPod(t *testing.T, c *testCluster, s *Session, lang string) *corev1.Pod {
	t.Helper()
	s.mu.Lock()
	p := s.pods[lang]
	s.mu.Unlock()
	if p == nil {
		t.Fatalf("the session has no %s pod", lang)
	}
	obj, err := c.cs.CoreV1().Pods(c.ns).Get(context.Background(), p.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return obj
}

// A sandbox pod is hardened through its spec (and admitted by a namespace
// that enforces the restricted Pod Security Standard), and the process
// inside sees it so.
func TestPodHardening(t *testing.T) {
	c := needCluster(t)
	b := newBackend(t, c, c.options(t))
	s := openSession(t, b)
	res := run(t, s, "bash", `id -u; id -g; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status
touch /probe 2>/dev/null && echo root-writable || echo root-read-only
ls /var/run/secrets/kubernetes.io 2>/dev/null && echo token || echo no-token
ulimit -n; ulimit -f; ulimit -c
cat /etc/resolv.conf | grep nameserver`)
	out := string(res.Stdout)
	for _, want := range []string{"65532\n65532\n", "CapEff:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2",
		"root-read-only", "no-token", "\n1024\n262144\n0\n", "nameserver 127.0.0.1"} {
		if !strings.Contains(out, want) {
			t.Errorf("in the pod: missing %q in\n%s%s", want, out, res.Stderr)
		}
	}
	p := sessionPod(t, c, s, "bash")
	sp := p.Spec
	if sp.AutomountServiceAccountToken == nil || *sp.AutomountServiceAccountToken || sp.HostNetwork || sp.HostPID || sp.HostIPC {
		t.Errorf("pod spec: token %v, host namespaces %v %v %v", sp.AutomountServiceAccountToken, sp.HostNetwork, sp.HostPID, sp.HostIPC)
	}
	if sc := sp.SecurityContext; sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod security context %+v", sc)
	}
	for _, ctr := range append(sp.InitContainers, sp.Containers...) {
		sc := ctr.SecurityContext
		if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil ||
			!*sc.ReadOnlyRootFilesystem || sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" {
			t.Errorf("container %s security context %+v", ctr.Name, sc)
		}
		if ctr.Resources.Limits.Memory().IsZero() || ctr.Resources.Limits.Cpu().IsZero() {
			t.Errorf("container %s has no limits: %+v", ctr.Name, ctr.Resources.Limits)
		}
	}
	for _, v := range sp.Volumes {
		if v.HostPath != nil || v.EmptyDir == nil || v.EmptyDir.SizeLimit == nil {
			t.Errorf("volume %s: %+v", v.Name, v.VolumeSource)
		}
	}
}

// Files go both ways between the broker's copy and the pods, across
// languages, with os.Root-confined paths on both sides.
func TestWorkspaceSync(t *testing.T) {
	c := needCluster(t)
	b := newBackend(t, c, c.options(t))
	s := openSession(t, b)
	ctx := context.Background()
	if err := s.WriteFile(ctx, "in/data.csv", []byte("a,b\n1,2\n"), false); err != nil {
		t.Fatal(err)
	}
	res := run(t, s, "python", `import os, csv
rows = list(csv.reader(open("in/data.csv")))
os.makedirs("out", exist_ok=True)
open("out/sum.txt", "w").write(str(sum(int(x) for x in rows[1])))
os.remove("in/data.csv")
print(len(rows))`)
	if string(res.Stdout) != "2\n" || len(res.Changed) != 1 || res.Changed[0].Path != "out/sum.txt" {
		t.Fatalf("python run: %q %q changed %+v", res.Stdout, res.Stderr, res.Changed)
	}
	f, err := s.ReadFile(ctx, "out/sum.txt", 0, 100)
	if err != nil || string(f.Data) != "3" {
		t.Fatalf("broker's copy of out/sum.txt: %q, %v", f.Data, err)
	}
	if _, err := s.ReadFile(ctx, "in/data.csv", 0, 100); brokererr.CodeOf(err) != brokererr.FileNotFound {
		t.Fatalf("a file the run removed is still on the broker's side: %v", err)
	}
	// Another language's pod gets the same files.
	res = run(t, s, "bash", `cat out/sum.txt; ls in 2>/dev/null | wc -l; ln -s /etc/passwd leak; echo hi > out/b.txt`)
	if string(res.Stdout) != "30\n" {
		t.Fatalf("bash pod sees %q %q", res.Stdout, res.Stderr)
	}
	// A symlink made in the pod does not come over (nor does what it points at).
	list, err := s.ListFiles(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range list {
		names = append(names, f.Path)
	}
	if strings.Join(names, ",") != "out/b.txt,out/sum.txt" {
		t.Fatalf("files on the broker's side: %v", names)
	}
	// A write on the broker's side while the pod lives reaches it on the next run.
	if err := s.WriteFile(ctx, "out/sum.txt", []byte("42"), true); err != nil {
		t.Fatal(err)
	}
	if res = run(t, s, "python", `print(open("out/sum.txt").read())`); string(res.Stdout) != "42\n" {
		t.Fatalf("python pod sees %q", res.Stdout)
	}
}

// A run that writes past the quota stores nothing: the broker's copy is as
// before it, and its pod goes.
func TestQuotaExceeded(t *testing.T) {
	c := needCluster(t)
	b := newBackend(t, c, c.options(t))
	s := openSession(t, b)
	run(t, s, "bash", `echo keep > keep.txt`)
	ctx := context.Background()
	_, err := s.Exec(ctx, sandbox.ExecRequest{Language: "bash", Code: `for i in 1 2 3; do head -c 3M /dev/zero > big$i; done`, Timeout: 30 * time.Second})
	if brokererr.CodeOf(err) != brokererr.QuotaExceeded {
		t.Fatalf("over the quota: %v", err)
	}
	list, _ := s.ListFiles(ctx, "")
	if len(list) != 1 || list[0].Path != "keep.txt" {
		t.Fatalf("files after the refused run: %+v", list)
	}
	if res := run(t, s, "bash", `ls`); string(res.Stdout) != "keep.txt\n" {
		t.Fatalf("the next pod holds %q", res.Stdout)
	}
}

// Only the broker can talk to the agent: a connection without a client
// certificate, or with one from another CA, is refused, from outside the
// pod and from code inside it.
func TestAgentRequiresBrokerCertificate(t *testing.T) {
	c := needCluster(t)
	b := newBackend(t, c, c.options(t))
	s := openSession(t, b)
	res := run(t, s, "python", `import socket, ssl
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
try:
    with socket.create_connection(("127.0.0.1", `+strconv.Itoa(agent.PodPort)+`), timeout=5) as raw:
        with ctx.wrap_socket(raw) as tls:
            tls.sendall(b'{"language":"bash","code":"id"}\n')
            print("answer:", tls.recv(100))
except Exception as e:
    print("refused:", type(e).__name__)`)
	if !strings.HasPrefix(string(res.Stdout), "refused:") {
		t.Fatalf("code in the pod reached its agent: %q %q", res.Stdout, res.Stderr)
	}
	addr := net.JoinHostPort(sessionPod(t, c, s, "python").Status.PodIP, strconv.Itoa(agent.PodPort))
	other := c.options(t).CA // another broker's CA
	foreign, err := other.ClientCert(time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for name, certs := range map[string][]tls.Certificate{"no certificate": nil, "another CA's": {*foreign}} {
		cfg := b.tls.Clone()
		cfg.GetClientCertificate = nil
		cfg.Certificates = certs
		cfg.ServerName = agent.PodServerName(c.ns, sessionPod(t, c, s, "python").Name)
		p := &agent.PodClient{Addr: addr, TLS: cfg}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := agent.RunVia(ctx, p.Dial, agent.Request{Language: "python", Code: "print(1)"})
		cancel()
		if err == nil {
			t.Errorf("%s: the agent answered %+v", name, resp)
		}
	}
}

// A job's output and files reach the broker while it runs, and its egress
// rides on tunnels the broker opens.
func TestJobFilesAndEgress(t *testing.T) {
	c := needCluster(t)
	b := newBackend(t, c, c.options(t))
	s := openSession(t, b)
	ctx := context.Background()
	served := make(chan string, 1)
	egress := func(ln net.Listener) {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				buf := make([]byte, 64)
				n, _ := conn.Read(buf)
				served <- string(buf[:n])
				_, _ = conn.Write([]byte("pong\n"))
			}()
		}
	}
	var out strings.Builder
	outc := make(chan struct{}, 16)
	j, err := s.StartJob(ctx, sandbox.JobSpec{ID: sandbox.NewID(), Language: "bash", Timeout: 2 * time.Minute, Interactive: true, Egress: egress,
		Command: `echo started > progress.txt; p=${HTTP_PROXY##*:}; exec 3<>/dev/tcp/127.0.0.1/$p; echo ping >&3; read -r l <&3; echo "got:$l"; read -r x; echo done > progress.txt`},
		func(stream string, d []byte) { out.Write(d); outc <- struct{}{} })
	if err != nil {
		t.Fatal(err)
	}
	select {
	case got := <-served:
		if got != "ping\n" {
			t.Fatalf("the broker's end got %q", got)
		}
	case <-time.After(time.Minute):
		t.Fatal("the job's connection never reached the broker")
	}
	<-outc
	// While the job runs, a file call syncs what it wrote.
	f, err := s.ReadFile(ctx, "progress.txt", 0, 100)
	if err != nil || string(f.Data) != "started\n" {
		t.Fatalf("progress.txt while the job runs: %q, %v", f.Data, err)
	}
	if err := s.Release(ctx); brokererr.CodeOf(err) != brokererr.Conflict {
		t.Fatalf("Release with a job running: %v", err)
	}
	if err := j.WriteStdin(ctx, []byte("go\n")); err != nil {
		t.Fatal(err)
	}
	<-j.Done()
	if ex := j.Exit(); ex.ExitCode != 0 || ex.Err != nil || out.String() != "got:pong\n" {
		t.Fatalf("job exit %+v, output %q", ex, out.String())
	}
	if f, err = s.ReadFile(ctx, "progress.txt", 0, 100); err != nil || string(f.Data) != "done\n" {
		t.Fatalf("progress.txt after the job: %q, %v", f.Data, err)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitNoPods(t, c, LabelSession+"="+sessionLabel(s.ref.WorkspaceID))
	if f, err = s.ReadFile(ctx, "progress.txt", 0, 100); err != nil || string(f.Data) != "done\n" {
		t.Fatalf("files after Release: %q, %v", f.Data, err)
	}
}

// The network policy selects every sandbox pod: ingress from the broker to
// the agent's port only, no egress. Where the CNI enforces policies
// (SANDBOX_K8S_TEST_NETPOL=enforced: kind), a pod cannot reach another.
func TestNetworkPolicy(t *testing.T) {
	c := needCluster(t)
	b := newBackend(t, c, c.options(t))
	np, err := c.cs.NetworkingV1().NetworkPolicies(c.ns).Get(context.Background(), NetworkPolicy, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(np.Spec.PolicyTypes) != 2 || len(np.Spec.Egress) != 0 || len(np.Spec.Ingress) != 1 ||
		np.Spec.Ingress[0].From[0].IPBlock == nil || np.Spec.Ingress[0].From[0].IPBlock.CIDR != c.cidr ||
		np.Spec.PodSelector.MatchLabels[LabelRole] != RoleSandbox {
		t.Fatalf("network policy %+v", np.Spec)
	}
	t.Run("enforced", func(t *testing.T) {
		if os.Getenv("SANDBOX_K8S_TEST_NETPOL") != "enforced" {
			t.Skip("this cluster's CNI does not enforce network policies (SANDBOX_K8S_TEST_NETPOL=enforced on kind)")
		}
		s1, s2 := openSession(t, b), openSession(t, b)
		run(t, s2, "bash", "true")
		ip := sessionPod(t, c, s2, "bash").Status.PodIP
		res := run(t, s1, "bash", `timeout 5 bash -c 'exec 3<>/dev/tcp/`+ip+`/`+strconv.Itoa(agent.PodPort)+`' 2>/dev/null && echo open || echo blocked`)
		if string(res.Stdout) != "blocked\n" {
			t.Fatalf("one sandbox pod reached another's agent: %q", res.Stdout)
		}
	})
}
