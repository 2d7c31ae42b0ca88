package kube

import (
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// signalConn closes sent once the first write (the run's request) is done.
type signalConn struct {
	net.Conn
	once *sync.Once
	sent chan struct{}
}

func (c signalConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.once.Do(func() { close(c.sent) })
	return n, err
}

// A pod evicted while a run is under way: the run's error says so and is
// retryable, the broker does not run the code again on its own, and the
// next call gets a new pod with the files synced before the run.
func TestPodEvictedMidRun(t *testing.T) {
	c := needCluster(t)
	b := newBackend(t, c, c.options(t))
	s := openSession(t, b)
	run(t, s, "bash", `echo before > before.txt`)
	evicted := sessionPod(t, c, s, "bash")

	sent := make(chan struct{})
	var once sync.Once
	agentConn = func(conn net.Conn, err error) (net.Conn, error) {
		if err != nil {
			return conn, err
		}
		return signalConn{Conn: conn, once: &once, sent: sent}, nil
	}
	t.Cleanup(func() { agentConn = func(c net.Conn, err error) (net.Conn, error) { return c, err } })
	errc := make(chan error, 1)
	go func() {
		_, err := s.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: `echo during > during.txt; sleep 120`, Timeout: 3 * time.Minute})
		errc <- err
	}()
	select {
	case <-sent:
	case err := <-errc:
		t.Fatalf("the run ended before it was sent: %v", err)
	}
	err := c.cs.PolicyV1().Evictions(c.ns).Evict(context.Background(), &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Name: evicted.Name, Namespace: c.ns}})
	if err != nil {
		t.Fatalf("evict: %v", err)
	}
	var be *brokererr.Error
	select {
	case err = <-errc:
	case <-time.After(2 * time.Minute):
		t.Fatal("the run did not end when its pod was evicted")
	}
	if !errors.As(err, &be) || be.Code != brokererr.Unavailable || !be.Retryable || !strings.Contains(be.Message, "went away during the run") || !strings.Contains(be.Message, "evict") {
		t.Fatalf("run on an evicted pod: %#v", err)
	}
	// No second pod ran the code: the session holds none until the next call.
	s.mu.Lock()
	n := len(s.pods)
	s.mu.Unlock()
	list, _ := c.cs.CoreV1().Pods(c.ns).List(context.Background(), metav1.ListOptions{LabelSelector: LabelSession + "=" + sessionLabel(s.ref.WorkspaceID)})
	for _, p := range list.Items {
		if p.Name != evicted.Name {
			t.Fatalf("another pod %s was started after the eviction", p.Name)
		}
	}
	if n != 0 {
		t.Fatalf("the session still holds %d pods", n)
	}
	agentConn = func(c net.Conn, err error) (net.Conn, error) { return c, err }
	res := run(t, s, "bash", `ls`)
	if string(res.Stdout) != "before.txt\n" {
		t.Fatalf("the new pod holds %q", res.Stdout)
	}
}

// apiProxy forwards TCP to the API server and can be taken down.
type apiProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	down   bool
	conns  map[net.Conn]bool
}

func newAPIProxy(t *testing.T, target string) *apiProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &apiProxy{ln: ln, target: target, conns: map[net.Conn]bool{}}
	t.Cleanup(func() { ln.Close(); p.setDown(true) })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.mu.Lock()
			if p.down {
				p.mu.Unlock()
				c.Close()
				continue
			}
			p.conns[c] = true
			p.mu.Unlock()
			go p.forward(c)
		}
	}()
	return p
}

func (p *apiProxy) forward(c net.Conn) {
	up, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	p.conns[up] = true
	p.mu.Unlock()
	go func() { _, _ = io.Copy(up, c); up.Close() }()
	_, _ = io.Copy(c, up)
	c.Close()
}

// setDown refuses new connections and cuts the open ones (true), or lets
// them through again.
func (p *apiProxy) setDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		for c := range p.conns {
			c.Close()
		}
		p.conns = map[net.Conn]bool{}
	}
}

// With the Kubernetes API unavailable: running pods keep serving (the
// broker reaches them directly), a new pod cannot be had and the error
// says so and is retryable, and nothing is left behind once it is back.
func TestKubernetesAPIUnavailable(t *testing.T) {
	c := needCluster(t)
	u, err := url.Parse(c.cfg.Host)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newAPIProxy(t, u.Host)
	o := c.options(t)
	o.Config = rest.CopyConfig(c.cfg)
	o.Config.Host = "https://" + proxy.ln.Addr().String()
	o.Config.TLSClientConfig.ServerName = u.Hostname()

	proxy.setDown(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	_, err = New(ctx, o)
	cancel()
	if be := brokererr.As(err); be == nil || be.Code != brokererr.Unavailable || !be.Retryable || !strings.Contains(be.Message, "Kubernetes API is unavailable") {
		t.Fatalf("New with the API down: %v", err)
	}
	proxy.setDown(false)
	b := newBackend(t, c, o)
	s1 := openSession(t, b)
	run(t, s1, "bash", `echo one > one.txt`)

	proxy.setDown(true)
	if res := run(t, s1, "bash", `cat one.txt`); string(res.Stdout) != "one\n" {
		t.Fatalf("a live pod with the API down: %q", res.Stdout)
	}
	s2 := openSession(t, b)
	start := time.Now()
	_, err = s2.Exec(context.Background(), sandbox.ExecRequest{Language: "bash", Code: "echo never", Timeout: 10 * time.Second})
	if be := brokererr.As(err); be == nil || be.Code != brokererr.Unavailable || !be.Retryable || !strings.Contains(be.Message, "Kubernetes API") {
		t.Fatalf("a new pod with the API down: %v", err)
	}
	if d := time.Since(start); d > 45*time.Second {
		t.Errorf("the refusal took %s", d)
	}
	if err := b.Ping(context.Background()); brokererr.CodeOf(err) != brokererr.Unavailable {
		t.Errorf("Ping with the API down: %v", err)
	}
	proxy.setDown(false)
	if res := run(t, s2, "bash", `echo back`); string(res.Stdout) != "back\n" {
		t.Fatalf("after the API came back: %q", res.Stdout)
	}
	// newBackend's cleanup checks that Close leaves no pod of this broker.
}

// The sweep deletes the pods of broker processes whose lease is gone or
// stale, found by label, and leaves those of live ones.
func TestSweepRemovesOrphans(t *testing.T) {
	c := needCluster(t)
	o := c.options(t)
	ctx := context.Background()
	tmpl := &Backend{o: o.withDefaults()}
	dead, live := sandbox.NewID(), sandbox.NewID()
	secs := int32(60)
	now := metav1.NewMicroTime(time.Now())
	if _, err := c.cs.CoordinationV1().Leases(c.ns).Create(ctx, &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: leasePrefix + live, Labels: map[string]string{LabelManagedBy: ManagedBy, LabelInstance: live}},
		Spec:       coordinationv1.LeaseSpec{HolderIdentity: &live, LeaseDurationSeconds: &secs, RenewTime: &now},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.cs.CoordinationV1().Leases(c.ns).Delete(ctx, leasePrefix+live, metav1.DeleteOptions{}) })
	for _, inst := range []string{dead, live} {
		tmpl.o.InstanceID = inst
		_, err := c.cs.CoreV1().Pods(c.ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "sbx-" + inst, Labels: tmpl.podLabels(sandbox.NewID(), "bash")},
			Spec:       tmpl.podSpec("bash", c.runners["bash"]),
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { waitNoPods(t, c, LabelInstance+"="+live) })
	t.Cleanup(func() {
		_ = c.cs.CoreV1().Pods(c.ns).Delete(ctx, "sbx-"+live, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))})
	})
	newBackend(t, c, o) // sweeps as it starts
	waitNoPods(t, c, LabelInstance+"="+dead)
	if _, err := c.cs.CoreV1().Pods(c.ns).Get(ctx, "sbx-"+live, metav1.GetOptions{}); err != nil {
		t.Fatalf("the live instance's pod: %v", err)
	}
}
