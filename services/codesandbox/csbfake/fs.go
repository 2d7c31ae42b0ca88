package csbfake

import (
	"errors"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// errnos the agent reports in data.errno.
const (
	errENOENT  = 2
	errEACCES  = 13
	errEEXIST  = 17
	errENOTDIR = 20
	errEISDIR  = 21
	errENOTEMP = 39 // ENOTEMPTY
)

// vmFS is a VM's file system: a host directory that stands for the VM's
// root, so that commands run with the real shell (SetRealShell) see the
// same files as the agent's fs/* methods. Every access goes through an
// *os.Root: nothing a command in the VM does (a symlink to /etc/passwd)
// makes the fake touch a host file outside the directory.
type vmFS struct {
	dir  string
	root *os.Root
}

// vmDirs exist in every VM.
var vmDirs = []string{"/project", UserWorkspacePath, WorkspacePath, "/tmp"}

func newFS(dir string) (*vmFS, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	f := &vmFS{dir: dir, root: root}
	for _, d := range vmDirs {
		if err := root.MkdirAll(rel(d), 0o755); err != nil {
			root.Close()
			return nil, err
		}
	}
	if err := root.Chmod("tmp", 0o1777); err != nil {
		root.Close()
		return nil, err
	}
	return f, nil
}

func (f *vmFS) close() { _ = f.root.Close() }

// hostPath is where VM path p (absolute, clean) lives on the host.
func (f *vmFS) hostPath(p string) string { return filepath.Join(f.dir, filepath.FromSlash(rel(p))) }

// rel turns a clean absolute VM path into a path for the root.
func rel(p string) string {
	r := strings.TrimPrefix(path.Clean("/"+p), "/")
	if r == "" {
		return "."
	}
	return r
}

// abs resolves p against the workspace, as the agent does.
func (f *vmFS) abs(p string) string { return absFrom(UserWorkspacePath, p) }

func absFrom(cwd, p string) string {
	if !path.IsAbs(p) {
		p = path.Join(cwd, p)
	}
	return path.Clean(p)
}

// errnoOf maps an os error to the errno the agent would report; a path
// that would leave the VM's root (through a symlink) is EACCES.
func errnoOf(err error) int {
	if err == nil {
		return 0
	}
	var no syscall.Errno
	if errors.As(err, &no) {
		return int(no)
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errENOENT
	case errors.Is(err, fs.ErrExist):
		return errEEXIST
	}
	return errEACCES
}

func (f *vmFS) isDir(p string) bool {
	fi, err := f.root.Stat(rel(p))
	return err == nil && fi.IsDir()
}

func (f *vmFS) isFile(p string) bool {
	fi, err := f.root.Stat(rel(p))
	return err == nil && fi.Mode().IsRegular()
}

// read returns a regular file's content.
func (f *vmFS) read(p string) ([]byte, int) {
	if f.isDir(p) {
		return nil, errEISDIR
	}
	b, err := f.root.ReadFile(rel(p))
	return b, errnoOf(err)
}

// write stores a file; with parents it creates missing directories.
func (f *vmFS) write(p string, b []byte, parents bool) int {
	if parents {
		if err := f.root.MkdirAll(rel(path.Dir(p)), 0o755); err != nil {
			return errnoOf(err)
		}
	}
	if !f.isDir(path.Dir(p)) {
		return errENOENT
	}
	if f.isDir(p) {
		return errEISDIR
	}
	return errnoOf(f.root.WriteFile(rel(p), b, 0o644))
}

func (f *vmFS) mkdir(p string, recursive bool) int {
	if f.isFile(p) {
		return errEEXIST
	}
	if f.isDir(p) {
		if recursive {
			return 0
		}
		return errEEXIST
	}
	parent := path.Dir(p)
	if f.isFile(parent) {
		return errENOTDIR
	}
	if recursive {
		return errnoOf(f.root.MkdirAll(rel(p), 0o755))
	}
	return errnoOf(f.root.Mkdir(rel(p), 0o755))
}

// remove deletes a file, a symlink (not its target) or, with recursive,
// a directory tree; a non-empty directory without it is ENOTEMPTY.
func (f *vmFS) remove(p string, recursive bool) int {
	r := rel(p)
	if r == "." {
		return errEACCES
	}
	if _, err := f.root.Lstat(r); err != nil {
		return errnoOf(err)
	}
	if recursive {
		return errnoOf(f.root.RemoveAll(r))
	}
	err := f.root.Remove(r)
	if errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST) {
		return errENOTEMP
	}
	return errnoOf(err)
}

// statInfo is FSStatResult's content.
type statInfo struct {
	dir, symlink bool
	size         int64
	mtime        time.Time
}

// stat describes p without following a final symlink; a symlink's type is
// its target's (file when the target is missing), as isSymlink says.
func (f *vmFS) stat(p string) (statInfo, int) {
	fi, err := f.root.Lstat(rel(p))
	if err != nil {
		return statInfo{}, errnoOf(err)
	}
	st := statInfo{dir: fi.IsDir(), size: fi.Size(), mtime: fi.ModTime()}
	if fi.Mode()&fs.ModeSymlink != 0 {
		st.symlink = true
		if t, err := f.root.Stat(rel(p)); err == nil {
			st.dir = t.IsDir()
		}
	}
	return st, 0
}

// dirEntry is one fs/readdir entry.
type dirEntry struct {
	name         string
	dir, symlink bool
}

// entries lists a directory, sorted by name.
func (f *vmFS) entries(p string) ([]dirEntry, int) {
	d, err := f.root.Open(rel(p))
	if err != nil {
		return nil, errnoOf(err)
	}
	defer d.Close()
	ents, err := d.ReadDir(-1)
	if err != nil {
		return nil, errnoOf(err)
	}
	out := make([]dirEntry, 0, len(ents))
	for _, e := range ents {
		de := dirEntry{name: e.Name(), dir: e.IsDir(), symlink: e.Type()&fs.ModeSymlink != 0}
		if de.symlink {
			st, _ := f.stat(path.Join(p, e.Name()))
			de.dir = st.dir
		}
		out = append(out, de)
	}
	slices.SortFunc(out, func(a, b dirEntry) int { return strings.Compare(a.name, b.name) })
	return out, 0
}

// list returns the names directly under dir, sorted.
func (f *vmFS) list(dir string) []string {
	ents, _ := f.entries(dir)
	names := make([]string, len(ents))
	for i, e := range ents {
		names[i] = e.name
	}
	return names
}

// files snapshots every regular file by absolute VM path. Symlinks are
// not followed.
func (f *vmFS) files() map[string][]byte {
	out := map[string][]byte{}
	_ = fs.WalkDir(f.root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		if b, err := f.root.ReadFile(p); err == nil {
			out["/"+p] = b
		}
		return nil
	})
	return out
}

// clone copies the tree into dir (regular files and directories; the
// fake's own writes make nothing else in templates).
func (f *vmFS) clone(dir string) (*vmFS, error) {
	c, err := newFS(dir)
	if err != nil {
		return nil, err
	}
	err = fs.WalkDir(f.root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		switch {
		case err != nil || p == ".":
			return err
		case d.IsDir():
			return c.root.MkdirAll(p, 0o755)
		case d.Type().IsRegular():
			b, err := f.root.ReadFile(p)
			if err != nil {
				return err
			}
			return c.root.WriteFile(p, b, 0o644)
		}
		return nil
	})
	if err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}
