package process

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// cgroupRoot is where cgroup hierarchies are mounted.
var cgroupRoot = "/sys/fs/cgroup"

// cgLimits are the per-sandbox cgroup limits.
type cgLimits struct {
	memory, pids, cpuMilli int64
}

// cgroupDriver creates one cgroup per sandbox under <hierarchy>/<tag>/:
// cgroup v2 when /sys/fs/cgroup is a writable unified hierarchy, else the
// v1 pids (+memory, +cpu) controllers when writable, else nothing (rlimits
// and the pid namespace still apply).
type cgroupDriver struct {
	v2   bool
	base []string // per-controller (v1) or single (v2) base directories; nil: unavailable
	log  zerolog.Logger
}

func newCgroupDriver(tag string, log zerolog.Logger) *cgroupDriver {
	d := &cgroupDriver{log: log}
	if _, err := os.Stat(filepath.Join(cgroupRoot, "cgroup.controllers")); err == nil {
		base := filepath.Join(cgroupRoot, tag)
		if err := mkdirCgroup(base); err != nil {
			log.Warn().Err(err).Msg("cgroup_unavailable")
			return d
		}
		// Let children use the controllers; what the parent does not
		// delegate stays off (limits are then best effort, logged once).
		for _, c := range []string{"+memory", "+pids", "+cpu"} {
			_ = os.WriteFile(filepath.Join(base, "cgroup.subtree_control"), []byte(c), 0)
		}
		d.v2, d.base = true, []string{base}
		return d
	}
	pidsBase := filepath.Join(cgroupRoot, "pids", tag)
	if err := mkdirCgroup(pidsBase); err != nil {
		log.Warn().Err(err).Msg("cgroup_unavailable")
		return d
	}
	d.base = []string{pidsBase}
	for _, c := range []string{"memory", "cpu"} {
		b := filepath.Join(cgroupRoot, c, tag)
		if mkdirCgroup(b) == nil {
			d.base = append(d.base, b)
		}
	}
	return d
}

func mkdirCgroup(p string) error {
	if err := os.Mkdir(p, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	return nil
}

func (d *cgroupDriver) available() bool { return d != nil && len(d.base) > 0 }

// cgroup is one sandbox's cgroup: one directory per hierarchy.
type cgroup struct {
	v2   bool
	dirs []string
}

// create makes the cgroup p-<id> and writes its limits. A limit the
// hierarchy does not offer is skipped and reported once per backend in
// the log, never fatal: the pid namespace and rlimits still hold.
func (d *cgroupDriver) create(id string, l cgLimits) (*cgroup, error) {
	if !d.available() {
		return nil, nil
	}
	cg := &cgroup{v2: d.v2}
	for _, b := range d.base {
		p := filepath.Join(b, "p-"+id)
		if err := os.Mkdir(p, 0o755); err != nil {
			cg.remove()
			return nil, err
		}
		cg.dirs = append(cg.dirs, p)
	}
	var missing []string
	set := func(file, val string) {
		for _, dir := range cg.dirs {
			f := filepath.Join(dir, file)
			if _, err := os.Stat(f); err == nil {
				if os.WriteFile(f, []byte(val), 0) == nil {
					return
				}
			}
		}
		missing = append(missing, file)
	}
	period := int64(100000)
	quota := l.cpuMilli * period / 1000
	if d.v2 {
		set("pids.max", strconv.FormatInt(l.pids, 10))
		set("memory.max", strconv.FormatInt(l.memory, 10))
		set("memory.swap.max", "0")
		set("cpu.max", fmt.Sprintf("%d %d", quota, period))
	} else {
		set("pids.max", strconv.FormatInt(l.pids, 10))
		set("memory.limit_in_bytes", strconv.FormatInt(l.memory, 10))
		set("memory.memsw.limit_in_bytes", strconv.FormatInt(l.memory, 10))
		set("cpu.cfs_period_us", strconv.FormatInt(period, 10))
		set("cpu.cfs_quota_us", strconv.FormatInt(quota, 10))
	}
	if len(missing) > 0 {
		warnOnce("cgroup_limits_missing:"+strings.Join(missing, ","), func() {
			d.log.Warn().Strs("limits", missing).Msg("cgroup_limits_unavailable")
		})
	}
	return cg, nil
}

// add moves pid into every hierarchy of the cgroup.
func (c *cgroup) add(pid int) error {
	if c == nil {
		return nil
	}
	for _, dir := range c.dirs {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return err
		}
	}
	return nil
}

// pids lists the cgroup's processes (host pids) from its first hierarchy
// (v2, or v1 pids).
func (c *cgroup) pids() []int {
	if c == nil || len(c.dirs) == 0 {
		return nil
	}
	return readPids(filepath.Join(c.dirs[0], "cgroup.procs"))
}

func readPids(file string) []int {
	b, err := agent.ReadProcFile(file)
	if err != nil {
		return nil
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			out = append(out, pid)
		}
	}
	return out
}

// killDirs SIGKILLs everything in a cgroup directory until it is empty or
// the deadline passes: cgroup.kill where the kernel has it, else rounds of
// kill(2) over cgroup.procs (a process with SIGKILL pending cannot fork).
func killDirs(dir string, wait time.Duration) bool {
	procs := filepath.Join(dir, "cgroup.procs")
	_ = os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0)
	deadline := time.Now().Add(wait)
	for {
		pids := readPids(procs)
		if len(pids) == 0 {
			return true
		}
		for _, p := range pids {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// kill empties the cgroup.
func (c *cgroup) kill(wait time.Duration) bool {
	if c == nil || len(c.dirs) == 0 {
		return true
	}
	return killDirs(c.dirs[0], wait)
}

// remove deletes the cgroup's directories (they must be empty).
func (c *cgroup) remove() error {
	if c == nil {
		return nil
	}
	var errs []error
	for _, dir := range c.dirs {
		if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// oomKills returns the memory controller's oom_kill count, or -1.
func (c *cgroup) oomKills() int64 {
	if c == nil {
		return -1
	}
	for _, dir := range c.dirs {
		for _, f := range []string{"memory.events", "memory.oom_control"} {
			b, err := agent.ReadProcFile(filepath.Join(dir, f))
			if err != nil {
				continue
			}
			if n, ok := parseCounter(string(b), "oom_kill"); ok {
				return n
			}
		}
	}
	return -1
}

// parseCounter finds "key N" in a flat-keyed cgroup file.
func parseCounter(s, key string) (int64, bool) {
	for line := range strings.SplitSeq(s, "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && f[0] == key {
			n, err := strconv.ParseInt(f[1], 10, 64)
			if err == nil && n >= 0 {
				return n, true
			}
		}
	}
	return 0, false
}

// sweep kills and removes every sandbox cgroup left under this Root's tag
// by an earlier broker process.
func (d *cgroupDriver) sweep() int {
	if !d.available() {
		return 0
	}
	n := 0
	for i, b := range d.base {
		ents, _ := os.ReadDir(b)
		for _, e := range ents {
			id, ok := strings.CutPrefix(e.Name(), "p-")
			if !e.IsDir() || !ok || !sandbox.ValidID(id) {
				continue
			}
			dir := filepath.Join(b, e.Name())
			if i == 0 && len(readPids(filepath.Join(dir, "cgroup.procs"))) > 0 {
				killDirs(dir, 5*time.Second)
				n++
			}
			if err := os.Remove(dir); err != nil {
				d.log.Warn().Err(err).Str("cgroup", e.Name()).Msg("orphan_cgroup_not_removed")
			}
		}
	}
	return n
}
