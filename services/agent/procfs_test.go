package agent

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// TestReadProcFile: a file in full, past the first read's 4 KiB, a /proc
// file that hands out whole records per read in full too (smaps: one
// VmFlags line for each mapping maps lists), a missing one as an os
// error.
func TestReadProcFile(t *testing.T) {
	want := bytes.Repeat([]byte("0123456789abcdef\n"), 1000)
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, want, 0o600); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadProcFile(p); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("regular file: %d bytes, %v; want %d", len(got), err, len(want))
	}
	smaps, err := ReadProcFile("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	if n, m := bytes.Count(smaps, []byte("\nVmFlags:")), bytes.Count(maps, []byte("\n")); len(smaps) <= 4096 || n != m {
		t.Fatalf("smaps: %d bytes, %d mappings; maps lists %d", len(smaps), n, m)
	}
	if _, err := ReadProcFile("/proc/self/no-such-file"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
}
