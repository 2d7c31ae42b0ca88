// Package inherited keeps the file descriptors a process was started with
// from reaching the processes it starts. Go opens every descriptor of its
// own close-on-exec, but os/exec passes on any inherited descriptor that
// lacks the flag: a host directory on the launching shell's fd 7 would
// reach every sandbox (issue 15).
package inherited

import (
	"errors"
	"math"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// CloseOnExec marks every descriptor above stderr close-on-exec, so no
// child inherits one. The broker calls it first thing: the descriptors
// stay open (and unused) in the broker itself.
func CloseOnExec() error {
	err := unix.CloseRange(3, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC)
	if err == nil || !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
		return err
	}
	return markEach() // before Linux 5.11
}

// markEach is CloseOnExec one descriptor at a time.
func markEach() error {
	return each(func(fd int, flags int) error {
		if flags&unix.FD_CLOEXEC != 0 {
			return nil
		}
		_, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, flags|unix.FD_CLOEXEC)
		return err
	})
}

// Close closes every descriptor above stderr that is not close-on-exec.
// Right after exec that is exactly the inherited ones: Go's own are
// close-on-exec. The in-sandbox agent calls it before anything else, so
// sandbox code finds nothing through /proc/<agent>/fd either, whatever
// the launch chain let through.
func Close() error {
	return each(func(fd int, flags int) error {
		if flags&unix.FD_CLOEXEC != 0 {
			return nil
		}
		return unix.Close(fd)
	})
}

// each calls fn for every open descriptor above stderr with its flags.
func each(fn func(fd, flags int) error) error {
	d, err := os.Open("/proc/self/fd") // close-on-exec itself, so fn skips it
	if err != nil {
		return err
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return err
	}
	for _, n := range names {
		fd, err := strconv.Atoi(n)
		if err != nil || fd <= 2 {
			continue
		}
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		if errors.Is(err, unix.EBADF) { // closed since the listing (our own directory handle)
			continue
		}
		if err != nil {
			return err
		}
		if err := fn(fd, flags); err != nil {
			return err
		}
	}
	return nil
}
