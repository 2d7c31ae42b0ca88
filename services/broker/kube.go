package broker

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/kube"
	"github.com/sandbox-broker/sandbox-broker/services/podca"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// openKube starts the Kubernetes backend (SANDBOX_BACKEND=kubernetes):
// the cluster from KUBECONFIG, else the pod's own service account.
func (b *Broker) openKube(ctx context.Context, cfg config.Config) (*kube.Backend, error) {
	var rc *rest.Config
	var err error
	if cfg.Kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig)
	} else if rc, err = rest.InClusterConfig(); err != nil {
		err = fmt.Errorf("not in a cluster and KUBECONFIG is not set: %w", err)
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	runners, err := kube.ParseRunners(cfg.K8sRunners)
	if err != nil {
		return nil, err
	}
	labels, err := kube.ParseLabels(cfg.K8sBrokerLabels)
	if err != nil {
		return nil, fmt.Errorf("SANDBOX_K8S_BROKER_LABELS: %w", err)
	}
	secret := []byte(cfg.K8sCASecret.Reveal())
	if len(secret) == 0 {
		if secret, err = files.LoadOrCreateKey(cfg.Root, "k8s_ca_secret"); err != nil {
			return nil, fmt.Errorf("sandbox CA secret: %w", err)
		}
	}
	ca, err := podca.New(secret)
	if err != nil {
		return nil, err
	}
	return kube.New(ctx, kube.Options{
		Config:          rc,
		Namespace:       cfg.K8sNamespace,
		Runners:         runners,
		AgentImage:      cfg.K8sAgentImage,
		ImagePullPolicy: corev1.PullPolicy(cfg.K8sPullPolicy),
		RuntimeClass:    cfg.K8sRuntimeClass,
		Seccomp:         cfg.K8sSeccomp,
		UID:             cfg.K8sUID,
		Memory:          cfg.MemoryMB << 20,
		CPUMilli:        int64(cfg.CPUs),
		WorkspaceLimits: workspace.Limits{MaxFiles: cfg.MaxFiles, MaxBytes: cfg.MaxWorkspaceMB << 20,
			MaxFileBytes: min(cfg.MaxWorkspaceMB<<20, 64<<20)},
		MaxAge:         time.Duration(cfg.MaxAgeS) * time.Second,
		CA:             ca,
		InstanceID:     instanceID(),
		Peer:           kube.Peer{Namespace: cfg.K8sBrokerNamespace, Labels: labels, CIDR: cfg.K8sBrokerCIDR},
		WarmPoolPrefix: cfg.K8sWarmPoolPrefix,
		Slots:          b.slots,
		Log:            b.log, // the backend names its component
	})
}
