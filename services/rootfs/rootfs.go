// Package rootfs puts SANDBOX_ROOT on a filesystem of its own, so that
// nothing a sandbox can read names where it lies on the host.
//
// Every sandbox sees bind mounts of directories under SANDBOX_ROOT (its
// workspace, its run directory, the agent binary), and the kernel shows
// each bind's source in /proc/<pid>/mountinfo as the path of that
// directory from the root of its filesystem (field 4): binding
// /srv/x/workspaces/<id> anywhere shows "/srv/x/workspaces/<id>". No
// bind option changes that; only another filesystem does. So when
// SANDBOX_ROOT is not already the root of one and the broker may mount,
// Ensure mounts an overlay over it whose upper layer holds the broker's
// files (and whose lower layer is empty): sandboxes then see
// "/workspaces/<id>", "/run/…" and "/bin/sandbox-agent", paths inside
// SANDBOX_ROOT and none of the host's. The layers are named relative to
// the directory the mount is made from, and overlayfs shows them as given.
package rootfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// layerDir is the directory under SANDBOX_ROOT (hidden beneath the
// overlay once mounted) that holds the overlay's layers.
const layerDir = ".layers"

const (
	source  = "sandbox-broker"
	options = "lowerdir=lower,upperdir=upper,workdir=work"
)

// Result says what Ensure found or did.
type Result struct {
	// Private: bind mounts from under the root show paths inside it only.
	Private bool
	// Mounted: Ensure mounted the overlay (else it found the root private
	// already, or could not make it so).
	Mounted bool
	// Exposed says why a sandbox can read the root's host path (when not
	// Private). It names no path.
	Exposed string
}

// Ensure makes root (absolute) the root of a filesystem of its own when
// it is not, mount is set and this process may mount: as root, with
// CAP_SYS_ADMIN, in the host's mount namespace (so the Docker daemon
// sees the mount too), when root is not itself a mount point (a bind into
// a container, where the daemon resolves the host's path) and nothing is
// mounted below it. Files already in root move into the upper layer
// first. The mount outlives the broker; a later start finds it in place.
// An error means root is unusable as it stands (its files are on a layer
// that is not mounted and cannot be now).
func Ensure(root string, mount bool) (Result, error) {
	root, err := filepath.EvalSymlinks(root)
	if err != nil {
		return Result{}, err
	}
	mounts, err := mountinfo.GetMounts(nil)
	if err != nil {
		return Result{}, err
	}
	var top *mountinfo.Info // the last mount at root is the one in view
	below := false
	for _, m := range mounts {
		if m.Mountpoint == root {
			top = m
		}
		below = below || strings.HasPrefix(m.Mountpoint, root+"/")
	}
	switch {
	case top != nil && top.Root == "/":
		return Result{Private: true}, nil
	case top != nil:
		return exposed(root, "SANDBOX_ROOT is a bind mount (in a container, say): give it a filesystem of its own on the host")
	case below:
		return exposed(root, "a filesystem is mounted below SANDBOX_ROOT, which an overlay over it would hide")
	case !mount:
		return exposed(root, "SANDBOX_ROOT_OVERLAY is off")
	}
	if why := cannotMount(); why != "" {
		return exposed(root, why)
	}
	if err := mountOver(root); err != nil {
		return exposed(root, "the overlay could not be mounted: "+errorName(err))
	}
	return Result{Private: true, Mounted: true}, nil
}

// exposed reports root as readable by sandboxes, unless its files sit
// on an unmounted layer (an earlier start mounted it, and the machine
// has rebooted since): then the broker must not start on an empty root.
func exposed(root, why string) (Result, error) {
	if ents, err := os.ReadDir(filepath.Join(root, layerDir, "upper")); err == nil && len(ents) > 0 {
		return Result{}, fmt.Errorf("SANDBOX_ROOT's files are in its %s/upper overlay layer, which is not mounted and cannot be (%s); start the broker as root in the host's mount namespace", layerDir, why)
	}
	return Result{Exposed: why}, nil
}

// cannotMount says why this process cannot mount over the root, or "".
func cannotMount() string {
	if os.Geteuid() != 0 {
		return "the broker does not run as root"
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil || data[0].Effective&(1<<unix.CAP_SYS_ADMIN) == 0 {
		return "the broker lacks CAP_SYS_ADMIN"
	}
	// Under systemd's PrivateTmp or ProtectSystem, say. (Where pid 1's
	// namespace cannot be read, it is taken to be ours.)
	self, err1 := os.Readlink("/proc/self/ns/mnt")
	host, err2 := os.Readlink("/proc/1/ns/mnt")
	if err1 == nil && err2 == nil && self != host {
		return "the broker runs in a mount namespace of its own, which the Docker daemon would not see"
	}
	return ""
}

// mountOver moves root's files into the upper layer and mounts the
// overlay over root. When anything fails, the files move back and the
// layers go: root is left as it was.
func mountOver(root string) (err error) {
	layers := filepath.Join(root, layerDir)
	upper := filepath.Join(layers, "upper")
	for _, d := range []string{layers, filepath.Join(layers, "lower"), upper, filepath.Join(layers, "work")} {
		if err := os.Mkdir(d, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
	}
	defer func() {
		if err == nil {
			return
		}
		if berr := move(upper, root, ""); berr != nil {
			err = fmt.Errorf("%w (and moving the files back failed: %v)", err, berr)
			return
		}
		_ = os.RemoveAll(layers)
	}()
	if ents, err := os.ReadDir(upper); err != nil {
		return err
	} else if len(ents) == 0 {
		// The overlay's root is the upper layer's: it takes the root's
		// owner and mode (a remount after a reboot keeps the layer's).
		fi, err := os.Stat(root)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		if err := os.Chown(upper, int(st.Uid), int(st.Gid)); err != nil {
			return err
		}
		if err := os.Chmod(upper, fi.Mode().Perm()); err != nil {
			return err
		}
	}
	if err := os.Chmod(filepath.Join(layers, "lower"), 0o755); err != nil {
		return err
	}
	if err := move(root, upper, layerDir); err != nil {
		return err
	}
	return mountOverlay(layers, root)
}

// move renames every entry of from (but skip) into to, refusing to
// replace anything there.
func move(from, to, skip string) error {
	ents, err := os.ReadDir(from)
	if errors.Is(err, os.ErrNotExist) { // no layer made yet: nothing moved
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range ents {
		if e.Name() == skip {
			continue
		}
		dst := filepath.Join(to, e.Name())
		if _, err := os.Lstat(dst); !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("move %s: already in the other layer", e.Name())
		}
		if err := os.Rename(filepath.Join(from, e.Name()), dst); err != nil {
			return err
		}
	}
	return nil
}

// mountOverlay mounts the overlay of layers' lower, upper and work over
// target, naming the layers relative to layers: that is what overlayfs
// shows in the mount table, so no host path appears there. The relative
// names resolve against the working directory, which only the locked
// thread changes (CLONE_FS unshared); the thread exits with it.
func mountOverlay(layers, target string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: this thread's cwd differs
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			errc <- err
			return
		}
		if err := unix.Chdir(layers); err != nil {
			errc <- err
			return
		}
		errc <- unix.Mount(source, target, "overlay", unix.MS_NOSUID|unix.MS_NODEV, options)
	}()
	if err := <-errc; err != nil {
		return err
	}
	m, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(target))
	if err == nil && (len(m) == 0 || m[len(m)-1].FSType != "overlay" || m[len(m)-1].Root != "/") {
		err = errors.New("the overlay is not in the mount table after mounting it")
	}
	if err != nil {
		_ = unix.Unmount(target, unix.MNT_DETACH)
	}
	return err
}

// errorName is err without any path it carries (logs never hold one).
func errorName(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno.Error()
	}
	return "failed"
}
