package runnerfs

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"
)

// Seal normalises the tree at <dir>/rootfs and writes <dir>/manifest.json
// from m (its Entries, Bytes, Tree, Created and Format are filled in). It
// runs as root on a tree nobody else can reach yet (the build's temporary
// directory): every entry becomes owned by root, loses group and other
// write and the setuid/setgid bits; device nodes, FIFOs, sockets and
// /.dockerenv go; layout's mount points are created.
func Seal(dir string, m Manifest, layout Layout) (Manifest, error) {
	if os.Geteuid() != 0 {
		return Manifest{}, errors.New("runnerfs: seal needs root (the tree must be owned by root)")
	}
	r, err := os.OpenRoot(filepath.Join(dir, RootfsName))
	if err != nil {
		return Manifest{}, err
	}
	defer r.Close()
	if err := normalise(r); err != nil {
		return Manifest{}, err
	}
	if err := makeLayout(r, layout); err != nil {
		return Manifest{}, err
	}
	sum, err := digest(r, layout)
	if err != nil {
		return Manifest{}, err
	}
	m.Format, m.Created = Format, time.Now().UTC().Truncate(time.Second)
	m.Entries, m.Bytes, m.Tree = sum.entries, sum.bytes, sum.tree
	if m.Env == nil {
		m.Env = []string{}
	}
	if err := m.check(); err != nil {
		return Manifest{}, err
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return Manifest{}, err
	}
	tmp := filepath.Join(dir, "."+ManifestName+".tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return Manifest{}, err
	}
	for _, p := range []string{tmp, dir} {
		if err := os.Lchown(p, 0, 0); err != nil {
			return Manifest{}, err
		}
	}
	if err := os.Chmod(tmp, 0o644); err != nil {
		return Manifest{}, err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return Manifest{}, err
	}
	return m, os.Rename(tmp, filepath.Join(dir, ManifestName))
}

// normalise applies Seal's ownership and mode rules to every entry.
func normalise(r *os.Root) error {
	_ = r.Remove(".dockerenv")
	return fs.WalkDir(r.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		t := d.Type()
		if t&(fs.ModeDevice|fs.ModeCharDevice|fs.ModeNamedPipe|fs.ModeSocket|fs.ModeIrregular) != 0 {
			return r.Remove(p)
		}
		if err := r.Lchown(p, 0, 0); err != nil {
			return err
		}
		if t&fs.ModeSymlink != 0 {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		mode := fi.Mode()
		want := mode.Perm() &^ 0o022
		if mode&fs.ModeSticky != 0 {
			want |= fs.ModeSticky
		}
		if mode&(fs.ModeSetuid|fs.ModeSetgid) != 0 || mode.Perm()&0o022 != 0 {
			return r.Chmod(p, want)
		}
		return nil
	})
}

// makeLayout creates the mount points the sandbox needs.
func makeLayout(r *os.Root, l Layout) error {
	for _, d := range l.Dirs {
		if err := r.MkdirAll(rel(d), 0o755); err != nil {
			return err
		}
	}
	for _, f := range l.Files {
		if err := r.MkdirAll(path.Dir(rel(f)), 0o755); err != nil {
			return err
		}
		fh, err := r.OpenFile(rel(f), os.O_WRONLY|os.O_CREATE, 0o644)
		if err != nil {
			return err
		}
		if err := fh.Close(); err != nil {
			return err
		}
	}
	for p, target := range l.Symlinks {
		if got, err := r.Readlink(rel(p)); err == nil && got == target {
			continue
		}
		if err := r.Symlink(target, rel(p)); err != nil {
			return err
		}
	}
	return nil
}

func rel(p string) string { return strings.TrimPrefix(path.Clean("/"+p), "/") }
