package sandbox

import (
	"slices"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

func TestIDs(t *testing.T) {
	seen := map[string]bool{}
	for range 100 {
		id := NewID()
		if !ValidID(id) || seen[id] {
			t.Fatalf("NewID gave %q (seen before: %v)", id, seen[id])
		}
		seen[id] = true
	}
	for _, bad := range []string{"", "0123456789abcde", "0123456789abcdef0", "0123456789ABCDEF", "0123456789abcdeg", "../../../../etc/"} {
		if ValidID(bad) {
			t.Errorf("ValidID(%q)", bad)
		}
	}
}

func TestCheckRef(t *testing.T) {
	if err := CheckRef(SessionRef{WorkspaceID: "0123abcd", Dir: "/root/workspaces/0123abcd"}); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []SessionRef{
		{WorkspaceID: "", Dir: "/w/x"},
		{WorkspaceID: "a/b", Dir: "/w/x"},
		{WorkspaceID: "..", Dir: "/w/x"},
		{WorkspaceID: "pool", Dir: "/w/pool"}, // the backends' own directory names
		{WorkspaceID: "probe", Dir: "/w/probe"},
		{WorkspaceID: "x", Dir: ""},
		{WorkspaceID: "x", Dir: "relative/x"},
		{WorkspaceID: "x", Dir: "/w/../x"},
		{WorkspaceID: "x", Dir: "/w/x/"},
	} {
		if err := CheckRef(ref); brokererr.As(err) == nil {
			t.Errorf("CheckRef(%+v) = %v", ref, err)
		}
	}
}

func TestEnvList(t *testing.T) {
	got := JobSpec{Env: map[string]string{"B": "2", "A": "1=x", "C": ""}}.EnvList()
	if want := []string{"A=1=x", "B=2", "C="}; !slices.Equal(got, want) {
		t.Fatalf("EnvList = %q, want %q", got, want)
	}
}
