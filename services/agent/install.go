package agent

import (
	"io"
	"os"
	"path/filepath"
)

// Install copies the agent binary src to dst, mode 0755. The copy goes
// through a temporary file and a rename, so sandboxes that mounted the old
// dst keep the inode they started with. When src is dst only the mode is
// set.
func Install(src, dst string) error {
	if src == dst {
		return os.Chmod(dst, 0o755)
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".sandbox-agent-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, in); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o755); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}
