package audit

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// smallFS mounts a tmpfs of size bytes on a temp dir: a real filesystem
// that fills up. It needs root; CI must run it.
func smallFS(t *testing.T, size string) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size+",mode=0700"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("mount a tmpfs (the disk-full tests need root in CI): %v", err)
		}
		t.Skipf("cannot mount a tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// fillFS writes a ballast file until the filesystem is full and returns
// its path.
func fillFS(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "ballast")
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 4096)
	for {
		if _, err := f.Write(chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			return p
		}
	}
}

// TestDiskFullRefusesAndRecovers: on a full filesystem an append fails
// (so the call it guards is refused) and a checkpoint fails without
// leaving a partial note behind; once space returns the log carries on
// and verifies, and reopens.
func TestDiskFullRefusesAndRecovers(t *testing.T) {
	f := newFixture(t)
	dir := smallFS(t, "2m")
	f.opts.Path = filepath.Join(dir, "audit.db")
	f.opts.CheckpointPath = filepath.Join(dir, "audit.checkpoints")
	l := f.open(t)
	defer l.Close()
	ctx := context.Background()

	// Leave the checkpoint file's last page with too little room for
	// another note, so the next one needs a new page.
	written := 0
	for {
		fill(t, l, 1)
		written++
		if err := l.Checkpoint(ctx); err != nil {
			t.Fatal(err)
		}
		st, err := os.Stat(f.opts.CheckpointPath)
		if err != nil {
			t.Fatal(err)
		}
		if room := 4096 - st.Size()%4096; room < 100 {
			break
		}
	}
	fill(t, l, 1) // a row the next checkpoint must cover
	written++
	cpBefore, err := os.ReadFile(f.opts.CheckpointPath)
	if err != nil {
		t.Fatal(err)
	}

	ballast := fillFS(t, dir)
	if err := l.Checkpoint(ctx); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("checkpoint on a full disk: %v, want ENOSPC", err)
	}
	if cp, _ := os.ReadFile(f.opts.CheckpointPath); string(cp) != string(cpBefore) {
		t.Fatalf("a failed checkpoint changed the file: %d bytes, was %d", len(cp), len(cpBefore))
	}
	if err := l.Ping(ctx); err == nil {
		t.Fatal("Ping is healthy after a failed checkpoint")
	}
	refused := 0
	for i := 0; i < 20; i++ {
		if _, err := l.Append(ctx, testRecord(written+i)); err != nil {
			refused++
		}
	}
	if refused == 0 {
		t.Fatal("no append failed on a full disk")
	}
	written += 20 - refused

	if err := os.Remove(ballast); err != nil {
		t.Fatal(err)
	}
	fill(t, l, 3)
	written += 3
	if err := l.Checkpoint(ctx); err != nil {
		t.Fatalf("checkpoint after space returned: %v", err)
	}
	if err := l.Ping(ctx); err != nil {
		t.Fatalf("Ping after space returned: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != int64(written) {
		t.Fatalf("Verify: %+v, want OK with %d rows", rep, written)
	}
	l2 := f.open(t)
	fill(t, l2, 1)
	if err := l2.Close(); err != nil {
		t.Fatal(err)
	}
}
