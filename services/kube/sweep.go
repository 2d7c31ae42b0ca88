package kube

import (
	"context"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Every broker process holds a Lease named after its instance and renews
// it; the sweep deletes the pods and claims of instances whose lease is
// gone or stale (a broker that crashed or was stopped), found by label.
// Pods also end on their own at activeDeadlineSeconds.
const (
	leaseDuration = 60 * time.Second
	renewEvery    = 20 * time.Second
	sweepEvery    = time.Minute
	leasePrefix   = "sandbox-broker-"
)

func (b *Backend) leaseName() string { return leasePrefix + b.o.InstanceID }

// renewLease creates or renews this process's lease.
func (b *Backend) renewLease(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	api := b.cs.CoordinationV1().Leases(b.o.Namespace)
	now := metav1.NewMicroTime(time.Now())
	secs := int32(leaseDuration.Seconds())
	l, err := api.Get(ctx, b.leaseName(), getOpts)
	switch {
	case apierrors.IsNotFound(err):
		_, err = api.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: b.leaseName(), Namespace: b.o.Namespace,
				Labels: map[string]string{LabelManagedBy: ManagedBy, LabelInstance: b.o.InstanceID}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &b.o.InstanceID, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now},
		}, metav1.CreateOptions{})
	case err == nil:
		l.Spec.RenewTime = &now
		_, err = api.Update(ctx, l, metav1.UpdateOptions{})
	}
	if err != nil {
		return apiError(err, "cannot renew the broker's lease")
	}
	return nil
}

// liveInstances are the instances whose lease is fresh; stale leases are
// deleted.
func (b *Backend) liveInstances(ctx context.Context) (map[string]bool, error) {
	api := b.cs.CoordinationV1().Leases(b.o.Namespace)
	list, err := api.List(ctx, metav1.ListOptions{LabelSelector: LabelManagedBy + "=" + ManagedBy})
	if err != nil {
		return nil, err
	}
	live := map[string]bool{b.o.InstanceID: true}
	for _, l := range list.Items {
		id := l.Labels[LabelInstance]
		if l.Spec.RenewTime != nil && l.Spec.LeaseDurationSeconds != nil &&
			time.Since(l.Spec.RenewTime.Time) < time.Duration(*l.Spec.LeaseDurationSeconds)*time.Second {
			live[id] = true
			continue
		}
		if id != b.o.InstanceID {
			_ = api.Delete(ctx, l.Name, metav1.DeleteOptions{})
		}
	}
	return live, nil
}

// sweep deletes the sandbox pods and claims of instances that are not
// live. Claimed pods go with their claim.
func (b *Backend) sweep(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 2*apiTimeout)
	defer cancel()
	live, err := b.liveInstances(ctx)
	if err != nil {
		b.log.Warn().Err(err).Msg("sandbox_sweep_failed")
		return
	}
	sel := metav1.ListOptions{LabelSelector: LabelManagedBy + "=" + ManagedBy + "," + LabelInstance}
	pods, err := b.cs.CoreV1().Pods(b.o.Namespace).List(ctx, sel)
	if err != nil {
		b.log.Warn().Err(err).Msg("sandbox_sweep_failed")
		return
	}
	for _, p := range pods.Items {
		if live[p.Labels[LabelInstance]] {
			continue
		}
		b.deletePod(ctx, p.Name, p.UID)
		b.log.Info().Str("pod", p.Name).Str("instance", p.Labels[LabelInstance]).Msg("removed_orphan_sandbox_pod")
	}
	if b.pools == nil {
		return
	}
	claims, err := b.dyn.Resource(claimGVR).Namespace(b.o.Namespace).List(ctx, sel)
	if err != nil {
		b.log.Warn().Err(err).Msg("sandbox_sweep_failed")
		return
	}
	for _, c := range claims.Items {
		if live[c.GetLabels()[LabelInstance]] {
			continue
		}
		b.deleteClaim(ctx, c.GetName())
		b.log.Info().Str("claim", c.GetName()).Str("instance", c.GetLabels()[LabelInstance]).Msg("removed_orphan_sandbox_claim")
	}
}

// housekeeping renews the lease and sweeps until Close, then deletes this
// instance's lease, pods and claims: they serve no one after the broker.
func (b *Backend) housekeeping() {
	defer b.bg.Done()
	renew := time.NewTicker(renewEvery)
	defer renew.Stop()
	sweep := time.NewTicker(sweepEvery)
	defer sweep.Stop()
	for {
		select {
		case <-b.ctx.Done():
			b.retire()
			return
		case <-renew.C:
			if err := b.renewLease(b.ctx); err != nil && b.ctx.Err() == nil {
				b.log.Warn().Err(err).Msg("broker_lease_renewal_failed")
			}
		case <-sweep.C:
			b.sweep(b.ctx)
		}
	}
}

// retire removes this instance's pods, claims and lease.
func (b *Backend) retire() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*apiTimeout)
	defer cancel()
	sel := metav1.ListOptions{LabelSelector: LabelManagedBy + "=" + ManagedBy + "," + LabelInstance + "=" + b.o.InstanceID}
	if pods, err := b.cs.CoreV1().Pods(b.o.Namespace).List(ctx, sel); err == nil {
		for _, p := range pods.Items {
			b.deletePod(ctx, p.Name, p.UID)
		}
	}
	if b.pools != nil {
		if claims, err := b.dyn.Resource(claimGVR).Namespace(b.o.Namespace).List(ctx, sel); err == nil {
			for _, c := range claims.Items {
				b.deleteClaim(ctx, c.GetName())
			}
		}
	}
	_ = b.cs.CoordinationV1().Leases(b.o.Namespace).Delete(ctx, b.leaseName(), metav1.DeleteOptions{})
}

// deletePod deletes a pod at once (grace 0), if it is still the one with
// uid ("" for any); a pod already gone is not an error. It reports whether
// the pod is gone or going.
func (b *Backend) deletePod(ctx context.Context, name string, uid types.UID) bool {
	opts := metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0)), PropagationPolicy: ptr(metav1.DeletePropagationBackground)}
	if uid != "" {
		opts.Preconditions = metav1.NewUIDPreconditions(string(uid))
	}
	err := b.cs.CoreV1().Pods(b.o.Namespace).Delete(ctx, name, opts)
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		b.log.Warn().Err(err).Str("pod", name).Msg("sandbox_pod_delete_failed")
		return false
	}
	return true
}
