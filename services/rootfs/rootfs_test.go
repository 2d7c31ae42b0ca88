package rootfs

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// requireRoot: mounting needs root, which CI has; elsewhere the tests skip.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("CI=true but not root: these tests mount filesystems")
	}
	t.Skip("not root")
}

// newRoot is a fresh root holding a broker's kind of files.
func newRoot(t *testing.T) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "root")
	write(t, filepath.Join(root, "audit.db"), "rows")
	write(t, filepath.Join(root, "workspaces", "ws1", "f.txt"), "hello")
	if err := os.Chmod(root, 0o711); err != nil {
		t.Fatal(err)
	}
	return root
}

func write(t *testing.T, p, s string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// mount mounts and unmounts at cleanup (before t.TempDir's removal).
func mount(t *testing.T, src, target, fstype string, flags uintptr, data string) {
	t.Helper()
	if err := unix.Mount(src, target, fstype, flags, data); err != nil {
		t.Fatalf("mount %s: %v", target, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
}

func ensure(t *testing.T, root string, allowMount bool) Result {
	t.Helper()
	r, err := Ensure(root, allowMount)
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	if r.Mounted {
		t.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
	}
	return r
}

func mustRead(t *testing.T, p, want string) {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil || string(b) != want {
		t.Errorf("%s: %q, %v; want %q", p, b, err, want)
	}
}

// TestOverlayHidesTheHostPath: a bind mount from under the root, as a
// sandbox's workspace is, shows only the path inside the root, and the
// broker's files stay where they were.
func TestOverlayHidesTheHostPath(t *testing.T) {
	requireRoot(t)
	root := newRoot(t)
	if r := ensure(t, root, true); !r.Private || !r.Mounted {
		t.Fatalf("Ensure = %+v, want the overlay mounted", r)
	}
	mustRead(t, filepath.Join(root, "audit.db"), "rows")
	mustRead(t, filepath.Join(root, "workspaces", "ws1", "f.txt"), "hello")
	if fi, err := os.Stat(root); err != nil || fi.Mode().Perm() != 0o711 {
		t.Errorf("root mode %v, %v; want 0711 as before", fi.Mode(), err)
	}
	if _, err := os.Lstat(filepath.Join(root, layerDir)); err == nil {
		t.Error("the layers are visible inside the root")
	}
	ws := t.TempDir()
	mount(t, filepath.Join(root, "workspaces", "ws1"), ws, "", unix.MS_BIND, "")
	m, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(ws))
	if err != nil || len(m) != 1 {
		t.Fatalf("bind mount: %v %v", m, err)
	}
	if m[0].Root != "/workspaces/ws1" {
		t.Errorf("the bind's source shows as %q, want /workspaces/ws1", m[0].Root)
	}
	host := filepath.Dir(root) // the host directory the root lies in
	for _, f := range []string{m[0].Root, m[0].Source, m[0].VFSOptions, m[0].Options} {
		if strings.Contains(f, host) {
			t.Errorf("the mount table names the host path: %+v", m[0])
		}
	}
	mustRead(t, filepath.Join(ws, "f.txt"), "hello")
	if r := ensure(t, root, true); !r.Private || r.Mounted {
		t.Errorf("second Ensure = %+v, want the overlay found in place", r)
	}
}

func TestOffLeavesTheRootAsItIs(t *testing.T) {
	requireRoot(t)
	root := newRoot(t)
	r := ensure(t, root, false)
	if r.Private || r.Exposed == "" {
		t.Fatalf("Ensure = %+v, want exposed with a reason", r)
	}
	if _, err := os.Lstat(filepath.Join(root, layerDir)); err == nil {
		t.Error("layers created with the overlay off")
	}
	mustRead(t, filepath.Join(root, "audit.db"), "rows")
}

// TestUnmountedLayerIsRemountedOrRefused: after a reboot the files sit
// on the upper layer with nothing mounted. The broker remounts it when it
// may and otherwise refuses to start on what looks like an empty root.
func TestUnmountedLayerIsRemountedOrRefused(t *testing.T) {
	requireRoot(t)
	root := newRoot(t)
	ensure(t, root, true)
	if err := unix.Unmount(root, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := Ensure(root, false); err == nil {
		t.Error("Ensure without mounting accepted a root whose files are on an unmounted layer")
	}
	if r := ensure(t, root, true); !r.Private || !r.Mounted {
		t.Fatalf("Ensure = %+v, want the layer mounted again", r)
	}
	mustRead(t, filepath.Join(root, "workspaces", "ws1", "f.txt"), "hello")
}

// TestFailedMountLeavesTheRootAsItWas: overlayfs refuses an upper layer
// on overlayfs, so a root inside another overlay cannot get one.
func TestFailedMountLeavesTheRootAsItWas(t *testing.T) {
	requireRoot(t)
	outer := newRoot(t)
	ensure(t, outer, true)
	root := filepath.Join(outer, "inner")
	write(t, filepath.Join(root, "audit.db"), "inner rows")
	r := ensure(t, root, true)
	if r.Private || !strings.Contains(r.Exposed, "could not be mounted") {
		t.Fatalf("Ensure = %+v, want a failed mount reported", r)
	}
	mustRead(t, filepath.Join(root, "audit.db"), "inner rows")
	if _, err := os.Lstat(filepath.Join(root, layerDir)); err == nil {
		t.Error("layers left behind after the failed mount")
	}
}

// TestMountsAtOrBelowTheRootAreRespected: a root that is its own
// filesystem needs nothing; one that is a bind mount (as in a container)
// or has a filesystem below it is left alone and reported.
func TestMountsAtOrBelowTheRootAreRespected(t *testing.T) {
	requireRoot(t)
	own := filepath.Join(t.TempDir(), "own")
	if err := os.Mkdir(own, 0o700); err != nil {
		t.Fatal(err)
	}
	mount(t, "tmpfs", own, "tmpfs", 0, "size=1m")
	if r := ensure(t, own, true); !r.Private || r.Mounted {
		t.Errorf("own filesystem: %+v, want private as it is", r)
	}

	bound := newRoot(t)
	mount(t, bound, bound, "", unix.MS_BIND, "")
	if r := ensure(t, bound, true); r.Private || !strings.Contains(r.Exposed, "bind mount") {
		t.Errorf("bind mount: %+v", r)
	}

	below := newRoot(t)
	mount(t, "tmpfs", filepath.Join(below, "workspaces"), "tmpfs", 0, "size=1m")
	if r := ensure(t, below, true); r.Private || !strings.Contains(r.Exposed, "below") {
		t.Errorf("filesystem below: %+v", r)
	}
	mustRead(t, filepath.Join(below, "audit.db"), "rows")
}

// BenchmarkWorkspaceFiles is the overlay's cost on workspace-style I/O:
// each op writes, stats, reads and removes 100 files of 4 KiB, on a
// plain root (the same-run baseline) and on one under the overlay.
func BenchmarkWorkspaceFiles(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("not root")
	}
	data := make([]byte, 4096)
	for _, overlay := range []bool{false, true} {
		name := "plain"
		if overlay {
			name = "overlay"
		}
		b.Run(name, func(b *testing.B) {
			root := filepath.Join(b.TempDir(), "root")
			if err := os.MkdirAll(filepath.Join(root, "workspaces", "ws"), 0o700); err != nil {
				b.Fatal(err)
			}
			if overlay {
				if r, err := Ensure(root, true); err != nil || !r.Mounted {
					b.Fatalf("Ensure = %+v, %v", r, err)
				}
				b.Cleanup(func() { _ = unix.Unmount(root, unix.MNT_DETACH) })
			}
			dir := filepath.Join(root, "workspaces", "ws")
			b.ResetTimer()
			for range b.N {
				for i := range 100 {
					p := filepath.Join(dir, "f"+strconv.Itoa(i))
					if err := os.WriteFile(p, data, 0o644); err != nil {
						b.Fatal(err)
					}
					if _, err := os.Stat(p); err != nil {
						b.Fatal(err)
					}
					if _, err := os.ReadFile(p); err != nil {
						b.Fatal(err)
					}
					if err := os.Remove(p); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
