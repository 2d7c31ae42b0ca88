// Package kube is the Kubernetes backend (SANDBOX_BACKEND=kubernetes):
// every session's sandbox is a pod per language in one namespace, claimed
// from an agent-sandbox SandboxWarmPool through a SandboxClaim when those
// CRDs are installed and a pool exists for the language, else created as a
// plain Pod. The pod runs the agent binary as the in-sandbox agent
// (agent.Binary, copied from the broker's image by an init container: no
// host mounts),
// which the broker reaches over the pod network with mutual TLS (per-pod
// certificates from the broker CA, services/podca), never through the
// Kubernetes API's exec. The broker keeps each workspace on its own disk,
// as the other backends do, and keeps the pods' copies in step (sync.go),
// so a pod is disposable compute: an evicted or released pod loses nothing
// that was synced.
package kube

import (
	"context"
	"crypto/tls"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/podca"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Labels on everything the backend creates.
const (
	LabelManagedBy = "app.kubernetes.io/managed-by" // ManagedBy
	LabelInstance  = "sandbox-broker.dev/instance"  // Options.InstanceID
	LabelSession   = "sandbox-broker.dev/session"   // a hash of the workspace ID (the ID itself is a secret)
	LabelLanguage  = "sandbox-broker.dev/language"
	LabelRole      = "sandbox-broker.dev/role" // RoleSandbox on sandbox pods
	ManagedBy      = "sandbox-broker"
	RoleSandbox    = "sandbox"
)

// Options configure a Backend. Zero numeric fields take defaults.
type Options struct {
	Config    *rest.Config // the cluster (in-cluster, or a kubeconfig)
	Namespace string       // where sandbox pods live (required)
	// Runners maps each language to its runner image (required).
	Runners map[string]string
	// AgentImage holds the broker binary at AgentImagePath; an init
	// container runs its `agent install`, which copies the agent binary
	// (the agent built alone beside it, else itself) into the pod.
	AgentImage      string
	AgentImagePath  string            // default /usr/local/bin/sandbox-broker
	ImagePullPolicy corev1.PullPolicy // default IfNotPresent
	// RuntimeClass, when set, is the pods' runtimeClassName (gvisor).
	RuntimeClass string
	// Seccomp is "RuntimeDefault" (default) or "Localhost/<profile path
	// under the kubelet's seccomp root>".
	Seccomp string
	// UID runs every sandbox pod (and its group and fsGroup); default 65532.
	UID int64
	// Memory (bytes) and CPU (thousandths) limit each pod; defaults 512
	// MiB and 1000.
	Memory   int64
	CPUMilli int64
	// WorkspaceLimits is each session's quota; zero fields take defaults.
	// The pod's workspace volume is limited to MaxBytes plus a margin.
	WorkspaceLimits workspace.Limits
	// MaxAge bounds a pod's life (activeDeadlineSeconds), so a pod the
	// broker lost track of ends on its own; default 24 h.
	MaxAge time.Duration
	// ReadyTimeout bounds a pod's start to its agent's enrolment
	// (default 2 min: images may be pulled).
	ReadyTimeout time.Duration
	// CA issues the pods' and the broker's certificates (required).
	CA *podca.CA
	// InstanceID labels this broker process's pods; default random.
	InstanceID string
	// Peer is who may reach the pods (the network policy's only ingress).
	Peer Peer
	// WarmPoolPrefix names the SandboxWarmPool a language is claimed
	// from: prefix + language (default "sandbox-broker-").
	WarmPoolPrefix string
	// Slots caps live sandboxes across engines; nil means no cap.
	Slots *sandbox.Slots
	Log   zerolog.Logger
}

// Peer describes the broker for the network policy: its pods (by labels,
// in a namespace), and/or an address block when it runs outside the
// cluster.
type Peer struct {
	Namespace string
	Labels    map[string]string
	CIDR      string
}

const (
	defaultUID          = 65532
	defaultMemory       = 512 << 20
	defaultCPUMilli     = 1000
	defaultMaxAge       = 24 * time.Hour
	defaultReadyTimeout = 2 * time.Minute
	defaultAgentPath    = "/usr/local/bin/sandbox-broker"
	defaultPoolPrefix   = "sandbox-broker-"
	apiTimeout          = 30 * time.Second
	defaultExecTimeout  = 30 * time.Second
	hardStopMargin      = 5 * time.Second
)

// Backend is the Kubernetes backend. It implements sandbox.Backend.
type Backend struct {
	o   Options
	cs  kubernetes.Interface
	dyn dynamic.Interface
	log zerolog.Logger
	tls *tls.Config // the broker's side: client certificate and CA

	pools map[string]string // language → warm pool, when claims are used

	mu      sync.Mutex
	closed  bool
	kernels sandbox.KernelLedgers
	ctx     context.Context // cancelled by Close
	cancel  context.CancelFunc
	bg      sync.WaitGroup
	client  clientCert
}

var _ sandbox.Backend = (*Backend)(nil)

// New connects to the cluster, publishes the CA to the namespace, applies
// the network policy, finds the warm pools, sweeps what earlier broker
// processes left and starts renewing this process's lease.
func New(ctx context.Context, o Options) (*Backend, error) {
	if o.Config == nil || o.Namespace == "" || len(o.Runners) == 0 || o.AgentImage == "" || o.CA == nil {
		return nil, fmt.Errorf("kube: Config, Namespace, Runners, AgentImage and CA are required")
	}
	for lang, img := range o.Runners {
		if !validLanguage(lang) || img == "" {
			return nil, fmt.Errorf("kube: bad runner %q=%q", lang, img)
		}
	}
	o = o.withDefaults()
	if _, _, err := seccompProfile(o.Seccomp); err != nil {
		return nil, err
	}
	cfg := rest.CopyConfig(o.Config)
	cfg.Timeout = apiTimeout
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kube: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kube: %w", err)
	}
	b := &Backend{o: o, cs: cs, dyn: dyn, log: logging.Component(o.Log, "kubernetes")}
	b.client.ca = o.CA
	b.tls = &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: o.CA.Pool(), GetClientCertificate: b.client.get}
	b.ctx, b.cancel = context.WithCancel(context.Background())
	if err := b.setUp(ctx); err != nil {
		b.cancel()
		return nil, err
	}
	return b, nil
}

// withDefaults fills the zero fields.
func (o Options) withDefaults() Options {
	if o.AgentImagePath == "" {
		o.AgentImagePath = defaultAgentPath
	}
	if o.ImagePullPolicy == "" {
		o.ImagePullPolicy = corev1.PullIfNotPresent
	}
	if o.Seccomp == "" {
		o.Seccomp = SeccompRuntimeDefault
	}
	if o.UID <= 0 {
		o.UID = defaultUID
	}
	if o.Memory <= 0 {
		o.Memory = defaultMemory
	}
	if o.CPUMilli <= 0 {
		o.CPUMilli = defaultCPUMilli
	}
	if o.MaxAge <= 0 {
		o.MaxAge = defaultMaxAge
	}
	if o.ReadyTimeout <= 0 {
		o.ReadyTimeout = defaultReadyTimeout
	}
	if o.InstanceID == "" {
		o.InstanceID = sandbox.NewID()
	}
	if o.WarmPoolPrefix == "" {
		o.WarmPoolPrefix = defaultPoolPrefix
	}
	o.WorkspaceLimits = o.WorkspaceLimits.WithDefaults()
	return o
}

// setUp does New's work against the API.
func (b *Backend) setUp(ctx context.Context) error {
	if err := b.Ping(ctx); err != nil {
		return err
	}
	if err := b.publishCA(ctx); err != nil {
		return err
	}
	if err := b.applyNetworkPolicy(ctx); err != nil {
		return err
	}
	pools, err := b.findWarmPools(ctx)
	if err != nil {
		return err
	}
	b.pools = pools
	for lang, pool := range pools {
		b.log.Info().Str("language", lang).Str("warm_pool", pool).Msg("sandbox_claims_from_warm_pool")
	}
	if err := b.renewLease(ctx); err != nil {
		return err
	}
	b.sweep(ctx)
	b.bg.Add(1)
	go b.housekeeping()
	return nil
}

// Name implements sandbox.Backend.
func (b *Backend) Name() string { return "kubernetes" }

// Ping implements sandbox.Backend: the API answers in the sandbox
// namespace (the broker's rights end there, so it lists pods, at most one).
func (b *Backend) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	if _, err := b.cs.CoreV1().Pods(b.o.Namespace).List(ctx, metav1.ListOptions{Limit: 1, LabelSelector: LabelManagedBy + "=" + ManagedBy}); err != nil {
		return apiError(err, "the sandbox namespace %q cannot be read", b.o.Namespace)
	}
	return nil
}

// Runners implements sandbox.Backend.
func (b *Backend) Runners(context.Context) ([]sandbox.Runner, error) {
	out := make([]sandbox.Runner, 0, len(b.o.Runners))
	for lang, img := range b.o.Runners {
		out = append(out, sandbox.Runner{Language: lang, Image: img})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Language < out[j].Language })
	return out, nil
}

func (b *Backend) image(lang string) (string, error) {
	img, ok := b.o.Runners[lang]
	if !ok {
		return "", agent.UnknownLanguage(lang, maps.Keys(b.o.Runners))
	}
	return img, nil
}

// Close implements sandbox.Backend: it stops the background work and
// drops this process's lease. Sessions' pods are left to their sessions
// (and to the next sweep).
func (b *Backend) Close(ctx context.Context) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.mu.Unlock()
	b.cancel()
	b.bg.Wait()
	return nil
}

func (b *Backend) isClosed() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed
}

// ParseRunners parses SANDBOX_K8S_RUNNERS: "lang=image,lang=image".
func ParseRunners(s string) (map[string]string, error) {
	m := map[string]string{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		lang, img, ok := strings.Cut(part, "=")
		lang, img = strings.TrimSpace(lang), strings.TrimSpace(img)
		if !ok || !validLanguage(lang) || img == "" || strings.ContainsAny(img, " \t") {
			return nil, fmt.Errorf("SANDBOX_K8S_RUNNERS: %q is not language=image", part)
		}
		if _, dup := m[lang]; dup {
			return nil, fmt.Errorf("SANDBOX_K8S_RUNNERS: %s is named twice", lang)
		}
		m[lang] = img
	}
	if len(m) == 0 {
		return nil, fmt.Errorf("SANDBOX_K8S_RUNNERS names no runner")
	}
	return m, nil
}

// ParseLabels parses "k=v,k=v" (a label selector of equalities).
func ParseLabels(s string) (map[string]string, error) {
	m := map[string]string{}
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		k, v, ok := strings.Cut(part, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, fmt.Errorf("%q is not key=value", part)
		}
		m[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return m, nil
}

func validLanguage(s string) bool {
	return len(s) > 0 && len(s) <= 32 && !strings.ContainsFunc(s, func(c rune) bool {
		return !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-')
	})
}

// languages lists the runners' languages, sorted.
func (b *Backend) languages() []string { return slices.Sorted(maps.Keys(b.o.Runners)) }

// closedErr is the error of calls after Close.
func closedErr() error {
	return brokererr.New(brokererr.Unavailable, "the Kubernetes backend is shut down")
}
