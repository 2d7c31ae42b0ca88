package agent

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
)

func TestSocketHelpersRefuseSymlinks(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "host-file")
	if err := os.WriteFile(target, []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "real.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	// A symlink to a file and one to a real socket: both are refused.
	for _, to := range []string{target, sock} {
		link := filepath.Join(dir, "link-"+filepath.Base(to))
		if err := os.Symlink(to, link); err != nil {
			t.Fatal(err)
		}
		if _, err := DialSocket(context.Background(), link); !errors.Is(err, ErrNotSocket) {
			t.Errorf("dial through a symlink to %s: %v", filepath.Base(to), err)
		}
		if err := SetSocketAccess(link, os.Getuid(), os.Getgid(), 0o666); !errors.Is(err, ErrNotSocket) {
			t.Errorf("chmod through a symlink to %s: %v", filepath.Base(to), err)
		}
	}
	if fi, _ := os.Stat(target); fi.Mode().Perm() != 0o600 {
		t.Fatalf("the link's target was changed: %v", fi.Mode())
	}
	// The socket itself.
	if err := SetSocketAccess(sock, -1, -1, 0o606); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Lstat(sock); fi.Mode().Perm() != 0o606 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket mode %v", fi.Mode())
	}
	c, err := DialSocket(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, err := DialSocket(context.Background(), target); !errors.Is(err, ErrNotSocket) {
		t.Fatalf("dial a regular file: %v", err)
	}
}
