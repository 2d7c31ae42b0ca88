package kube

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/podca"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// pod is one of a session's sandbox pods, enrolled and ready.
type pod struct {
	name   string
	uid    types.UID
	claim  string // its SandboxClaim, "" for a plain pod
	lang   string
	client *agent.PodClient
	slot   *sandbox.Slot
	jobs   atomic.Int32
	gone   atomic.Bool // retired; a job that still runs will fail

	// What the last sync saw on each side (sync.go); the session's lock
	// guards them.
	hostMark map[string]workspace.FileStamp
	podMark  map[string]agent.ManifestEntry
}

// startPod gives a session a ready pod for lang: claimed from the
// language's warm pool when there is one, else created.
func (b *Backend) startPod(ctx context.Context, workspaceID, lang string) (*pod, error) {
	image, err := b.image(lang)
	if err != nil {
		return nil, err
	}
	if b.isClosed() {
		return nil, closedErr()
	}
	slot, ok := b.o.Slots.Acquire()
	if !ok {
		e := brokererr.New(brokererr.Unavailable, "all %d sandbox slots are in use; try again when a session ends", b.o.Slots.Max())
		if d := b.o.Slots.RetryAfter(time.Now()); d > 0 {
			e = e.WithRetryAfter(d)
		}
		return nil, e
	}
	ctx, cancel := context.WithTimeout(ctx, b.o.ReadyTimeout)
	defer cancel()
	var p *pod
	if pool := b.pools[lang]; pool != "" {
		p, err = b.claimPod(ctx, workspaceID, lang, pool)
	} else {
		p, err = b.createPod(ctx, workspaceID, lang, image)
	}
	if err != nil {
		slot.Release()
		return nil, err
	}
	p.slot = slot
	return p, nil
}

// createPod creates a plain pod from the template (podSpec), waits for it
// and enrols its agent. On failure the pod is deleted.
func (b *Backend) createPod(ctx context.Context, workspaceID, lang, image string) (*pod, error) {
	name := "sbx-" + sandbox.NewID()
	obj := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: b.o.Namespace, Labels: b.podLabels(workspaceID, lang)},
		Spec:       b.podSpec(lang, image),
	}
	start := time.Now()
	created, err := b.cs.CoreV1().Pods(b.o.Namespace).Create(ctx, obj, metav1.CreateOptions{})
	if err != nil {
		// A create that timed out may still have happened: the name is
		// ours, so delete it to be sure.
		if !apierrors.IsAlreadyExists(err) && !apierrors.IsInvalid(err) && !apierrors.IsForbidden(err) {
			b.deleteAsync(name, "")
		}
		return nil, apiError(err, "cannot create the sandbox pod")
	}
	p, err := b.readyPod(ctx, created, lang)
	if err != nil {
		b.deleteAsync(name, created.UID)
		return nil, err
	}
	b.log.Debug().Str("pod", name).Str("language", lang).Dur("took", time.Since(start)).Msg("sandbox_pod_started")
	return p, nil
}

// readyPod waits until the pod runs and enrols its agent.
func (b *Backend) readyPod(ctx context.Context, obj *corev1.Pod, lang string) (*pod, error) {
	var last string // the last reason it was waiting, for the timeout's message
	running, err := b.waitPod(ctx, obj, func(p *corev1.Pod) (bool, error) {
		done, why, err := podRunning(p)
		if why != "" {
			last = why
		}
		return done, err
	})
	if err != nil {
		if ctx.Err() != nil {
			msg := "the sandbox pod did not start in time"
			if last != "" {
				msg += " (" + last + ")"
			}
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "%s", msg)
		}
		return nil, err
	}
	client, err := b.enroll(ctx, running)
	if err != nil {
		return nil, err
	}
	return &pod{name: running.Name, uid: running.UID, lang: lang, client: client}, nil
}

// podRunning says whether p's agent container runs with an IP; a pod that
// cannot start any more is an error; why is what it waits for.
func podRunning(p *corev1.Pod) (done bool, why string, err error) {
	if p.DeletionTimestamp != nil {
		return false, "", brokererr.New(brokererr.Unavailable, "the sandbox pod was deleted while it started")
	}
	switch p.Status.Phase {
	case corev1.PodFailed, corev1.PodSucceeded:
		return false, "", brokererr.New(brokererr.Unavailable, "the sandbox pod ended while it started: %s", podEnd(p))
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason != "" {
			why = c.Reason + ": " + truncate(c.Message, 200)
		}
	}
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if t := cs.State.Terminated; t != nil && (t.ExitCode != 0 || cs.Name == ContainerName) {
			return false, "", brokererr.New(brokererr.Unavailable, "the sandbox pod's %s container ended: %s (exit %d)", cs.Name, t.Reason, t.ExitCode).NotRetryable()
		}
		if w := cs.State.Waiting; w != nil && w.Reason != "" {
			why = cs.Name + ": " + w.Reason
			switch w.Reason {
			case "ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError", "CreateContainerError":
				return false, "", brokererr.New(brokererr.Unavailable, "the sandbox pod cannot start: %s: %s", w.Reason, truncate(w.Message, 200)).NotRetryable()
			}
		}
		if cs.Name == ContainerName && cs.State.Running != nil && p.Status.PodIP != "" {
			return true, "", nil
		}
	}
	return false, why, nil
}

// podEnd describes how a pod ended (phase, reason, message).
func podEnd(p *corev1.Pod) string {
	s := string(p.Status.Phase)
	if p.Status.Reason != "" {
		s += ", " + p.Status.Reason
	}
	if p.Status.Message != "" {
		s += ": " + truncate(p.Status.Message, 200)
	}
	return s
}

// waitPod re-reads obj until check says done (or fails), watching between
// reads; it ends with ctx.
func (b *Backend) waitPod(ctx context.Context, obj *corev1.Pod, check func(*corev1.Pod) (bool, error)) (*corev1.Pod, error) {
	api := b.cs.CoreV1().Pods(b.o.Namespace)
	cur := obj
	for {
		if done, err := check(cur); done || err != nil {
			return cur, err
		}
		w, err := api.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + obj.Name, ResourceVersion: cur.ResourceVersion})
		if err != nil {
			return nil, apiError(err, "cannot watch the sandbox pod")
		}
		for ev := range w.ResultChan() {
			if ev.Type == watch.Deleted {
				w.Stop()
				return nil, brokererr.New(brokererr.Unavailable, "the sandbox pod was deleted while it started")
			}
			p, ok := ev.Object.(*corev1.Pod)
			if !ok || (ev.Type != watch.Added && ev.Type != watch.Modified) {
				break // an error event (an old resourceVersion, say): read again
			}
			cur = p
			if done, err := check(cur); done || err != nil {
				w.Stop()
				return cur, err
			}
		}
		w.Stop()
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if cur, err = api.Get(ctx, obj.Name, getOpts); err != nil {
			return nil, apiError(err, "cannot read the sandbox pod")
		}
	}
}

// enroll reads the agent's certificate request from the pod's log (the
// Kubernetes API is the authenticated channel), issues its certificate and
// hands it over on a connection pinned to that key.
func (b *Backend) enroll(ctx context.Context, p *corev1.Pod) (*agent.PodClient, error) {
	csr, err := b.readCSR(ctx, p.Name)
	if err != nil {
		return nil, err
	}
	validity := b.o.MaxAge + time.Hour
	chain, err := b.o.CA.IssuePod(csr, b.o.Namespace, p.Name, string(p.UID), validity)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot issue the sandbox pod's certificate")
	}
	addr := net.JoinHostPort(p.Status.PodIP, strconv.Itoa(agent.PodPort))
	if err := agent.Enroll(ctx, addr, b.tls, csr.PublicKey, chain); err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "the sandbox pod's agent did not take its certificate")
	}
	cfg := b.tls.Clone()
	cfg.ServerName = agent.PodServerName(b.o.Namespace, p.Name)
	return &agent.PodClient{Addr: addr, TLS: cfg}, nil
}

// readCSR follows the agent container's log to its first line.
func (b *Backend) readCSR(ctx context.Context, name string) (*x509.CertificateRequest, error) {
	limit := int64(4096)
	rc, err := b.cs.CoreV1().Pods(b.o.Namespace).GetLogs(name, &corev1.PodLogOptions{
		Container: ContainerName, Follow: true, LimitBytes: &limit,
	}).Stream(ctx)
	if err != nil {
		return nil, apiError(err, "cannot read the sandbox pod's log")
	}
	defer rc.Close()
	line, err := bufio.NewReaderSize(io.LimitReader(rc, limit), int(limit)).ReadString('\n')
	if err != nil {
		if ctx.Err() != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "the sandbox pod's agent did not announce itself in time")
		}
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "the sandbox pod's agent did not announce itself")
	}
	csr, err := podca.ParseCSRLine(line)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "the sandbox pod's agent announced itself wrongly").NotRetryable()
	}
	return csr, nil
}

// deleteAsync deletes a pod in the background (bounded); the sweep gets
// it if this fails.
func (b *Backend) deleteAsync(name string, uid types.UID) {
	b.bg.Add(1)
	go func() {
		defer b.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
		defer cancel()
		b.deletePod(ctx, name, uid)
	}()
}

// release deletes p (its claim, for a claimed pod) and gives back its
// slot. It waits for the API's answer, not for the pod to end.
func (b *Backend) release(ctx context.Context, p *pod) error {
	p.gone.Store(true)
	defer p.slot.Release()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), apiTimeout)
	defer cancel()
	ok := false
	if p.claim != "" {
		ok = b.deleteClaim(ctx, p.claim)
	} else {
		ok = b.deletePod(ctx, p.name, p.uid)
	}
	if !ok {
		return brokererr.New(brokererr.Unavailable, "cannot delete the sandbox pod: the Kubernetes API is unavailable (it will be swept later)")
	}
	return nil
}

// releaseAsync is release in the background.
func (b *Backend) releaseAsync(p *pod) {
	b.bg.Add(1)
	go func() {
		defer b.bg.Done()
		_ = b.release(context.Background(), p)
	}()
}

// fate says what became of a pod whose agent was lost: evicted (and
// why), out of memory, deleted; all false when the API cannot tell.
type fate struct {
	evicted, oom, deleted, overQuota bool
	why                              string
}

func (b *Backend) podFate(ctx context.Context, p *pod) fate {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	obj, err := b.cs.CoreV1().Pods(b.o.Namespace).Get(ctx, p.name, getOpts)
	switch {
	case apierrors.IsNotFound(err):
		return fate{deleted: true, why: "the pod was deleted"}
	case err != nil:
		return fate{}
	case obj.UID != p.uid:
		return fate{deleted: true, why: "the pod was replaced"}
	}
	f := fate{}
	switch {
	case obj.Status.Reason == "Evicted": // by the kubelet, under node pressure or past a volume's limit
		f.evicted, f.why = true, podEnd(obj)
		f.overQuota = strings.Contains(obj.Status.Message, "emptyDir") || strings.Contains(obj.Status.Message, "EmptyDir")
	case obj.DeletionTimestamp != nil:
		f.deleted, f.why = true, "the pod was deleted"
		for _, c := range obj.Status.Conditions {
			// Set by the eviction API, preemption, node drain and the like.
			if c.Type == corev1.DisruptionTarget && c.Status == corev1.ConditionTrue {
				f.evicted, f.deleted = true, false
				f.why = "evicted: " + c.Reason
			}
		}
	}
	for _, cs := range obj.Status.ContainerStatuses {
		if t := cs.State.Terminated; t != nil && cs.Name == ContainerName {
			f.oom = t.Reason == "OOMKilled"
			if f.why == "" {
				f.why = fmt.Sprintf("the agent container ended: %s (exit %d)", t.Reason, t.ExitCode)
			}
		}
	}
	return f
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// clientCert is the broker's client certificate, issued by the CA at
// first use and again before it expires.
type clientCert struct {
	ca   *podca.CA
	cert atomic.Pointer[tls.Certificate]
}

const clientCertValidity = 24 * time.Hour

func (c *clientCert) get(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	if cur := c.cert.Load(); cur != nil && time.Until(cur.Leaf.NotAfter) > clientCertValidity/4 {
		return cur, nil
	}
	cert, err := c.ca.ClientCert(clientCertValidity)
	if err != nil {
		return nil, errors.New("kube: cannot issue the broker's client certificate")
	}
	c.cert.Store(cert)
	return cert, nil
}
