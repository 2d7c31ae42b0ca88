package kube

import (
	"context"
	"os"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

var templateGVR = schema.GroupVersionResource{Group: "extensions.agents.x-k8s.io", Version: "v1beta1", Resource: "sandboxtemplates"}

// needAgentSandbox requires the agent-sandbox CRDs and controller
// (tests/k8s/cluster.sh agent-sandbox): CI installs them
// (SANDBOX_K8S_TEST_AGENT_SANDBOX=1), so there their absence fails.
func needAgentSandbox(t *testing.T, c *testCluster) dynamic.Interface {
	t.Helper()
	_, err := c.cs.Discovery().ServerResourcesForGroupVersion(claimGVR.GroupVersion().String())
	if err != nil {
		if inCI() || os.Getenv("SANDBOX_K8S_TEST_AGENT_SANDBOX") == "1" {
			t.Fatalf("the agent-sandbox CRDs are not installed: %v", err)
		}
		t.Skipf("the agent-sandbox CRDs are not installed (tests/k8s/cluster.sh agent-sandbox): %v", err)
	}
	dyn, err := dynamic.NewForConfig(c.cfg)
	if err != nil {
		t.Fatal(err)
	}
	return dyn
}

// With agent-sandbox installed and a warm pool for the language, a session
// claims its pod through a SandboxClaim: the pool's pod, hardened the
// same, owned through its Sandbox by the claim, enrolled like any other; releasing the
// session deletes the claim and so the pod.
func TestWarmPoolClaim(t *testing.T) {
	c := needCluster(t)
	dyn := needAgentSandbox(t, c)
	ctx := context.Background()
	o := c.options(t)
	o.WarmPoolPrefix = "pool-" + sandbox.NewID() + "-"
	pool := o.WarmPoolPrefix + "bash"
	podSpec, err := TemplatePodSpec(o, "bash")
	if err != nil {
		t.Fatal(err)
	}
	spec, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&podSpec)
	if err != nil {
		t.Fatal(err)
	}
	// A broker runs before the pool is made: the pool's pods read the CA it
	// publishes (a pod made before that waits, and one made under another CA
	// could never enrol).
	newBackend(t, c, o)
	template := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": templateGVR.GroupVersion().String(), "kind": "SandboxTemplate",
		"metadata": map[string]any{"name": pool},
		"spec": map[string]any{
			"podTemplate": map[string]any{
				"metadata": map[string]any{"labels": map[string]any{LabelManagedBy: ManagedBy, LabelRole: RoleSandbox, LabelLanguage: "bash"}},
				"spec":     spec,
			},
			"networkPolicyManagement": "Unmanaged", // the broker's own policy applies
		},
	}}
	if _, err := dyn.Resource(templateGVR).Namespace(c.ns).Create(ctx, template, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	warm := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": poolGVR.GroupVersion().String(), "kind": "SandboxWarmPool",
		"metadata": map[string]any{"name": pool},
		"spec":     map[string]any{"replicas": int64(1), "sandboxTemplateRef": map[string]any{"name": pool}},
	}}
	if _, err := dyn.Resource(poolGVR).Namespace(c.ns).Create(ctx, warm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = dyn.Resource(poolGVR).Namespace(c.ns).Delete(ctx, pool, metav1.DeleteOptions{})
		_ = dyn.Resource(templateGVR).Namespace(c.ns).Delete(ctx, pool, metav1.DeleteOptions{})
	})
	// The pool's pod runs before anyone claims it.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		p, err := dyn.Resource(poolGVR).Namespace(c.ns).Get(ctx, pool, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n, _, _ := unstructured.NestedInt64(p.Object, "status", "readyReplicas"); n >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the warm pool never got ready: %v", p.Object["status"])
		}
		time.Sleep(500 * time.Millisecond)
	}

	b := newBackend(t, c, o)
	if b.pools["bash"] != pool {
		t.Fatalf("warm pools found: %v", b.pools)
	}
	s := openSession(t, b)
	start := time.Now()
	res := run(t, s, "bash", `id -u; echo claimed > c.txt`)
	t.Logf("claim to first run: %s", time.Since(start))
	if string(res.Stdout) != "65532\n" || len(res.Changed) != 1 {
		t.Fatalf("run on a claimed pod: %q %q %+v", res.Stdout, res.Stderr, res.Changed)
	}
	s.mu.Lock()
	p := s.pods["bash"]
	s.mu.Unlock()
	claim, err := dyn.Resource(claimGVR).Namespace(c.ns).Get(ctx, p.claim, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the session's claim: %v", err)
	}
	if claim.GetLabels()[LabelInstance] != b.o.InstanceID {
		t.Errorf("claim labels %v", claim.GetLabels())
	}
	obj := sessionPod(t, c, s, "bash")
	if ref := metav1.GetControllerOf(obj); ref == nil || ref.Kind != "Sandbox" || obj.Labels[LabelRole] != RoleSandbox {
		t.Errorf("claimed pod: owner %v, labels %v", ref, obj.Labels)
	}
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitPodGone(t, c, obj.Name)
	if _, err := dyn.Resource(claimGVR).Namespace(c.ns).Get(ctx, p.claim, metav1.GetOptions{}); err == nil {
		t.Errorf("the claim %s outlived Release", p.claim)
	}
	// The files stay with the session; the next run claims another pod.
	if res := run(t, s, "bash", `cat c.txt`); string(res.Stdout) != "claimed\n" {
		t.Fatalf("after Release: %q", res.Stdout)
	}
}

// waitPodGone waits until the pod name no longer exists.
func waitPodGone(t *testing.T, c *testCluster, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		_, err := c.cs.CoreV1().Pods(c.ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("the claimed pod %s outlived Release: %v", name, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
