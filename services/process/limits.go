package process

import (
	"slices"
	"strconv"
	"syscall"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// rlimit is one resource limit; every process of the sandbox inherits it.
type rlimit struct {
	name     string // prlimit(1) option
	resource int
	value    uint64
}

// rlimitNProc is RLIMIT_NPROC (missing from package syscall).
const rlimitNProc = 6

func (b *Backend) rlimits(r *runner) []rlimit {
	o := b.o
	return []rlimit{
		{"as", syscall.RLIMIT_AS, uint64(b.addressSpace(r))},
		{"cpu", syscall.RLIMIT_CPU, uint64(o.CPUSeconds)},
		{"nofile", syscall.RLIMIT_NOFILE, uint64(o.NoFile)},
		{"nproc", rlimitNProc, uint64(o.NProc)},
		{"fsize", syscall.RLIMIT_FSIZE, uint64(o.FSizeBytes)},
		{"core", syscall.RLIMIT_CORE, 0},
	}
}

// prlimitArgs is the prlimit(1) prefix that sets soft and hard limits on
// itself, as the sandbox uid, before it execs bwrap. The process lowers its
// own limits, which needs no privilege (the broker may lack
// CAP_SYS_RESOURCE, which setting another uid's limits would need). A
// limit above the broker's own hard limit is clamped to it, since raising
// one would be refused.
func (b *Backend) prlimitArgs(r *runner) []string {
	args := []string{b.prlimit}
	for _, l := range b.rlimits(r) {
		v := l.value
		var cur syscall.Rlimit
		if err := syscall.Getrlimit(l.resource, &cur); err == nil && cur.Max < v {
			v = cur.Max
		}
		args = append(args, "--"+l.name+"="+strconv.FormatUint(v, 10))
	}
	return append(args, "--")
}

// nodeAddressSpace is RLIMIT_AS for a runner file system's Node runners:
// V8 reserves about 50 GiB of address space for WebAssembly's guard
// regions, and tsx loads WebAssembly lexers, so below that every
// TypeScript run fails ("WebAssembly.instantiate(): Out of memory"). The
// Docker backend sets no RLIMIT_AS at all; memory stays bounded by the
// cgroup.
const nodeAddressSpace = 64 << 30

var nodeLanguages = []string{agent.LangTypeScript, agent.LangJavaScript, agent.LangNode}

// addressSpace is RLIMIT_AS for r's sandboxes.
func (b *Backend) addressSpace(r *runner) int64 {
	if r.fs != nil && slices.Contains(nodeLanguages, r.lang) {
		return max(b.o.AddressSpace, nodeAddressSpace)
	}
	return b.o.AddressSpace
}
