package agent

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
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

// ListenSocket works where the full path is past sun_path's 108 bytes (a
// deep SANDBOX_ROOT made every job with network fail), and removes the
// socket when it closes.
func TestListenSocketLongPath(t *testing.T) {
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 100))
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "egress-0123456789abcdef.sock")
	if len(p) <= 108 {
		t.Fatalf("path of %d bytes is not long enough to test", len(p))
	}
	ln, err := ListenSocket(p)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		if c, err := ln.Accept(); err == nil {
			_, _ = c.Write([]byte("ok"))
			c.Close()
		}
	}()
	c, err := DialSocket(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(c)
	c.Close()
	if string(b) != "ok" {
		t.Fatalf("read %q", b)
	}
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(p); !os.IsNotExist(err) {
		t.Fatalf("socket left behind after Close: %v", err)
	}
}
