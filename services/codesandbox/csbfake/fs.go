package csbfake

import (
	"maps"
	"path"
	"slices"
	"strings"
)

// errnos the agent reports in data.errno.
const (
	errENOENT  = 2
	errEEXIST  = 17
	errENOTDIR = 20
	errEISDIR  = 21
)

// memFS is a VM's file system: files and directories by absolute path.
type memFS struct {
	files map[string][]byte
	dirs  map[string]bool
}

func newFS() *memFS {
	return &memFS{
		files: map[string][]byte{},
		dirs:  map[string]bool{"/": true, "/project": true, UserWorkspacePath: true, WorkspacePath: true, "/tmp": true},
	}
}

func (f *memFS) clone() *memFS {
	c := &memFS{files: map[string][]byte{}, dirs: maps.Clone(f.dirs)}
	for p, b := range f.files {
		c.files[p] = slices.Clone(b)
	}
	return c
}

// abs resolves p against the workspace, as the agent does.
func (f *memFS) abs(p string) string { return absFrom(UserWorkspacePath, p) }

func absFrom(cwd, p string) string {
	if !path.IsAbs(p) {
		p = path.Join(cwd, p)
	}
	return path.Clean(p)
}

func (f *memFS) mkdirAll(p string) {
	for d := p; d != "/" && !f.dirs[d]; d = path.Dir(d) {
		f.dirs[d] = true
	}
}

// write stores a file; with parents it creates missing directories.
func (f *memFS) write(p string, b []byte, parents bool) int {
	if parents {
		f.mkdirAll(path.Dir(p))
	}
	if !f.dirs[path.Dir(p)] {
		return errENOENT
	}
	if f.dirs[p] {
		return errEISDIR
	}
	f.files[p] = slices.Clone(b)
	return 0
}

func (f *memFS) mkdir(p string, recursive bool) int {
	if _, ok := f.files[p]; ok {
		return errEEXIST
	}
	if f.dirs[p] {
		if recursive {
			return 0
		}
		return errEEXIST
	}
	parent := path.Dir(p)
	if _, ok := f.files[parent]; ok {
		return errENOTDIR
	}
	if !f.dirs[parent] {
		if !recursive {
			return errENOENT
		}
		f.mkdirAll(parent)
	}
	f.dirs[p] = true
	return 0
}

// list returns the names directly under dir, sorted.
func (f *memFS) list(dir string) []string {
	prefix := strings.TrimSuffix(dir, "/") + "/"
	seen := map[string]bool{}
	add := func(p string) {
		if rest, ok := strings.CutPrefix(p, prefix); ok && rest != "" && !strings.Contains(rest, "/") {
			seen[rest] = true
		}
	}
	for p := range f.files {
		add(p)
	}
	for p := range f.dirs {
		add(p)
	}
	return slices.Sorted(maps.Keys(seen))
}
