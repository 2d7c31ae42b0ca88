package workspace

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// entries lists everything under dir, relative and sorted.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	_ = filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err == nil && p != dir {
			rel, _ := filepath.Rel(dir, p)
			out = append(out, rel)
		}
		return nil
	})
	slices.Sort(out)
	return out
}

// unsized hides a reader's length.
type unsized struct{ io.Reader }

// hookReader calls hook once after at bytes have been read, then errs
// with fail (if set) at failAt.
type hookReader struct {
	r      io.Reader
	n      int64
	at     int64
	hook   func()
	failAt int64
	fail   error
}

func (h *hookReader) Read(p []byte) (int, error) {
	if h.fail != nil && h.n >= h.failAt {
		return 0, h.fail
	}
	if len(p) > 64<<10 {
		p = p[:64<<10]
	}
	k, err := h.r.Read(p)
	before := h.n
	h.n += int64(k)
	if h.hook != nil && before < h.at && h.n >= h.at {
		h.hook()
	}
	return k, err
}

func TestWriteFromStreams(t *testing.T) {
	w, dir, _ := newWS(t, WithLimits(Limits{MaxFiles: 10, MaxBytes: 64 << 20, MaxFileBytes: 40 << 20}))
	data := bytes.Repeat([]byte("0123456789abcdef"), (20<<20)/16+7)
	res, err := w.WriteFrom(context.Background(), "a/b/big.bin", unsized{bytes.NewReader(data)}, 0, false)
	if err != nil || res.Size != int64(len(data)) || res.Replaced {
		t.Fatalf("WriteFrom = %+v, %v", res, err)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "a/b/big.bin")); !bytes.Equal(got, data) {
		t.Fatal("content differs")
	}
	// A smaller max than the limit holds; nothing is left behind.
	_, err = w.WriteFrom(context.Background(), "c/d.bin", unsized{bytes.NewReader(data)}, 1<<20, false)
	wantCode(t, err, brokererr.FileSizeExceeded)
	if got := entries(t, dir); !slices.Equal(got, []string{"a", "a/b", "a/b/big.bin"}) {
		t.Fatalf("after a refused write: %v", got)
	}
	res, err = w.WriteFrom(context.Background(), "a/b/big.bin", bytes.NewReader([]byte("new")), 0, true)
	if err != nil || !res.Replaced || res.Size != 3 {
		t.Fatalf("overwrite = %+v, %v", res, err)
	}
	_, err = w.WriteFrom(context.Background(), "a/b/big.bin", bytes.NewReader([]byte("x")), 0, false)
	wantCode(t, err, brokererr.FileExists)
}

// TestWriteFromQuotaWhileStreaming: the quota holds byte by byte against
// the usage measured at the start, and against what others write while
// the data arrives; a refused write leaves nothing.
func TestWriteFromQuotaWhileStreaming(t *testing.T) {
	w, dir, _ := newWS(t, WithLimits(Limits{MaxFiles: 10, MaxBytes: 30 << 20, MaxFileBytes: 1 << 30}))
	mustWriteFile(t, filepath.Join(dir, "old"), string(make([]byte, 10<<20)))

	// 10 MiB used: 20 MiB + 1 byte does not fit, 20 MiB does.
	_, err := w.WriteFrom(context.Background(), "n/x", unsized{bytes.NewReader(make([]byte, 20<<20+1))}, 0, false)
	wantCode(t, err, brokererr.QuotaExceeded)
	if got := entries(t, dir); !slices.Equal(got, []string{"old"}) {
		t.Fatalf("after over-quota: %v", got)
	}
	// Overwriting: the replaced file's size is freed.
	if _, err := w.WriteFrom(context.Background(), "old", unsized{bytes.NewReader(make([]byte, 30<<20))}, 0, true); err != nil {
		t.Fatalf("replacing within quota: %v", err)
	}
	if err := os.Truncate(filepath.Join(dir, "old"), 10<<20); err != nil {
		t.Fatal(err)
	}

	// The sandbox writes 15 MiB while a 12 MiB upload streams: 10+15+12 >
	// 30, seen at the next measurement.
	hr := &hookReader{r: bytes.NewReader(make([]byte, 12<<20)), at: 1 << 20, hook: func() {
		mustWriteFile(t, filepath.Join(dir, "sandbox.bin"), string(make([]byte, 15<<20)))
	}}
	_, err = w.WriteFrom(context.Background(), "up", hr, 0, false)
	wantCode(t, err, brokererr.QuotaExceeded)
	if hr.n >= 12<<20 {
		t.Errorf("read all %d bytes before refusing", hr.n)
	}
	if got := entries(t, dir); !slices.Equal(got, []string{"old", "sandbox.bin"}) {
		t.Fatalf("after a concurrent overrun: %v", got)
	}

	// Files made during a small write (under the recheck interval): old,
	// s1..s9 and up would be 11 entries; the check before the rename
	// catches it.
	if err := os.Remove(filepath.Join(dir, "sandbox.bin")); err != nil {
		t.Fatal(err)
	}
	hr = &hookReader{r: bytes.NewReader(make([]byte, 1<<20)), at: 1, hook: func() {
		for _, n := range []string{"s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9"} {
			mustWriteFile(t, filepath.Join(dir, n), "")
		}
	}}
	_, err = w.WriteFrom(context.Background(), "up", hr, 0, false)
	wantCode(t, err, brokererr.QuotaExceeded)
	if _, err := os.Lstat(filepath.Join(dir, "up")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("up exists after the file-count overrun: %v", err)
	}
}

// TestWriteFromFailuresLeaveNothing: a broken reader, a cancelled context
// and symlinked or special targets leave no file, no temporary file and
// no directory behind, and the reader's error stays visible.
func TestWriteFromFailuresLeaveNothing(t *testing.T) {
	w, dir, outside := newWS(t)
	broken := errors.New("connection reset")
	_, err := w.WriteFrom(context.Background(), "p/q/f", &hookReader{r: bytes.NewReader(make([]byte, 1<<20)), failAt: 100 << 10, fail: broken}, 0, false)
	if !errors.Is(err, broken) {
		t.Fatalf("reader error lost: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	_, err = w.WriteFrom(ctx, "p/q/f", &hookReader{r: bytes.NewReader(make([]byte, 1<<20)), at: 1, hook: cancel}, 0, false)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancel: %v", err)
	}
	if got := entries(t, dir); len(got) != 0 {
		t.Fatalf("left behind: %v", got)
	}
	mustSymlink(t, outside, filepath.Join(dir, "out"))
	mustSymlink(t, filepath.Join(outside, "f"), filepath.Join(dir, "l"))
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = w.WriteFrom(context.Background(), "out/f", bytes.NewReader([]byte("x")), 0, true)
	wantCode(t, err, brokererr.PathTraversal)
	_, err = w.WriteFrom(context.Background(), "l", bytes.NewReader([]byte("x")), 0, true)
	wantCode(t, err, brokererr.PathTraversal)
	_, err = w.WriteFrom(context.Background(), "fifo", bytes.NewReader([]byte("x")), 0, true)
	wantCode(t, err, brokererr.InvalidInput)
	assertEmpty(t, outside)
	if got := entries(t, dir); !slices.Equal(got, []string{"fifo", "l", "out"}) {
		t.Fatalf("left behind: %v", got)
	}
}

func TestWithDirOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	_, dir, _ := newWS(t, WithOwner(4242, 4343))
	w, err := Open(dir, Limits{}, WithDirOwner())
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.WriteFrom(context.Background(), "d/f", bytes.NewReader([]byte("x")), 0, false); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"d", "d/f"} {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(dir, p), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 4242 || st.Gid != 4343 {
			t.Errorf("%s owned by %d:%d", p, st.Uid, st.Gid)
		}
	}
}
