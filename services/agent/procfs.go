package agent

import (
	"os"

	"golang.org/x/sys/unix"
)

// ReadProcFile reads a small file of /proc or of a cgroup (a stat line, a
// task list) with one open and close and reads until end of file, where
// os.ReadFile adds two stats, which the sweep and the stray checks would
// pay for every process of every run. Such files hand out whole lines per
// read, so a read short of the buffer is not yet the end.
func ReadProcFile(path string) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	buf := make([]byte, 0, 4096)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := unix.Read(fd, buf[len(buf):cap(buf)])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &os.PathError{Op: "read", Path: path, Err: err}
		}
		if n == 0 {
			return buf, nil
		}
		buf = buf[:len(buf)+n]
	}
}
