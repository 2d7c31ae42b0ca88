package workspace

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// newWS creates a workspace in a fresh temp dir; outside is a sibling
// directory that must never receive anything.
func newWS(t *testing.T, opts ...Option) (w *Workspace, dir, outside string) {
	t.Helper()
	base := t.TempDir()
	dir = filepath.Join(base, "ws")
	outside = filepath.Join(base, "outside")
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := Create(dir, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	return w, dir, outside
}

func wantCode(t *testing.T, err error, want brokererr.Code) {
	t.Helper()
	if got := brokererr.CodeOf(err); got != want {
		t.Fatalf("error %v: code %q, want %q", err, got, want)
	}
}

func mustWriteFile(t *testing.T, name string, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(name, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustSymlink(t *testing.T, target, name string) {
	t.Helper()
	if err := os.Symlink(target, name); err != nil {
		t.Fatal(err)
	}
}

func assertEmpty(t *testing.T, dir string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		t.Fatalf("%s should be empty, has %v", dir, ents)
	}
}

// withTimeout fails the test if fn blocks (FIFOs must never block).
func withTimeout(t *testing.T, d time.Duration, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("blocked for more than %v", d)
	}
}

func TestWriteReadRoundTrip(t *testing.T) {
	w, dir, _ := newWS(t)
	if err := w.Write("out/sub/data.csv", []byte("a,b\n1,2\n"), false); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dir, "out/sub/data.csv"))
	if err != nil || string(got) != "a,b\n1,2\n" {
		t.Fatalf("on disk: %q, %v", got, err)
	}
	f, err := w.Read("out/sub/data.csv", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if string(f.Data) != "a,b\n1,2\n" || f.Size != 8 || f.Path != "out/sub/data.csv" || f.ModTime.IsZero() {
		t.Fatalf("Read = %+v", f)
	}
	f, err = w.Read("out/sub/data.csv", 4, 3)
	if err != nil || string(f.Data) != "1,2" || f.Size != 8 {
		t.Fatalf("Read(4,3) = %+v, %v", f, err)
	}
	f, err = w.Read("out/sub/data.csv", 8, 10)
	if err != nil || len(f.Data) != 0 {
		t.Fatalf("Read at EOF = %+v, %v", f, err)
	}
	_, err = w.Read("out/sub/data.csv", 9, 10)
	wantCode(t, err, brokererr.InvalidInput)
	_, err = w.Read("out/sub/data.csv", -1, 10)
	wantCode(t, err, brokererr.InvalidInput)
	_, err = w.Read("missing.txt", 0, 0)
	wantCode(t, err, brokererr.FileNotFound)
	_, err = w.Read("../ws/out/sub/data.csv", 0, 0)
	wantCode(t, err, brokererr.PathTraversal)
	// No temporary files left behind.
	ents, _ := os.ReadDir(filepath.Join(dir, "out/sub"))
	if len(ents) != 1 {
		t.Fatalf("entries: %v", ents)
	}
}

func TestOwnerAndModes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	w, dir, _ := newWS(t)
	if err := w.Write("d1/d2/f.txt", []byte("x"), false); err != nil {
		t.Fatal(err)
	}
	for name, mode := range map[string]os.FileMode{
		"":            0o750,
		"d1":          DirMode,
		"d1/d2":       DirMode,
		"d1/d2/f.txt": FileMode,
	} {
		fi, err := os.Lstat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if st.Uid != DefaultUID || st.Gid != DefaultGID {
			t.Errorf("%q owned by %d:%d", name, st.Uid, st.Gid)
		}
		if fi.Mode().Perm() != mode {
			t.Errorf("%q mode %v, want %v", name, fi.Mode().Perm(), mode)
		}
	}

	// WithOwner(-1, -1): files stay the broker's.
	w2, dir2, _ := newWS(t, WithOwner(-1, -1))
	if err := w2.Write("f", []byte("x"), false); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Lstat(filepath.Join(dir2, "f"))
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 {
		t.Errorf("owner %d, want 0", st.Uid)
	}
	// WithOwner(1234, 5678).
	w3, dir3, _ := newWS(t, WithOwner(1234, 5678))
	if err := w3.Write("f", []byte("x"), false); err != nil {
		t.Fatal(err)
	}
	fi, _ = os.Lstat(filepath.Join(dir3, "f"))
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("owner %d:%d", st.Uid, st.Gid)
	}
}

// A workspace left by another sandbox uid is given to the new owner,
// entries and directory, without following symlinks out of it.
func TestEnsureOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	w, dir, outside := newWS(t) // the old layout: 1000:1000
	for _, f := range []string{"a.txt", "d/e/f.txt"} {
		if err := w.Write(f, []byte("x"), false); err != nil {
			t.Fatal(err)
		}
	}
	mustWriteFile(t, filepath.Join(outside, "host"), "h")
	mustSymlink(t, filepath.Join(outside, "host"), filepath.Join(dir, "d", "link"))
	mustSymlink(t, outside, filepath.Join(dir, "dirlink"))
	owner := func(p string) (uint32, uint32) {
		fi, err := os.Lstat(p)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		return st.Uid, st.Gid
	}
	w2, err := Open(dir, Limits{}, WithOwner(4321, 4322))
	if err != nil {
		t.Fatal(err)
	}
	defer w2.Close()
	if err := w2.EnsureOwner(); err != nil {
		t.Fatal(err)
	}
	for _, rel := range []string{"", "a.txt", "d", "d/e", "d/e/f.txt", "d/link", "dirlink"} {
		if u, g := owner(filepath.Join(dir, rel)); u != 4321 || g != 4322 {
			t.Errorf("%q owned by %d:%d after EnsureOwner", rel, u, g)
		}
	}
	for _, p := range []string{outside, filepath.Join(outside, "host")} {
		if u, _ := owner(p); u != 0 {
			t.Errorf("%s outside the workspace changed owner to %d", p, u)
		}
	}
	// Already owned: nothing is walked (an entry changed by hand stays).
	if err := os.Lchown(filepath.Join(dir, "a.txt"), 7, 7); err != nil {
		t.Fatal(err)
	}
	if err := w2.EnsureOwner(); err != nil {
		t.Fatal(err)
	}
	if u, _ := owner(filepath.Join(dir, "a.txt")); u != 7 {
		t.Errorf("a.txt re-owned although the workspace already was the owner's")
	}
}

func TestWriteOverwrite(t *testing.T) {
	w, dir, outside := newWS(t)
	if err := w.Write("f.txt", []byte("one"), false); err != nil {
		t.Fatal(err)
	}
	wantCode(t, w.Write("f.txt", []byte("two"), false), brokererr.FileExists)
	if b, _ := os.ReadFile(filepath.Join(dir, "f.txt")); string(b) != "one" {
		t.Fatalf("overwritten without overwrite: %q", b)
	}
	if err := w.Write("f.txt", []byte("three"), true); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "f.txt")); string(b) != "three" {
		t.Fatalf("got %q", b)
	}
	// overwrite=true on a new file is fine.
	if err := w.Write("new.txt", []byte("n"), true); err != nil {
		t.Fatal(err)
	}

	// A symlink (even a dangling one, even to outside) exists: FileExists
	// without overwrite, PathTraversal with it; the target is untouched.
	victim := filepath.Join(outside, "victim")
	mustWriteFile(t, victim, "safe")
	mustSymlink(t, victim, filepath.Join(dir, "link"))
	mustSymlink(t, filepath.Join(outside, "nothing"), filepath.Join(dir, "dangling"))
	wantCode(t, w.Write("link", []byte("pwned"), false), brokererr.FileExists)
	wantCode(t, w.Write("link", []byte("pwned"), true), brokererr.PathTraversal)
	wantCode(t, w.Write("dangling", []byte("pwned"), false), brokererr.FileExists)
	wantCode(t, w.Write("dangling", []byte("pwned"), true), brokererr.PathTraversal)
	if b, _ := os.ReadFile(victim); string(b) != "safe" {
		t.Fatalf("victim changed: %q", b)
	}
	if _, err := os.Lstat(filepath.Join(outside, "nothing")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("file created through dangling symlink")
	}

	// Directories and FIFOs are not replaced.
	if err := os.Mkdir(filepath.Join(dir, "adir"), 0o755); err != nil {
		t.Fatal(err)
	}
	wantCode(t, w.Write("adir", []byte("x"), true), brokererr.InvalidInput)
	wantCode(t, w.Write("adir", []byte("x"), false), brokererr.FileExists)
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	withTimeout(t, 5*time.Second, func() {
		wantCode(t, w.Write("fifo", []byte("x"), true), brokererr.InvalidInput)
	})
	// A parent that is a file.
	wantCode(t, w.Write("f.txt/child", []byte("x"), false), brokererr.InvalidInput)
}

func TestWriteThroughSymlinks(t *testing.T) {
	w, dir, outside := newWS(t)
	mustSymlink(t, outside, filepath.Join(dir, "abs"))               // dir -> outside (absolute)
	mustSymlink(t, "../outside", filepath.Join(dir, "rel"))          // dir -> outside (relative)
	mustSymlink(t, "../../../../../../..", filepath.Join(dir, "up")) // ../../..
	mustSymlink(t, "/", filepath.Join(dir, "root"))
	for _, p := range []string{"abs/x", "rel/x", "rel/new/x", "up/tmp/x", "root/tmp/x"} {
		err := w.Write(p, []byte("pwned"), false)
		wantCode(t, err, brokererr.PathTraversal)
		err = w.Write(p, []byte("pwned"), true)
		wantCode(t, err, brokererr.PathTraversal)
	}
	assertEmpty(t, outside)

	// Links that stay inside the workspace are fine.
	if err := os.Mkdir(filepath.Join(dir, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	mustSymlink(t, "real", filepath.Join(dir, "inner"))
	if err := w.Write("inner/x.txt", []byte("ok"), false); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "real/x.txt")); err != nil || string(b) != "ok" {
		t.Fatalf("%q %v", b, err)
	}
}

func TestReadThroughSymlinks(t *testing.T) {
	w, dir, outside := newWS(t)
	mustWriteFile(t, filepath.Join(outside, "secret"), "secret")
	mustSymlink(t, "/etc/passwd", filepath.Join(dir, "out.txt"))
	mustSymlink(t, "../../../../../../../../etc/passwd", filepath.Join(dir, "rel.txt"))
	mustSymlink(t, "/", filepath.Join(dir, "rootdir"))
	mustSymlink(t, "../outside", filepath.Join(dir, "sib"))
	mustWriteFile(t, filepath.Join(dir, "real/in.txt"), "inside")
	mustSymlink(t, "real/in.txt", filepath.Join(dir, "filelink"))
	mustSymlink(t, "real", filepath.Join(dir, "dirlink"))

	// Every read-side failure looks the same: not found or not regular.
	for _, p := range []string{"out.txt", "rel.txt", "filelink", "rootdir/etc/passwd", "sib/secret"} {
		_, err := w.Read(p, 0, 0)
		wantCode(t, err, brokererr.FileNotFound) // final symlink: not a regular file
		_, _, err = w.OpenFile(p)
		wantCode(t, err, brokererr.FileNotFound)
	}
	// A directory link that stays inside resolves.
	f, err := w.Read("dirlink/in.txt", 0, 0)
	if err != nil || string(f.Data) != "inside" {
		t.Fatalf("%+v %v", f, err)
	}
}

func TestReadNonRegular(t *testing.T) {
	w, dir, _ := newWS(t)
	if err := syscall.Mkfifo(filepath.Join(dir, "out.txt"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "adir"), 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", filepath.Join(dir, "sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	withTimeout(t, 5*time.Second, func() {
		for _, p := range []string{"out.txt", "adir", "sock"} {
			_, err := w.Read(p, 0, 0)
			wantCode(t, err, brokererr.FileNotFound)
			if f, _, err := w.OpenFile(p); err == nil {
				f.Close()
				t.Errorf("OpenFile(%q) succeeded", p)
			}
			if e := brokererr.As(err); e == nil || e.Message != "file not found or not a regular file" {
				t.Errorf("OpenFile(%q): %v", p, err)
			}
		}
	})
}

func TestQuotas(t *testing.T) {
	w, _, _ := newWS(t, WithLimits(Limits{MaxFiles: 4, MaxBytes: 100, MaxFileBytes: 60}))
	wantCode(t, w.Write("big", make([]byte, 61), false), brokererr.FileSizeExceeded)
	if err := w.Write("a", make([]byte, 60), false); err != nil {
		t.Fatal(err)
	}
	// 60 + 41 > 100.
	wantCode(t, w.Write("b", make([]byte, 41), false), brokererr.QuotaExceeded)
	if err := w.Write("b", make([]byte, 39), false); err != nil {
		t.Fatal(err)
	}
	// Replacing counts the size being replaced: 99 - 60 + 60 fits.
	if err := w.Write("a", make([]byte, 60), true); err != nil {
		t.Fatal(err)
	}
	wantCode(t, w.Write("a", make([]byte, 61), true), brokererr.FileSizeExceeded)
	// Entries: a, b = 2. "d/e/f" needs 3 more (d, d/e, f) > 4.
	wantCode(t, w.Write("d/e/f", nil, false), brokererr.QuotaExceeded)
	if err := w.Write("d/f", nil, false); err != nil { // d, d/f -> 4
		t.Fatal(err)
	}
	wantCode(t, w.Write("g", nil, false), brokererr.QuotaExceeded)
	// Overwriting an existing file adds no entry.
	if err := w.Write("d/f", []byte("x"), true); err != nil {
		t.Fatal(err)
	}
	files, n, err := w.Usage()
	if err != nil || files != 4 || n != 100 {
		t.Fatalf("Usage = %d, %d, %v", files, n, err)
	}
	// Read's max is capped at MaxFileBytes too.
	f, err := w.Read("a", 0, 1<<40)
	if err != nil || len(f.Data) != 60 {
		t.Fatalf("%d %v", len(f.Data), err)
	}
}

func TestUsageCountsEverything(t *testing.T) {
	w, dir, outside := newWS(t)
	mustWriteFile(t, filepath.Join(outside, "big"), string(make([]byte, 1000)))
	mustWriteFile(t, filepath.Join(dir, "a/b/c.txt"), "12345")
	mustWriteFile(t, filepath.Join(dir, "d.txt"), "123")
	mustSymlink(t, outside, filepath.Join(dir, "out")) // not followed
	mustSymlink(t, filepath.Join(outside, "big"), filepath.Join(dir, "big"))
	if err := syscall.Mkfifo(filepath.Join(dir, "a/fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	files, n, err := w.Usage()
	// a, a/b, a/b/c.txt, d.txt, out, big, a/fifo
	if err != nil || files != 7 || n != 8 {
		t.Fatalf("Usage = %d, %d, %v", files, n, err)
	}
}

func TestUsageDepthLimitFailsClosed(t *testing.T) {
	w, dir, _ := newWS(t)
	p := dir
	for range WalkMaxDepth + 2 {
		p = filepath.Join(p, "d")
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, _, err := w.Usage()
	wantCode(t, err, brokererr.QuotaExceeded)
	if !errors.Is(err, ErrWalkLimit) {
		t.Fatalf("%v", err)
	}
	wantCode(t, w.Write("x", nil, false), brokererr.QuotaExceeded)
}

func TestParentReplacedBySymlink(t *testing.T) {
	w, dir, outside := newWS(t)
	if err := w.Write("sub/a.txt", []byte("a"), false); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "sub")); err != nil {
		t.Fatal(err)
	}
	mustSymlink(t, outside, filepath.Join(dir, "sub"))
	for _, ov := range []bool{false, true} {
		wantCode(t, w.Write("sub/b.txt", []byte("pwned"), ov), brokererr.PathTraversal)
		wantCode(t, w.Write("sub/new/b.txt", []byte("pwned"), ov), brokererr.PathTraversal)
	}
	assertEmpty(t, outside)
}

// TestParentSwapRace swaps a parent between a directory and a symlink to
// outside while writes run; nothing may ever land outside.
func TestParentSwapRace(t *testing.T) {
	w, dir, outside := newWS(t)
	sub := filepath.Join(dir, "sub")
	link := filepath.Join(dir, "tmplink")
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	mustSymlink(t, outside, link)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var swaps atomic.Int64
	wg.Add(1)
	go func() { // the "sandbox": RENAME_EXCHANGE flips sub between dir and link atomically
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := unix.Renameat2(unix.AT_FDCWD, sub, unix.AT_FDCWD, link, unix.RENAME_EXCHANGE); err != nil {
				t.Errorf("exchange: %v", err)
				return
			}
			swaps.Add(1)
		}
	}()
	// At least 300 writes, and on until the swapper has raced them 100
	// times (a quiet machine finishes 300 writes before it is scheduled
	// much); bounded all the same.
	var okN, i int
	for ; (i < 300 || swaps.Load() < 100) && i < 100_000; i++ {
		err := w.Write(fmt.Sprintf("sub/f%d", i), []byte("x"), i%2 == 0)
		if err == nil {
			okN++
		}
		// Refusals: the link was seen (PathTraversal), a parent was not a
		// directory (InvalidInput), or Usage hit the link mid-walk and failed
		// closed (QuotaExceeded).
		switch c := brokererr.CodeOf(err); c {
		case "", brokererr.PathTraversal, brokererr.InvalidInput, brokererr.QuotaExceeded:
		default:
			t.Errorf("unexpected error: %v", err)
		}
	}
	close(stop)
	wg.Wait()
	if swaps.Load() < 100 {
		t.Fatalf("only %d swaps in %d writes", swaps.Load(), i)
	}
	assertEmpty(t, outside)
	t.Logf("%d swaps; %d/%d writes landed inside, the rest were refused", swaps.Load(), okN, i)
}

// TestWorkspaceDirSwap: replacing the workspace directory itself by a
// symlink after Open does not redirect the open Workspace.
func TestWorkspaceDirSwap(t *testing.T) {
	w, dir, outside := newWS(t)
	moved := dir + ".moved"
	if err := os.Rename(dir, moved); err != nil {
		t.Fatal(err)
	}
	mustSymlink(t, outside, dir)
	if err := w.Write("x.txt", []byte("x"), false); err != nil {
		t.Fatal(err)
	}
	assertEmpty(t, outside)
	if _, err := os.Stat(filepath.Join(moved, "x.txt")); err != nil {
		t.Fatal(err)
	}
	// And Open refuses a workspace path that is a symlink.
	if _, err := Open(dir, Limits{}); err == nil {
		t.Fatal("Open followed a symlinked workspace dir")
	}
	if _, err := Create(dir); err == nil {
		t.Fatal("Create followed a symlinked workspace dir")
	}
	_, err := Open(filepath.Join(outside, "nope"), Limits{})
	wantCode(t, err, brokererr.SandboxNotFound)
}

func TestList(t *testing.T) {
	w, dir, outside := newWS(t)
	mustWriteFile(t, filepath.Join(outside, "secret"), "s")
	for _, p := range []string{"b.txt", "a/z.txt", "a/b/c.txt", "a-b.txt", "real/x"} {
		mustWriteFile(t, filepath.Join(dir, p), p)
	}
	mustWriteFile(t, filepath.Join(dir, "bad\nname"), "x")                     // invalid name: skipped
	for _, name := range []string{"ls\u2028x", "\uFEFFb.txt", "b\u200B.txt"} { // invisible: skipped
		mustWriteFile(t, filepath.Join(dir, name), "x")
	}
	mustWriteFile(t, filepath.Join(dir, ".sbx-tmp-abc"), "x")                 // Write's temp: skipped
	mustSymlink(t, "/etc/passwd", filepath.Join(dir, "passwd"))               // file link: skipped
	mustSymlink(t, outside, filepath.Join(dir, "outdir"))                     // dir link out: not followed
	mustSymlink(t, "real", filepath.Join(dir, "indir"))                       // dir link in: not followed
	mustSymlink(t, "/", filepath.Join(dir, "root"))                           // not followed
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil { // skipped
		t.Fatal(err)
	}
	var got []string
	withTimeout(t, 5*time.Second, func() {
		infos, trunc, err := w.List("", 0)
		if err != nil || trunc {
			t.Errorf("List: %v %v", trunc, err)
		}
		for _, fi := range infos {
			got = append(got, fi.Path)
			if fi.Size != int64(len(fi.Path)) {
				t.Errorf("%s size %d", fi.Path, fi.Size)
			}
		}
	})
	want := []string{"a-b.txt", "a/b/c.txt", "a/z.txt", "b.txt", "real/x"}
	if !slices.Equal(got, want) {
		t.Fatalf("List = %q, want %q", got, want)
	}

	// Cap: the first N in sorted order, truncated.
	infos, trunc, err := w.List(".", 2)
	if err != nil || !trunc || len(infos) != 2 || infos[0].Path != "a-b.txt" || infos[1].Path != "a/b/c.txt" {
		t.Fatalf("List cap = %+v %v %v", infos, trunc, err)
	}
	// Subdirectory; paths stay workspace-relative.
	infos, trunc, err = w.List("a", 10)
	if err != nil || trunc || len(infos) != 2 || infos[0].Path != "a/b/c.txt" {
		t.Fatalf("List(a) = %+v %v %v", infos, trunc, err)
	}
	for _, p := range []string{"outdir", "indir", "root", "passwd", "fifo", "missing"} {
		_, _, err = w.List(p, 10)
		wantCode(t, err, brokererr.FileNotFound)
	}
	_, _, err = w.List("../ws", 10)
	wantCode(t, err, brokererr.PathTraversal)
}

func TestSnapshotChanged(t *testing.T) {
	w, dir, _ := newWS(t)
	mustWriteFile(t, filepath.Join(dir, "same.txt"), "same")
	mustWriteFile(t, filepath.Join(dir, "mod.txt"), "v1")
	mustWriteFile(t, filepath.Join(dir, "gone.txt"), "x")
	mustWriteFile(t, filepath.Join(dir, "replaced.txt"), "aa")
	before, err := w.Snapshot()
	if err != nil || len(before) != 4 {
		t.Fatalf("%v %v", before, err)
	}
	// Modify (same size, later mtime), create, delete, replace by a new inode.
	mustWriteFile(t, filepath.Join(dir, "mod.txt"), "v2")
	future := time.Now().Add(time.Hour)
	if err := os.Chtimes(filepath.Join(dir, "mod.txt"), future, future); err != nil {
		t.Fatal(err)
	}
	mustWriteFile(t, filepath.Join(dir, "new/deep.txt"), "n")
	_ = os.Remove(filepath.Join(dir, "gone.txt"))
	fi, _ := os.Stat(filepath.Join(dir, "replaced.txt"))
	mustWriteFile(t, filepath.Join(dir, "tmp"), "bb")
	if err := os.Rename(filepath.Join(dir, "tmp"), filepath.Join(dir, "replaced.txt")); err != nil {
		t.Fatal(err)
	}
	_ = os.Chtimes(filepath.Join(dir, "replaced.txt"), fi.ModTime(), fi.ModTime()) // same size+mtime, new inode
	mustSymlink(t, "/etc/passwd", filepath.Join(dir, "link.txt"))                  // not a regular file
	after, err := w.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	got := Changed(before, after)
	want := []string{"mod.txt", "new/deep.txt", "replaced.txt"}
	if !slices.Equal(got, want) {
		t.Fatalf("Changed = %q, want %q", got, want)
	}
	if len(Changed(after, after)) != 0 {
		t.Fatal("no change expected")
	}
}

func TestChangedFilesAndRemoveChanged(t *testing.T) {
	w, dir, _ := newWS(t)
	mustWriteFile(t, filepath.Join(dir, "old.txt"), "old")
	before, err := w.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if got := w.ChangedFiles(before); got != nil {
		t.Fatalf("ChangedFiles = %v, want nil", got)
	}
	mustWriteFile(t, filepath.Join(dir, "new/a.txt"), "abc")
	got := w.ChangedFiles(before)
	if len(got) != 1 || got[0].Path != "new/a.txt" || got[0].Size != 3 || got[0].ModTime.IsZero() {
		t.Fatalf("ChangedFiles = %+v", got)
	}
	w.RemoveChanged(before)
	if _, err := os.Stat(filepath.Join(dir, "new/a.txt")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("new file still there: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "old.txt")); err != nil {
		t.Fatal(err)
	}
}

func TestSessionReadListMissingWorkspace(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "never-created")
	_, err := ReadFile(dir, Limits{}, "a.txt", 0, 0)
	wantCode(t, err, brokererr.FileNotFound)
	list, err := ListFiles(dir, Limits{}, ".")
	if err != nil || list == nil || len(list) != 0 {
		t.Fatalf("ListFiles = %v, %v; want empty", list, err)
	}
	_, err = ListFiles(dir, Limits{}, "sub")
	wantCode(t, err, brokererr.SandboxNotFound)
}

func TestWatchQuota(t *testing.T) {
	w, dir, _ := newWS(t, WithLimits(Limits{MaxFiles: 1}))
	stop := w.WatchQuota(context.Background(), func(context.Context) { t.Error("kill under the quota") })
	if stop() {
		t.Fatal("fired under the quota")
	}
	mustWriteFile(t, filepath.Join(dir, "a"), "1")
	mustWriteFile(t, filepath.Join(dir, "b"), "2")
	killed := make(chan struct{})
	stop = w.WatchQuota(context.Background(), func(context.Context) { close(killed) })
	withTimeout(t, 5*time.Second, func() { <-killed })
	if !stop() {
		t.Fatal("stop did not report the kill")
	}
}

func TestForbiddenNamesOption(t *testing.T) {
	w, dir, _ := newWS(t, WithForbiddenNames(ProjectForbiddenNames...))
	wantCode(t, w.Write(".git/config", []byte("x"), false), brokererr.PathTraversal)
	wantCode(t, w.Write("pkg/.ENV", []byte("x"), false), brokererr.PathTraversal)
	mustWriteFile(t, filepath.Join(dir, ".env"), "SECRET=1")
	mustWriteFile(t, filepath.Join(dir, "ok.txt"), "ok")
	_, err := w.Read(".env", 0, 0)
	wantCode(t, err, brokererr.PathTraversal)
	infos, _, err := w.List("", 0)
	if err != nil || len(infos) != 1 || infos[0].Path != "ok.txt" {
		t.Fatalf("%+v %v", infos, err)
	}
}

func TestDetectMIME(t *testing.T) {
	cases := []struct {
		name string
		head []byte
		want string
	}{
		{"chart.PNG", nil, "image/png"},
		{"a.jpeg", nil, "image/jpeg"},
		{"x.svg", []byte("<svg"), "image/svg+xml"},
		{"r.pdf", nil, "application/pdf"},
		{"d.csv", nil, "text/csv; charset=utf-8"},
		{"d.json", nil, "application/json"},
		{"n.txt", nil, "text/plain; charset=utf-8"},
		{"p.html", nil, "text/html; charset=utf-8"},
		{"s.xlsx", nil, "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"},
		{"noext", []byte("\x89PNG\r\n\x1a\n"), "image/png"},
		{"noext", []byte("%PDF-1.7"), "application/pdf"},
		{"noext", []byte("hello"), "text/plain; charset=utf-8"},
		{"noext", nil, "application/octet-stream"},
	}
	for _, c := range cases {
		if got := DetectMIME(c.name, c.head); got != c.want {
			t.Errorf("DetectMIME(%q) = %q, want %q", c.name, got, c.want)
		}
	}
}

func TestConcurrentWritesRespectQuota(t *testing.T) {
	w, _, _ := newWS(t, WithLimits(Limits{MaxFiles: 10, MaxBytes: 1 << 20, MaxFileBytes: 1 << 10}))
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = w.Write(fmt.Sprintf("f%02d", i), bytes.Repeat([]byte("x"), 10), false)
		}()
	}
	wg.Wait()
	files, _, err := w.Usage()
	if err != nil || files != 10 {
		t.Fatalf("files = %d, %v", files, err)
	}
}
