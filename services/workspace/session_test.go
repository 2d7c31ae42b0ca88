package workspace

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Files is the file side of both backends' sessions: every method holds
// the session (and lets it go), a destroyed session refuses, and the first
// write creates the workspace for its owner.
func TestFiles(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "workspaces", "ws1")
	held, destroyed := 0, false
	uid, gid := os.Geteuid(), os.Getegid()
	f := Files{Backend: "test", Dir: dir, Limits: DefaultLimits(),
		Hold: func() (func(), error) {
			if destroyed {
				return nil, brokererr.New(brokererr.SandboxNotFound, "the sandbox was destroyed")
			}
			held++
			return func() { held-- }, nil
		},
		Owner: func(context.Context) (int, int, error) { return uid, gid, nil },
	}
	if files, err := f.ListFiles(ctx, ""); err != nil || len(files) != 0 {
		t.Fatalf("before the first write: %v, %v", files, err)
	}
	if err := f.WriteFile(ctx, "a/b.txt", []byte("hi"), false); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Dir(dir)); err != nil || fi.Mode().Perm() != 0o711 {
		t.Fatalf("parent of a new workspace: %v %v", fi, err)
	}
	got, err := f.ReadFile(ctx, "a/b.txt", 0, 0)
	if err != nil || string(got.Data) != "hi" {
		t.Fatalf("read back: %+v %v", got, err)
	}
	if files, err := f.ListFiles(ctx, ""); err != nil || len(files) != 1 || files[0].Path != "a/b.txt" {
		t.Fatalf("list: %+v %v", files, err)
	}
	if held != 0 {
		t.Fatalf("%d holds not released", held)
	}
	destroyed = true
	for name, err := range map[string]error{
		"write": f.WriteFile(ctx, "c.txt", []byte("x"), false),
		"read":  func() error { _, err := f.ReadFile(ctx, "a/b.txt", 0, 0); return err }(),
		"list":  func() error { _, err := f.ListFiles(ctx, ""); return err }(),
	} {
		if brokererr.CodeOf(err) != brokererr.SandboxNotFound {
			t.Errorf("%s on a destroyed session: %v", name, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "c.txt")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a destroyed session was written: %v", err)
	}
	f.Owner = func(context.Context) (int, int, error) { return 0, 0, errors.New("no uid left") }
	destroyed = false
	if err := f.WriteFile(ctx, "d.txt", []byte("x"), false); err == nil {
		t.Fatal("a write without an owner succeeded")
	}
}
