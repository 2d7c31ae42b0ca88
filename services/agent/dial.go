package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// ErrNotSocket is returned when the entry at a socket path is anything but
// a Unix socket (a symlink included).
var ErrNotSocket = errors.New("not a unix socket")

// DialSocket connects to the Unix socket at path without following a
// symlink in its last component. Agent sockets and preview sockets live in
// directories the sandbox can write, so a sandbox could put a symlink there
// pointing at a host socket (docker.sock, the broker's own). The entry is
// opened with O_PATH|O_NOFOLLOW relative to its directory, checked with
// fstat to be a socket, and connected through /proc/self/fd/<fd>: that
// magic link names the very inode that was checked, so nothing can be
// swapped in between check and connect.
func DialSocket(ctx context.Context, path string) (net.Conn, error) {
	fd, err := openSocket(path)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var d net.Dialer
	return d.DialContext(ctx, "unix", fmt.Sprintf("/proc/self/fd/%d", fd))
}

// SetSocketAccess gives the Unix socket at path to uid:gid (uid < 0 keeps
// the owner) with mode, following no symlink: the broker (root) sets up
// sockets in directories the sandbox writes, where a plain chown or chmod
// could be raced onto a host file through a symlink.
func SetSocketAccess(path string, uid, gid int, mode uint32) error {
	fd, err := openSocket(path)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if uid >= 0 {
		if err := unix.Fchownat(fd, "", uid, gid, unix.AT_EMPTY_PATH); err != nil {
			return fmt.Errorf("chown socket: %w", err)
		}
	}
	// chmod through the magic link reaches the checked inode itself.
	if err := unix.Chmod(fmt.Sprintf("/proc/self/fd/%d", fd), mode); err != nil {
		return fmt.Errorf("chmod socket: %w", err)
	}
	return nil
}

// openSocket opens path's last component with O_PATH|O_NOFOLLOW and checks
// that it is a socket; the caller closes the fd.
func openSocket(path string) (int, error) {
	dir, name := filepath.Split(path)
	dfd, err := unix.Open(filepath.Clean(dir), unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open socket dir: %w", err)
	}
	defer unix.Close(dfd)
	fd, err := unix.Openat(dfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open socket: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("stat socket: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		unix.Close(fd)
		return -1, ErrNotSocket
	}
	return fd, nil
}

// ListenSocket listens on a Unix socket at path, whatever its length: it
// binds through /proc/self/fd/<dir>/<name>, so a SANDBOX_ROOT deep enough
// to push the full path past sun_path's 108 bytes still works. The
// directory is held open, not followed through a symlink, and the socket
// is unlinked relative to it when the listener closes.
func ListenSocket(path string) (net.Listener, error) {
	dir, name := filepath.Split(path)
	dfd, err := unix.Open(filepath.Clean(dir), unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open socket dir: %w", err)
	}
	ln, err := net.Listen("unix", fmt.Sprintf("/proc/self/fd/%d/%s", dfd, name))
	if err != nil {
		unix.Close(dfd)
		return nil, err
	}
	ul := ln.(*net.UnixListener)
	ul.SetUnlinkOnClose(false) // the magic path names another dir once dfd is closed
	return &dirListener{UnixListener: ul, dfd: dfd, name: name}, nil
}

type dirListener struct {
	*net.UnixListener
	dfd  int
	name string
	once sync.Once
}

func (l *dirListener) Close() error {
	err := l.UnixListener.Close()
	l.once.Do(func() {
		_ = unix.Unlinkat(l.dfd, l.name, 0)
		unix.Close(l.dfd)
	})
	return err
}
