package process

import (
	"strconv"
	"syscall"
)

// rlimit is one resource limit; every process of the sandbox inherits it.
type rlimit struct {
	name     string // prlimit(1) option
	resource int
	value    uint64
}

// rlimitNProc is RLIMIT_NPROC (missing from package syscall).
const rlimitNProc = 6

func (b *Backend) rlimits() []rlimit {
	o := b.o
	return []rlimit{
		{"as", syscall.RLIMIT_AS, uint64(o.AddressSpace)},
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
func (b *Backend) prlimitArgs() []string {
	args := []string{b.prlimit}
	for _, l := range b.rlimits() {
		v := l.value
		var cur syscall.Rlimit
		if err := syscall.Getrlimit(l.resource, &cur); err == nil && cur.Max < v {
			v = cur.Max
		}
		args = append(args, "--"+l.name+"="+strconv.FormatUint(v, 10))
	}
	return append(args, "--")
}
