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

// BinaryName is the file name of the agent built alone (cmd/sandbox-agent).
const BinaryName = "sandbox-agent"

// Binary returns the agent binary to put in sandboxes, given the running
// executable exe: the agent built alone (BinaryName) when it is a regular
// file beside exe, else exe itself, whose `agent` command is the same
// agent. The agent alone starts in a few milliseconds where the broker's
// binary takes tens (every package the broker links runs its initialisers
// at each start, the agent included) and maps a fraction of the memory:
// every sandbox start and every idle sandbox pays for that.
func Binary(exe string) string {
	alone := filepath.Join(filepath.Dir(exe), BinaryName)
	if st, err := os.Stat(alone); err == nil && st.Mode().IsRegular() {
		return alone
	}
	return exe
}
