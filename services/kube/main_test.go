package kube

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sandbox-broker/sandbox-broker/services/podca"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// These tests run the backend against a real cluster: KUBECONFIG names it
// (tests/k8s/cluster.sh here, kind on GitHub). With CI=true a cluster that
// cannot be reached fails them; elsewhere they skip, saying why.
//
//	KUBECONFIG                    the cluster
//	SANDBOX_K8S_IMAGE_LOADER      command that loads an image archive (its last argument) into the
//	                              node: "tests/k8s/cluster.sh load", "kind load image-archive --name X"
//	SANDBOX_K8S_TEST_RUNNERS      runner images already on the node (default python and bash)
//	SANDBOX_K8S_TEST_BROKER_CIDR  the address block the tests reach pods from (network policy)
//	SANDBOX_K8S_TEST_NETPOL       "enforced" when the cluster's CNI enforces network policies

func inCI() bool { return os.Getenv("CI") == "true" }

// testCluster is the cluster and what the tests put in it once: the agent
// image, built from this tree, and a namespace of their own that enforces
// the restricted Pod Security Standard.
type testCluster struct {
	cfg        *rest.Config
	cs         kubernetes.Interface
	ns         string
	agentImage string
	runners    map[string]string
	cidr       string
}

var (
	clusterOnce sync.Once
	cluster     *testCluster
	clusterErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		_ = cluster.cs.CoreV1().Namespaces().Delete(ctx, cluster.ns, metav1.DeleteOptions{})
		cancel()
	}
	os.Exit(code)
}

func needCluster(t testing.TB) *testCluster {
	t.Helper()
	clusterOnce.Do(func() { cluster, clusterErr = setUpCluster() })
	if clusterErr != nil {
		if inCI() {
			t.Fatalf("CI=true but the test cluster is not usable: %v", clusterErr)
		}
		t.Skipf("no Kubernetes cluster for the kubernetes backend (set KUBECONFIG; tests/k8s/cluster.sh makes one): %v", clusterErr)
	}
	return cluster
}

func setUpCluster() (*testCluster, error) {
	path := os.Getenv("KUBECONFIG")
	if path == "" {
		return nil, fmt.Errorf("KUBECONFIG is not set")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := cs.Discovery().ServerVersion(); err != nil {
		return nil, fmt.Errorf("the API server does not answer: %w", err)
	}
	runners, err := ParseRunners(envOr("SANDBOX_K8S_TEST_RUNNERS", "python=sandbox-broker/runner-python:latest,bash=sandbox-broker/runner-bash:latest"))
	if err != nil {
		return nil, err
	}
	img, err := loadAgentImage(ctx)
	if err != nil {
		return nil, fmt.Errorf("agent image: %w", err)
	}
	ns := "sbx-test-" + sandbox.NewID()
	_, err = cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{
		"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest",
	}}}, metav1.CreateOptions{})
	if err != nil {
		return nil, err
	}
	// The default service account must exist before pods (kube-controller-manager makes it).
	for {
		if _, err := cs.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{}); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("no default service account in %s", ns)
		case <-time.After(200 * time.Millisecond):
		}
	}
	return &testCluster{cfg: cfg, cs: cs, ns: ns, agentImage: img, runners: runners,
		cidr: envOr("SANDBOX_K8S_TEST_BROKER_CIDR", "0.0.0.0/0")}, nil
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// loadAgentImage builds the broker from this tree, packs it as an image
// (the binary at the path the init container copies it from) and loads it
// into the node with SANDBOX_K8S_IMAGE_LOADER.
func loadAgentImage(ctx context.Context) (string, error) {
	loader := strings.Fields(os.Getenv("SANDBOX_K8S_IMAGE_LOADER"))
	if len(loader) == 0 {
		return "", fmt.Errorf("SANDBOX_K8S_IMAGE_LOADER is not set")
	}
	dir, err := os.MkdirTemp("", "kube-agent-image-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, "sandbox-broker")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", bin, "github.com/sandbox-broker/sandbox-broker/cmd/sandbox-broker")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build: %v: %s", err, out)
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(data)
	name := "localhost/sandbox-broker-agent:test-" + hex.EncodeToString(sum[:6])
	archive := filepath.Join(dir, "agent.tar")
	if err := writeOCIImage(archive, name, defaultAgentPath, data); err != nil {
		return "", err
	}
	cmd = exec.CommandContext(ctx, loader[0], append(loader[1:], archive)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s: %v: %s", strings.Join(loader, " "), err, out)
	}
	return name, nil
}

// writeOCIImage writes an OCI image layout archive of one layer holding
// data at path (mode 0755), named name.
func writeOCIImage(archive, name, path string, data []byte) error {
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	dirs := strings.Split(strings.TrimPrefix(filepath.Dir(path), "/"), "/")
	for i := range dirs {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.Join(dirs[:i+1], "/") + "/", Mode: 0o755}); err != nil {
			return err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(path, "/"), Mode: 0o755, Size: int64(len(data))}); err != nil {
		return err
	}
	if _, err := tw.Write(data); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	blobs := map[string][]byte{}
	add := func(b []byte) (string, int) {
		s := sha256.Sum256(b)
		d := hex.EncodeToString(s[:])
		blobs[d] = b
		return "sha256:" + d, len(b)
	}
	ld, ls := add(layer.Bytes())
	cfg, _ := json.Marshal(map[string]any{"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Entrypoint": []string{path}}, "rootfs": map[string]any{"type": "layers", "diff_ids": []string{ld}}})
	cd, cs := add(cfg)
	man, _ := json.Marshal(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
		"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
		"layers": []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld, "size": ls}}})
	md, ms := add(man)
	index, _ := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []any{map[string]any{
		"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
		"annotations": map[string]string{"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name[strings.LastIndex(name, ":")+1:]}}}})
	f, err := os.Create(archive)
	if err != nil {
		return err
	}
	out := tar.NewWriter(f)
	put := func(n string, b []byte) error {
		if err := out.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: 0o644, Size: int64(len(b))}); err != nil {
			return err
		}
		_, err := out.Write(b)
		return err
	}
	err = put("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	if err == nil {
		err = put("index.json", index)
	}
	for d, b := range blobs {
		if err == nil {
			err = put("blobs/sha256/"+d, b)
		}
	}
	if err == nil {
		err = out.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// testOptions are a backend's options in the test namespace.
func (c *testCluster) options(t testing.TB) Options {
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	ca, err := podca.New(secret)
	if err != nil {
		t.Fatal(err)
	}
	return Options{
		Config: c.cfg, Namespace: c.ns, Runners: c.runners, AgentImage: c.agentImage,
		ImagePullPolicy: corev1.PullNever, CA: ca, Peer: Peer{CIDR: c.cidr},
		WorkspaceLimits: workspace.Limits{MaxFiles: 100, MaxBytes: 8 << 20, MaxFileBytes: 4 << 20},
		MaxAge:          time.Hour, ReadyTimeout: 2 * time.Minute,
		Log: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel),
	}
}

// newBackend starts a backend with o and closes it after the test; Close
// must leave none of its pods behind.
func newBackend(t testing.TB, c *testCluster, o Options) *Backend {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b, err := New(ctx, o)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
		waitNoPods(t, c, LabelInstance+"="+b.o.InstanceID)
	})
	return b
}

// waitNoPods waits until no pod matches selector (pods are deleted with no
// grace period, but deletion still takes the kubelet a moment).
func waitNoPods(t testing.TB, c *testCluster, selector string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		list, err := c.cs.CoreV1().Pods(c.ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err == nil && len(list.Items) == 0 {
			return
		}
		if ctx.Err() != nil {
			names := []string{}
			if list != nil {
				for _, p := range list.Items {
					names = append(names, p.Name)
				}
			}
			t.Errorf("pods left behind (%s): %v %v", selector, names, err)
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// openSession opens a session on a fresh workspace directory.
func openSession(t testing.TB, b *Backend) *Session {
	t.Helper()
	id := sandbox.NewID() + sandbox.NewID()
	dir := filepath.Join(t.TempDir(), "workspaces", id)
	s, err := b.Open(context.Background(), sandbox.SessionRef{WorkspaceID: id, Dir: dir, Principal: "test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Destroy(context.Background()) })
	return s.(*Session)
}

func run(t testing.TB, s *Session, lang, code string) sandbox.ExecResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	res, err := s.Exec(ctx, sandbox.ExecRequest{Language: lang, Code: code, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("Exec %s %q: %v", lang, code, err)
	}
	return res
}
