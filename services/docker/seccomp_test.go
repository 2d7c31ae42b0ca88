package docker

import (
	"encoding/json"
	"slices"
	"testing"
)

func TestSeccompProfile(t *testing.T) {
	for _, rt := range []string{"", RuntimeRunsc} {
		t.Run("runtime="+rt, func(t *testing.T) { checkSeccompProfile(t, rt) })
	}
}

func checkSeccompProfile(t *testing.T, runtime string) {
	var p seccompProfile
	if err := json.Unmarshal([]byte(SeccompProfileJSON(runtime)), &p); err != nil {
		t.Fatalf("profile is not valid JSON: %v", err)
	}
	if p.DefaultAction != "SCMP_ACT_ERRNO" {
		t.Fatalf("defaultAction = %q, want SCMP_ACT_ERRNO", p.DefaultAction)
	}
	allowed := map[string][]seccompSyscall{} // name → ALLOW rules
	denied := map[string]seccompSyscall{}
	for _, r := range p.Syscalls {
		for _, n := range r.Names {
			switch r.Action {
			case "SCMP_ACT_ALLOW":
				allowed[n] = append(allowed[n], r)
			case "SCMP_ACT_ERRNO":
				denied[n] = r
			default:
				t.Errorf("unexpected action %q for %s", r.Action, n)
			}
		}
	}
	for _, n := range ioUringSyscalls {
		if len(allowed[n]) > 0 {
			t.Errorf("%s is allowed", n)
		}
		r, ok := denied[n]
		if !ok || r.ErrnoRet == nil || *r.ErrnoRet != errnoEPERM {
			t.Errorf("%s: no explicit ERRNO(EPERM) rule: %+v", n, r)
		}
	}
	// Namespace creation stays blocked: unshare/setns never allowed, clone
	// only with every CLONE_NEW* bit (CLONE_NEWUSER included) masked to 0.
	for _, n := range forbiddenSyscalls {
		if n == "clone" || n == "personality" || (n == "clone3" && runtime == RuntimeRunsc) {
			continue
		}
		if len(allowed[n]) > 0 {
			t.Errorf("%s is allowed", n)
		}
	}
	const cloneNewUser = 0x10000000
	if len(allowed["clone"]) != 1 {
		t.Fatalf("clone rules: %+v", allowed["clone"])
	}
	cr := allowed["clone"][0]
	if len(cr.Args) != 1 || cr.Args[0].Index != 0 || cr.Args[0].Op != "SCMP_CMP_MASKED_EQ" ||
		cr.Args[0].Value&cloneNewUser == 0 || cr.Args[0].Value != 0x7E020000 || cr.Args[0].ValueTwo != 0 {
		t.Errorf("clone rule does not block namespace flags: %+v", cr.Args)
	}
	if runtime == RuntimeRunsc {
		// runsc makes every ERRNO rule EPERM, which libc does not fall
		// back from: clone3 must be allowed, without arguments to inspect.
		if _, ok := denied["clone3"]; ok || len(allowed["clone3"]) != 1 || len(allowed["clone3"][0].Args) != 0 {
			t.Errorf("runsc: clone3 must be allowed: %+v %+v", allowed["clone3"], denied["clone3"])
		}
	} else if r, ok := denied["clone3"]; !ok || r.ErrnoRet == nil || *r.ErrnoRet != errnoENOSYS || len(allowed["clone3"]) != 0 {
		t.Errorf("clone3 must fail with ENOSYS: %+v", r)
	}
	for _, r := range allowed["personality"] {
		if len(r.Args) != 1 || r.Args[0].Op != "SCMP_CMP_EQ" {
			t.Errorf("personality allowed without an argument filter: %+v", r)
		}
	}
	for _, need := range []string{"read", "write", "execve", "openat", "mmap", "futex", "wait4", "exit_group", "rt_sigreturn"} {
		if len(allowed[need]) == 0 {
			t.Errorf("%s is not allowed", need)
		}
	}
	if !slices.ContainsFunc(p.ArchMap, func(a seccompArchMap) bool { return a.Arch == "SCMP_ARCH_X86_64" }) {
		t.Error("no x86_64 arch map")
	}
}
