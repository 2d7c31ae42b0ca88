package kube

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestParseRunners(t *testing.T) {
	m, err := ParseRunners(" python=reg/runner-python:1 , bash=reg/runner-bash@sha256:ab ,")
	if err != nil || len(m) != 2 || m["python"] != "reg/runner-python:1" || m["bash"] != "reg/runner-bash@sha256:ab" {
		t.Fatalf("%v, %v", m, err)
	}
	for _, bad := range []string{"", ",", "python", "python=", "=img", "Python=img", "py thon=img", "python=a b", "python=a,python=b", "../x=img"} {
		if _, err := ParseRunners(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func FuzzParseRunners(f *testing.F) {
	f.Add("python=sandbox-broker/runner-python:latest,bash=x")
	f.Add("a=b=c,,")
	f.Fuzz(func(t *testing.T, s string) {
		m, err := ParseRunners(s)
		if err != nil {
			return
		}
		for lang, img := range m {
			if !validLanguage(lang) || img == "" || strings.ContainsAny(img, " \t,") {
				t.Fatalf("accepted %q=%q", lang, img)
			}
		}
	})
}

func TestSeccompSetting(t *testing.T) {
	for in, want := range map[string]corev1.SeccompProfileType{
		"RuntimeDefault": corev1.SeccompProfileTypeRuntimeDefault, "Localhost/profiles/sbx.json": corev1.SeccompProfileTypeLocalhost,
	} {
		if got, _, err := seccompProfile(in); err != nil || got != want {
			t.Errorf("%q: %v, %v", in, got, err)
		}
	}
	for _, bad := range []string{"", "Unconfined", "Localhost/", "Localhost//etc/x", "Localhost/../x", "runtimedefault"} {
		if _, _, err := seccompProfile(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// The network policy needs to know who the broker is: without labels or
// an address block New refuses rather than lock every pod out (or in).
func TestNetworkPolicyNeedsThePeer(t *testing.T) {
	b := &Backend{o: Options{Namespace: "ns"}.withDefaults()}
	if _, err := b.networkPolicy(); err == nil {
		t.Fatal("a policy without the broker as peer")
	}
	b.o.Peer = Peer{Labels: map[string]string{"app": "broker"}, Namespace: "brokers"}
	np, err := b.networkPolicy()
	if err != nil {
		t.Fatal(err)
	}
	from := np.Spec.Ingress[0].From[0]
	if from.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] != "brokers" || from.PodSelector.MatchLabels["app"] != "broker" ||
		len(np.Spec.Egress) != 0 || len(np.Spec.PolicyTypes) != 2 {
		t.Fatalf("policy %+v", np.Spec)
	}
}

// The session label is a hash: the workspace ID (a secret in signed links)
// never appears in a pod's labels.
func TestSessionLabelHidesTheWorkspaceID(t *testing.T) {
	id := "0123456789abcdef0123456789abcdef"
	l := sessionLabel(id)
	if strings.Contains(l, id[:8]) || len(l) > 63 || l != sessionLabel(id) || l == sessionLabel(id+"x") {
		t.Fatalf("label %q", l)
	}
}
