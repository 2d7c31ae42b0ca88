package kube

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// kubernetes-sigs/agent-sandbox, v1beta1 (the only version since its
// v1.0.0). The types are used through the dynamic client: the module's
// Go types would pin controller-runtime, and only a few fields are read.
var (
	claimGVR   = schema.GroupVersionResource{Group: "extensions.agents.x-k8s.io", Version: "v1beta1", Resource: "sandboxclaims"}
	poolGVR    = schema.GroupVersionResource{Group: "extensions.agents.x-k8s.io", Version: "v1beta1", Resource: "sandboxwarmpools"}
	sandboxGVR = schema.GroupVersionResource{Group: "agents.x-k8s.io", Version: "v1beta1", Resource: "sandboxes"}
)

// podNameAnnotation on a Sandbox names its pod when that is not the
// Sandbox's own name.
const podNameAnnotation = "agents.x-k8s.io/pod-name"

// findWarmPools returns, when the agent-sandbox CRDs are installed, the
// languages that have a SandboxWarmPool named WarmPoolPrefix+language
// (nil without the CRDs: every pod is then created plainly).
func (b *Backend) findWarmPools(ctx context.Context) (map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	_, err := b.cs.Discovery().ServerResourcesForGroupVersion(claimGVR.GroupVersion().String())
	if apierrors.IsNotFound(err) {
		b.log.Info().Msg("agent_sandbox_crds_absent_using_plain_pods")
		return nil, nil
	}
	if err != nil {
		return nil, apiError(err, "cannot look for the agent-sandbox CRDs")
	}
	list, err := b.dyn.Resource(poolGVR).Namespace(b.o.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, apiError(err, "cannot list the SandboxWarmPools")
	}
	pools := map[string]string{}
	for _, p := range list.Items {
		for _, lang := range b.languages() {
			if p.GetName() == b.o.WarmPoolPrefix+lang {
				pools[lang] = p.GetName()
			}
		}
	}
	return pools, nil
}

// claimPod claims a pod from pool through a SandboxClaim, waits until the
// claim is bound and enrols the pod's agent. On failure the claim is
// deleted (and its Sandbox with it).
// The labels go on the claim only: the claim controller refuses
// additionalPodMetadata labels outside its allow-list of domains (by
// default only sandbox.users.io); the pod is known by the chain of
// controller references from the claim.
func (b *Backend) claimPod(ctx context.Context, workspaceID, lang, pool string) (*pod, error) {
	name := "sbx-" + sandbox.NewID()
	labels := b.podLabels(workspaceID, lang)
	claim := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": claimGVR.GroupVersion().String(),
		"kind":       "SandboxClaim",
		"metadata":   map[string]any{"name": name, "namespace": b.o.Namespace, "labels": toAny(labels)},
		"spec": map[string]any{
			"warmPoolRef": map[string]any{"name": pool},
			// The controller deletes the claim, and so its pod, when the
			// broker has lost track of it.
			"lifecycle": map[string]any{
				"shutdownTime":   time.Now().Add(b.o.MaxAge).UTC().Format(time.RFC3339),
				"shutdownPolicy": "Delete",
			},
		},
	}}
	api := b.dyn.Resource(claimGVR).Namespace(b.o.Namespace)
	created, err := api.Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		if !apierrors.IsAlreadyExists(err) && !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err) {
			b.deleteClaimAsync(name)
		}
		return nil, apiError(err, "cannot claim a sandbox from the warm pool %q", pool)
	}
	p, err := b.boundPod(ctx, created, lang)
	if err != nil {
		b.deleteClaimAsync(name)
		if ctx.Err() != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "the warm pool %q did not give a sandbox in time", pool)
		}
		return nil, err
	}
	p.claim = name
	return p, nil
}

// boundPod waits for the claim to be Ready with its Sandbox, finds the
// Sandbox's pod, checks the claim owns both and enrols its agent.
func (b *Backend) boundPod(ctx context.Context, claim *unstructured.Unstructured, lang string) (*pod, error) {
	api := b.dyn.Resource(claimGVR).Namespace(b.o.Namespace)
	cur := claim
	for sandboxName(cur) == "" {
		w, err := api.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + claim.GetName(), ResourceVersion: cur.GetResourceVersion()})
		if err != nil {
			return nil, apiError(err, "cannot watch the sandbox claim")
		}
		for ev := range w.ResultChan() {
			if ev.Type == watch.Deleted {
				w.Stop()
				return nil, brokererr.New(brokererr.Unavailable, "the sandbox claim was deleted while it was bound")
			}
			u, ok := ev.Object.(*unstructured.Unstructured)
			if !ok {
				break
			}
			if cur = u; sandboxName(cur) != "" {
				break
			}
		}
		w.Stop()
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if sandboxName(cur) == "" {
			if cur, err = api.Get(ctx, claim.GetName(), getOpts); err != nil {
				return nil, apiError(err, "cannot read the sandbox claim")
			}
		}
	}
	sb, err := b.dyn.Resource(sandboxGVR).Namespace(b.o.Namespace).Get(ctx, sandboxName(cur), getOpts)
	if err != nil {
		return nil, apiError(err, "cannot read the claimed sandbox")
	}
	podName := sb.GetName()
	if n := sb.GetAnnotations()[podNameAnnotation]; n != "" {
		podName = n
	}
	obj, err := b.cs.CoreV1().Pods(b.o.Namespace).Get(ctx, podName, getOpts)
	if err != nil {
		return nil, apiError(err, "cannot read the claimed sandbox's pod")
	}
	// The claim owns the Sandbox (a warm one's controller reference moves
	// to the claim on adoption) and the Sandbox the pod: refuse anything
	// else. (The claim-uid label is not on an adopted pod: the Sandbox
	// controller does not copy its reserved labels to a running pod.)
	if !controlledBy(sb, claim.GetUID()) || !controlledBy(obj, sb.GetUID()) {
		return nil, brokererr.New(brokererr.Unavailable, "the claimed sandbox's pod does not belong to the claim").NotRetryable()
	}
	return b.readyPod(ctx, obj, lang)
}

// sandboxName is the claim's Sandbox once the claim is Ready.
func sandboxName(claim *unstructured.Unstructured) string {
	conds, _, _ := unstructured.NestedSlice(claim.Object, "status", "conditions")
	ready := false
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Ready" && m["status"] == string(corev1.ConditionTrue) {
			ready = true
		}
	}
	name, _, _ := unstructured.NestedString(claim.Object, "status", "sandbox", "name")
	if !ready {
		return ""
	}
	return name
}

// deleteClaim deletes a claim (its Sandbox and pod follow); a claim
// already gone is not an error.
func (b *Backend) deleteClaim(ctx context.Context, name string) bool {
	err := b.dyn.Resource(claimGVR).Namespace(b.o.Namespace).Delete(ctx, name,
		metav1.DeleteOptions{PropagationPolicy: ptr(metav1.DeletePropagationBackground)})
	if err != nil && !apierrors.IsNotFound(err) {
		b.log.Warn().Err(err).Str("claim", name).Msg("sandbox_claim_delete_failed")
		return false
	}
	return true
}

func (b *Backend) deleteClaimAsync(name string) {
	b.bg.Add(1)
	go func() {
		defer b.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
		defer cancel()
		b.deleteClaim(ctx, name)
	}()
}

func toAny(m map[string]string) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// controlledBy reports whether obj's controller reference is uid.
func controlledBy(obj metav1.Object, uid types.UID) bool {
	ref := metav1.GetControllerOfNoCopy(obj)
	return ref != nil && ref.UID == uid
}
