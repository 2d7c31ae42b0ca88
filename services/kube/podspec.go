package kube

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// In-pod paths and names.
const (
	AgentDir       = "/opt/sandbox"
	AgentPath      = AgentDir + "/broker"
	WorkspacePath  = agent.WorkDir // /mnt/data
	ContainerName  = "agent"
	CAConfigMap    = "sandbox-broker-ca"
	CAConfigKey    = "ca.crt"
	NetworkPolicy  = "sandbox-broker-sandboxes"
	tmpBytes       = 64 << 20
	agentBinBytes  = 256 << 20
	workspaceSlack = 64 << 20 // the volume's limit above the quota: the broker's check comes first
)

// Seccomp settings.
const (
	SeccompRuntimeDefault = "RuntimeDefault"
	SeccompLocalhost      = "Localhost/"
)

var getOpts = metav1.GetOptions{}

// seccompProfile parses Options.Seccomp.
func seccompProfile(s string) (corev1.SeccompProfileType, string, error) {
	if s == SeccompRuntimeDefault {
		return corev1.SeccompProfileTypeRuntimeDefault, "", nil
	}
	if p, ok := strings.CutPrefix(s, SeccompLocalhost); ok && p != "" && !strings.HasPrefix(p, "/") && !strings.Contains(p, "..") {
		return corev1.SeccompProfileTypeLocalhost, p, nil
	}
	return "", "", fmt.Errorf("kube: seccomp %q: want %s or %s<profile path>", s, SeccompRuntimeDefault, SeccompLocalhost)
}

// sessionLabel is the value of LabelSession: a hash, since the workspace
// ID appears in signed links and pod labels are widely readable.
func sessionLabel(workspaceID string) string {
	h := sha256.Sum256([]byte("sandbox-broker session " + workspaceID))
	return hex.EncodeToString(h[:12])
}

// podLabels are a session pod's labels.
func (b *Backend) podLabels(workspaceID, lang string) map[string]string {
	return map[string]string{
		LabelManagedBy: ManagedBy,
		LabelRole:      RoleSandbox,
		LabelInstance:  b.o.InstanceID,
		LabelSession:   sessionLabel(workspaceID),
		LabelLanguage:  lang,
	}
}

// hardened is the container security context of every container in a
// sandbox pod (Pod Security Standards "restricted", and more).
func (b *Backend) hardened() *corev1.SecurityContext {
	no, yes := false, true
	return &corev1.SecurityContext{
		AllowPrivilegeEscalation: &no,
		Privileged:               &no,
		ReadOnlyRootFilesystem:   &yes,
		RunAsNonRoot:             &yes,
		RunAsUser:                &b.o.UID,
		RunAsGroup:               &b.o.UID,
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		ProcMount:                ptr(corev1.DefaultProcMount),
	}
}

// podSpec is a sandbox pod for lang: the agent, copied from the broker's
// image by an init container, runs in the runner image as the fixed
// non-root uid with a read-only root, no capabilities, seccomp, no service
// account token and no host namespaces or mounts; its workspace and /tmp
// are emptyDirs with size limits.
func (b *Backend) podSpec(lang, image string) corev1.PodSpec {
	yes, no := true, false
	typ, profile, _ := seccompProfile(b.o.Seccomp)
	sp := &corev1.SeccompProfile{Type: typ}
	if profile != "" {
		sp.LocalhostProfile = &profile
	}
	wsBytes := b.o.WorkspaceLimits.MaxBytes
	mem := resource.NewQuantity(b.o.Memory, resource.BinarySI)
	cpu := resource.NewMilliQuantity(b.o.CPUMilli, resource.DecimalSI)
	eph := resource.NewQuantity(wsBytes+workspaceSlack+agentBinBytes, resource.BinarySI)
	deadline := int64(b.o.MaxAge.Seconds())
	grace := int64(1)
	spec := corev1.PodSpec{
		AutomountServiceAccountToken:  &no,
		EnableServiceLinks:            &no,
		RestartPolicy:                 corev1.RestartPolicyNever,
		TerminationGracePeriodSeconds: &grace,
		ActiveDeadlineSeconds:         &deadline,
		Hostname:                      "sandbox",
		// No cluster DNS: the pod may not talk to anything but the broker,
		// and the resolver names nothing of the cluster.
		DNSPolicy: corev1.DNSNone,
		DNSConfig: &corev1.PodDNSConfig{Nameservers: []string{"127.0.0.1"}},
		SecurityContext: &corev1.PodSecurityContext{
			RunAsNonRoot:   &yes,
			RunAsUser:      &b.o.UID,
			RunAsGroup:     &b.o.UID,
			FSGroup:        &b.o.UID,
			SeccompProfile: sp,
		},
		InitContainers: []corev1.Container{{
			Name:            "install-agent",
			Image:           b.o.AgentImage,
			ImagePullPolicy: b.o.ImagePullPolicy,
			Command:         []string{b.o.AgentImagePath, "agent", "install", AgentPath},
			VolumeMounts:    []corev1.VolumeMount{{Name: "agent", MountPath: AgentDir}},
			SecurityContext: b.hardened(),
			Resources: corev1.ResourceRequirements{
				Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
			},
		}},
		Containers: []corev1.Container{{
			Name:            ContainerName,
			Image:           image,
			ImagePullPolicy: b.o.ImagePullPolicy,
			Command:         []string{AgentPath, "agent", "--listen", ":" + strconv.Itoa(agent.PodPort), "--language", lang, "--workdir", WorkspacePath},
			WorkingDir:      WorkspacePath,
			Ports:           []corev1.ContainerPort{{Name: "agent", ContainerPort: agent.PodPort, Protocol: corev1.ProtocolTCP}},
			Env: []corev1.EnvVar{
				{Name: "PATH", Value: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
				{Name: "HOME", Value: "/tmp"},
				{Name: "LANG", Value: "C.UTF-8"},
				{Name: agent.CAEnv, ValueFrom: &corev1.EnvVarSource{ConfigMapKeyRef: &corev1.ConfigMapKeySelector{
					LocalObjectReference: corev1.LocalObjectReference{Name: CAConfigMap}, Key: CAConfigKey}}},
			},
			VolumeMounts: []corev1.VolumeMount{
				{Name: "workspace", MountPath: WorkspacePath},
				{Name: "tmp", MountPath: "/tmp"},
				{Name: "agent", MountPath: AgentDir, ReadOnly: true},
			},
			SecurityContext: b.hardened(),
			Resources: corev1.ResourceRequirements{
				Limits: corev1.ResourceList{corev1.ResourceCPU: *cpu, corev1.ResourceMemory: *mem, corev1.ResourceEphemeralStorage: *eph},
				Requests: corev1.ResourceList{corev1.ResourceCPU: *resource.NewMilliQuantity(min(b.o.CPUMilli, 100), resource.DecimalSI),
					corev1.ResourceMemory: *mem, corev1.ResourceEphemeralStorage: resource.MustParse("64Mi")},
			},
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		}},
		Volumes: []corev1.Volume{
			{Name: "workspace", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{
				SizeLimit: resource.NewQuantity(wsBytes+workspaceSlack, resource.BinarySI)}}},
			{Name: "tmp", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{
				Medium: corev1.StorageMediumMemory, SizeLimit: resource.NewQuantity(tmpBytes, resource.BinarySI)}}},
			{Name: "agent", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{
				SizeLimit: resource.NewQuantity(agentBinBytes, resource.BinarySI)}}},
		},
	}
	if b.o.RuntimeClass != "" {
		spec.RuntimeClassName = &b.o.RuntimeClass
	}
	return spec
}

// TemplatePodSpec is the pod spec of a warm pool's SandboxTemplate for
// lang under o: a plain pod's, without the deadline (a warm pod waits; a
// claim carries its own shutdown time). The Helm chart's templates render
// the same (deploy/helm, checked by its test).
func TemplatePodSpec(o Options, lang string) (corev1.PodSpec, error) {
	b := &Backend{o: o.withDefaults()}
	image, err := b.image(lang)
	if err != nil {
		return corev1.PodSpec{}, err
	}
	spec := b.podSpec(lang, image)
	spec.ActiveDeadlineSeconds = nil
	return spec, nil
}

// networkPolicy selects every sandbox pod of the broker: ingress only from
// the broker to the agent's port, no egress at all (a job's network goes
// through tunnels the broker opens, see agent/tunnel.go).
func (b *Backend) networkPolicy() (*networkingv1.NetworkPolicy, error) {
	var from []networkingv1.NetworkPolicyPeer
	if len(b.o.Peer.Labels) > 0 {
		ns := b.o.Peer.Namespace
		if ns == "" {
			ns = b.o.Namespace
		}
		from = append(from, networkingv1.NetworkPolicyPeer{
			NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": ns}},
			PodSelector:       &metav1.LabelSelector{MatchLabels: b.o.Peer.Labels},
		})
	}
	if b.o.Peer.CIDR != "" {
		from = append(from, networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: b.o.Peer.CIDR}})
	}
	if len(from) == 0 {
		return nil, fmt.Errorf("kube: the broker's pod labels or address block are needed for the network policy")
	}
	tcp := corev1.ProtocolTCP
	port := intstr.FromInt32(agent.PodPort)
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: NetworkPolicy, Namespace: b.o.Namespace, Labels: map[string]string{LabelManagedBy: ManagedBy}},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{LabelManagedBy: ManagedBy, LabelRole: RoleSandbox}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
			Ingress:     []networkingv1.NetworkPolicyIngressRule{{From: from, Ports: []networkingv1.NetworkPolicyPort{{Protocol: &tcp, Port: &port}}}},
			Egress:      []networkingv1.NetworkPolicyEgressRule{},
		},
	}, nil
}

// applyNetworkPolicy creates the network policy, or updates it to what
// this broker wants.
func (b *Backend) applyNetworkPolicy(ctx context.Context) error {
	want, err := b.networkPolicy()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	api := b.cs.NetworkingV1().NetworkPolicies(b.o.Namespace)
	have, err := api.Get(ctx, NetworkPolicy, getOpts)
	switch {
	case apierrors.IsNotFound(err):
		_, err = api.Create(ctx, want, metav1.CreateOptions{})
	case err == nil:
		have.Spec = want.Spec
		_, err = api.Update(ctx, have, metav1.UpdateOptions{})
	}
	if err != nil {
		return apiError(err, "cannot apply the sandbox network policy")
	}
	return nil
}

// publishCA puts the CA certificate where pods read it (CAConfigMap).
func (b *Backend) publishCA(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	api := b.cs.CoreV1().ConfigMaps(b.o.Namespace)
	data := map[string]string{CAConfigKey: string(b.o.CA.CertPEM())}
	have, err := api.Get(ctx, CAConfigMap, getOpts)
	switch {
	case apierrors.IsNotFound(err):
		_, err = api.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: CAConfigMap, Namespace: b.o.Namespace,
			Labels: map[string]string{LabelManagedBy: ManagedBy}}, Data: data}, metav1.CreateOptions{})
	case err == nil && have.Data[CAConfigKey] != data[CAConfigKey]:
		b.log.Warn().Msg("sandbox_ca_changed") // pods of the old CA cannot enrol: warm pools need recycling
		have.Data = data
		_, err = api.Update(ctx, have, metav1.UpdateOptions{})
	}
	if err != nil {
		return apiError(err, "cannot publish the sandbox CA")
	}
	return nil
}

func ptr[T any](v T) *T { return &v }
