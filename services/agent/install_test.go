package agent

import (
	"os"
	"path/filepath"
	"testing"
)

// TestBinary: sandboxes get the agent built alone when it stands beside
// the running executable as a regular file, else the executable itself.
func TestBinary(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "sandbox-broker")
	alone := filepath.Join(dir, BinaryName)
	if err := os.WriteFile(exe, []byte("broker"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got := Binary(exe); got != exe {
		t.Errorf("no %s beside it: got %s, want the executable", BinaryName, got)
	}
	if err := os.Mkdir(alone, 0o755); err != nil {
		t.Fatal(err)
	}
	if got := Binary(exe); got != exe {
		t.Errorf("%s is a directory: got %s, want the executable", BinaryName, got)
	}
	if err := os.Remove(alone); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(alone, []byte("agent"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got := Binary(exe); got != alone {
		t.Errorf("with %s beside it: got %s", BinaryName, got)
	}
}
