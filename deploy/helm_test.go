package deploy

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/util/yaml"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/kube"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

const chart = "helm/sandbox-broker"

// kubeVersion is the cluster version lint and template assume (the chart
// requires one; helm built from source defaults to an old one).
const kubeVersion = "1.37.0"

// needHelm finds the helm binary ($HELM, else PATH): CI must have it
// (.ci/run builds it with tests/k8s/cluster.sh helm), elsewhere the test
// skips.
func needHelm(t *testing.T) string {
	t.Helper()
	h := os.Getenv("HELM")
	if h == "" {
		h, _ = exec.LookPath("helm")
	}
	if h == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI=true but helm is missing (tests/k8s/cluster.sh helm builds it; set HELM)")
		}
		t.Skip("helm not found (tests/k8s/cluster.sh helm builds it; set HELM)")
	}
	return h
}

// render runs helm template and returns the documents by kind.
func render(t *testing.T, helm string, args ...string) map[string][][]byte {
	t.Helper()
	cmd := exec.Command(helm, append([]string{"template", "rel", chart, "--namespace", "brokers", "--kube-version", kubeVersion}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, out)
	}
	docs := map[string][][]byte{}
	r := yaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(out)))
	for {
		doc, err := r.Read()
		if err != nil {
			break
		}
		var meta struct{ Kind string }
		if err := sigsyaml.Unmarshal(doc, &meta); err != nil {
			t.Fatalf("rendered YAML: %v\n%s", err, doc)
		}
		if meta.Kind != "" {
			docs[meta.Kind] = append(docs[meta.Kind], doc)
		}
	}
	return docs
}

// The chart lints, and what it renders keeps the broker's rights in the
// sandbox namespace and its sandboxes' pod template what the backend
// builds.
func TestHelmChart(t *testing.T) {
	helm := needHelm(t)
	for _, set := range [][]string{nil, {"--set", "warmPools.enabled=true"}} {
		if out, err := exec.Command(helm, append([]string{"lint", "--strict", "--kube-version", kubeVersion, chart}, set...)...).CombinedOutput(); err != nil {
			t.Fatalf("helm lint %v: %v\n%s", set, err, out)
		}
	}
	docs := render(t, helm, "--set", "warmPools.enabled=true", "--set", "sandbox.seccomp=Localhost/sandbox-broker.json")

	if len(docs["ClusterRole"])+len(docs["ClusterRoleBinding"]) > 0 {
		t.Error("the chart grants cluster-wide rights")
	}
	if len(docs["Role"]) != 1 || len(docs["RoleBinding"]) != 1 {
		t.Fatalf("roles: %d, bindings: %d", len(docs["Role"]), len(docs["RoleBinding"]))
	}
	var role rbacv1.Role
	mustUnmarshal(t, docs["Role"][0], &role)
	if role.Namespace != "sandboxes" {
		t.Errorf("the Role is in %q, not the sandbox namespace", role.Namespace)
	}
	for _, r := range role.Rules {
		for _, s := range append(append(r.Verbs, r.Resources...), r.APIGroups...) {
			if s == "*" {
				t.Errorf("wildcard in rule %+v", r)
			}
		}
		if slices.Contains(r.Resources, "secrets") || slices.Contains(r.Resources, "pods/exec") || slices.Contains(r.Resources, "pods/attach") {
			t.Errorf("the broker may touch %v", r.Resources)
		}
	}

	var dep appsv1.Deployment
	mustUnmarshal(t, docs["Deployment"][0], &dep)
	env := map[string]string{}
	for _, e := range dep.Spec.Template.Spec.Containers[0].Env {
		env[e.Name] = e.Value
	}
	if env["SANDBOX_BACKEND"] != "kubernetes" || env["SANDBOX_K8S_NAMESPACE"] != "sandboxes" || env["SANDBOX_K8S_BROKER_NAMESPACE"] != "brokers" {
		t.Errorf("broker env %v", env)
	}
	// The broker's DNS-rebinding guard must let in its Service's name and the
	// kubelet's probes (which would send the pod IP as Host).
	cfg := config.Defaults()
	cfg.AllowedHosts = strings.Split(env["MCP_ALLOWED_HOSTS"], ",")
	hosts := cfg.BrokerHosts()
	if !hosts["rel-sandbox-broker.brokers.svc.cluster.local"] || !hosts["rel-sandbox-broker"] {
		t.Errorf("MCP_ALLOWED_HOSTS %q leaves out the Service", env["MCP_ALLOWED_HOSTS"])
	}
	broker := dep.Spec.Template.Spec.Containers[0]
	for _, p := range []*corev1.Probe{broker.ReadinessProbe, broker.LivenessProbe} {
		if p == nil || p.HTTPGet == nil || len(p.HTTPGet.HTTPHeaders) != 1 || p.HTTPGet.HTTPHeaders[0].Name != "Host" || !hosts[p.HTTPGet.HTTPHeaders[0].Value] {
			t.Errorf("probe %+v: its Host is refused by the broker", p)
		}
	}
	sc := dep.Spec.Template.Spec.Containers[0].SecurityContext
	if sc == nil || *sc.AllowPrivilegeEscalation || !*sc.ReadOnlyRootFilesystem || sc.Capabilities.Drop[0] != "ALL" {
		t.Errorf("broker container security context %+v", sc)
	}

	// Every warm pool's pod template is the backend's own, for the same
	// settings.
	type sandboxTemplate struct {
		Spec struct {
			PodTemplate struct {
				Metadata struct{ Labels map[string]string }
				Spec     corev1.PodSpec
			} `json:"podTemplate"`
		}
	}
	var tmpls []sandboxTemplate
	for _, d := range docs["SandboxTemplate"] {
		var x sandboxTemplate
		mustUnmarshal(t, d, &x)
		tmpls = append(tmpls, x)
	}
	if len(tmpls) != 2 || len(docs["SandboxWarmPool"]) != 2 {
		t.Fatalf("warm pools: %d templates, %d pools", len(tmpls), len(docs["SandboxWarmPool"]))
	}
	runners, err := kube.ParseRunners(env["SANDBOX_K8S_RUNNERS"])
	if err != nil {
		t.Fatal(err)
	}
	o := kube.Options{Runners: runners, AgentImage: "sandbox-broker:latest", ImagePullPolicy: corev1.PullIfNotPresent,
		Seccomp: "Localhost/sandbox-broker.json", WorkspaceLimits: workspace.Limits{MaxBytes: 512 << 20}}
	for i, lang := range []string{"python", "bash"} {
		want, err := kube.TemplatePodSpec(o, lang)
		if err != nil {
			t.Fatal(err)
		}
		got := tmpls[i].Spec.PodTemplate.Spec
		if !equality.Semantic.DeepEqual(got, want) {
			g, _ := sigsyaml.Marshal(got)
			w, _ := sigsyaml.Marshal(want)
			t.Errorf("%s: the chart's pod template differs from the backend's:\n--- chart\n%s\n--- backend\n%s", lang, g, w)
		}
		if l := tmpls[i].Spec.PodTemplate.Metadata.Labels; l[kube.LabelRole] != kube.RoleSandbox || l[kube.LabelManagedBy] != kube.ManagedBy {
			t.Errorf("%s: template labels %v (the network policy selects on them)", lang, l)
		}
	}
}

func mustUnmarshal(t *testing.T, doc []byte, v any) {
	t.Helper()
	if err := sigsyaml.Unmarshal(doc, v); err != nil {
		t.Fatalf("%v\n%s", err, doc)
	}
}
