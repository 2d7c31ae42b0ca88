package workspace

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// Files is a sandbox session's workspace as every backend serves it: the
// file methods of sandbox.Session, done on the host directory, and the one
// way a backend opens it for a run. Backends embed it in their Session.
type Files struct {
	Backend string // named in errors: "docker", "process"
	Dir     string // the host directory (sandbox.SessionRef.Dir)
	Limits  Limits
	// Hold is called first by every method: it refuses once the session
	// is destroyed, and returns what to call when done (the Docker engine
	// keeps its session lock, so files change only between runs).
	Hold func() (release func(), err error)
	// Owner gives the uid and gid that own what the broker writes; it is
	// called while held.
	Owner func(ctx context.Context) (uid, gid int, err error)
}

// OpenWorkspace opens the workspace, creating it on first use, and gives
// it to the Owner when another uid has it (EnsureOwner). Call it while
// held.
func (f *Files) OpenWorkspace(ctx context.Context) (*Workspace, error) {
	uid, gid, err := f.Owner(ctx)
	if err != nil {
		return nil, err
	}
	own := WithOwner(uid, gid)
	if _, err := os.Lstat(f.Dir); errors.Is(err, fs.ErrNotExist) {
		// The sandbox's uid must reach the workspace through its parent.
		if err := os.MkdirAll(filepath.Dir(f.Dir), 0o711); err != nil {
			return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot create the workspace")
		}
		return Create(f.Dir, WithLimits(f.Limits), own)
	}
	w, err := OpenOwned(f.Dir, f.Limits, own)
	if errors.Is(err, fs.ErrPermission) {
		return nil, f.foreign()
	}
	return w, err
}

// foreign is the error for a workspace the broker may not enter: as root
// a backend gives a workspace to the session's uid, but a broker that is
// not root cannot take over one another backend, or a broker running as
// root, left to another uid. Waiting does not help.
func (f *Files) foreign() error {
	owner := "another user"
	if fi, err := os.Lstat(f.Dir); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			owner = fmt.Sprintf("uid %d", st.Uid)
		}
	}
	return brokererr.New(brokererr.Unavailable, "this session's files belong to %s (another sandbox backend, or a broker running as root, made them); "+
		"the %s backend cannot take them over while the broker runs as uid %d: start a new session, or run the broker as root", owner, f.Backend, os.Geteuid()).NotRetryable()
}

// WriteFile implements sandbox.Session.
func (f *Files) WriteFile(ctx context.Context, p string, data []byte, overwrite bool) error {
	release, err := f.Hold()
	if err != nil {
		return err
	}
	defer release()
	w, err := f.OpenWorkspace(ctx)
	if err != nil {
		return err
	}
	defer w.Close()
	return w.Write(p, data, overwrite)
}

// PrepareWorkspace implements sandbox.Session: the workspace exists, owned
// by the session's uid (a signed upload link may name a new session).
func (f *Files) PrepareWorkspace(ctx context.Context) error {
	release, err := f.Hold()
	if err != nil {
		return err
	}
	defer release()
	w, err := f.OpenWorkspace(ctx)
	if err != nil {
		return err
	}
	return w.Close()
}

// ReadFile implements sandbox.Session.
func (f *Files) ReadFile(ctx context.Context, p string, offset, max int64) (sandbox.File, error) {
	release, err := f.Hold()
	if err != nil {
		return sandbox.File{}, err
	}
	defer release()
	return ReadFile(f.Dir, f.Limits, p, offset, max)
}

// ListFiles implements sandbox.Session: regular files under dir,
// recursively, sorted by path. Symlinks and special files are not listed.
func (f *Files) ListFiles(ctx context.Context, dir string) ([]sandbox.FileInfo, error) {
	release, err := f.Hold()
	if err != nil {
		return nil, err
	}
	defer release()
	return ListFiles(f.Dir, f.Limits, dir)
}

// RemoveRun removes what a run wrote (RemoveChanged) once it passed the
// quota and was stopped, and returns the error that tells the caller.
func (w *Workspace) RemoveRun(before map[string]FileStamp) error {
	w.RemoveChanged(before)
	return brokererr.New(brokererr.QuotaExceeded,
		"the workspace exceeded its quota (%d files, %d MiB); the run was stopped and the files it wrote were removed", w.lim.MaxFiles, w.lim.MaxBytes>>20)
}
