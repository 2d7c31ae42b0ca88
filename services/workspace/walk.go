package workspace

import (
	"container/heap"
	"errors"
	"io"
	"io/fs"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// Walk bounds: the sandbox can create millions of entries or very deep
// trees; walks stop there instead of running unbounded.
const (
	WalkMaxEntries = 200_000 // entries read per walk
	WalkMaxDepth   = 128     // components, for Usage
)

// ErrWalkLimit is wrapped by errors of walks that hit WalkMaxEntries or
// WalkMaxDepth.
var ErrWalkLimit = errors.New("workspace has too many entries or is nested too deeply")

// DefaultListEntries is List's cap when maxEntries <= 0.
const DefaultListEntries = 1000

var errStopWalk = errors.New("stop walk")

// walk visits every entry under start ("" is the workspace root), never
// following symlinks: directories are opened through the root with
// openNoFollow, one at a time, and entry types come from readdir (no
// stat, so a symlink to a directory is not a directory). fn receives the workspace-relative path and the entry type.
// Directories whose path has maxDepth components are not entered. It
// returns complete=false when a bound was hit.
func (w *Workspace) walk(start string, maxDepth int, fn func(rel string, typ fs.FileMode) error) (complete bool, err error) {
	complete = true
	visited := 0
	stack := []string{start}
	for len(stack) > 0 {
		dir := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		name := dir
		if name == "" {
			name = "."
		}
		f, _, err := w.openNoFollow(name, os.O_RDONLY|syscall.O_DIRECTORY)
		if err != nil {
			if dir == start {
				return false, notFound(err)
			}
			continue // removed or replaced since it was listed
		}
		depth := 0
		if dir != "" {
			depth = strings.Count(dir, "/") + 1
		}
		for {
			ents, rerr := f.ReadDir(256)
			for _, e := range ents {
				visited++
				if visited > WalkMaxEntries {
					_ = f.Close()
					return false, nil
				}
				rel := e.Name()
				if dir != "" {
					rel = dir + "/" + rel
				}
				if err := fn(rel, e.Type()); err != nil {
					_ = f.Close()
					if errors.Is(err, errStopWalk) {
						return complete, nil
					}
					return false, err
				}
				if e.IsDir() { // d_type: a symlink to a directory is not IsDir
					if depth+1 >= maxDepth {
						complete = false
					} else {
						stack = append(stack, rel)
					}
				}
			}
			if rerr != nil {
				if !errors.Is(rerr, io.EOF) {
					complete = false
				}
				break
			}
		}
		_ = f.Close()
	}
	return complete, nil
}

// Usage counts every entry (files, directories, symlinks, FIFOs, ...)
// without following symlinks, and sums the sizes of regular files. A tree
// beyond WalkMaxEntries or WalkMaxDepth gives a QuotaExceeded error (with
// the partial counts), so quota checks fail closed.
func (w *Workspace) Usage() (files int, bytes int64, err error) {
	complete, err := w.walk("", WalkMaxDepth, func(rel string, typ fs.FileMode) error {
		files++
		if typ.IsRegular() {
			fi, err := w.root.Lstat(rel)
			switch {
			case err == nil:
				if fi.Mode().IsRegular() {
					bytes += fi.Size()
				}
			case errors.Is(err, fs.ErrNotExist): // deleted meanwhile
			default:
				return brokererr.Wrap(err, brokererr.QuotaExceeded, "cannot measure workspace")
			}
		}
		return nil
	})
	if err != nil {
		return files, bytes, err
	}
	if !complete {
		return files, bytes, brokererr.Wrap(ErrWalkLimit, brokererr.QuotaExceeded, "workspace has too many entries or is nested too deeply")
	}
	return files, bytes, nil
}

// listable reports whether a walked regular file is one the tools can name.
func (w *Workspace) listable(rel string) bool {
	if strings.HasPrefix(rel[strings.LastIndexByte(rel, '/')+1:], tmpPrefix) {
		return false
	}
	_, err := w.validate(rel)
	return err == nil
}

// List returns the regular files under dir ("" or "." for the whole
// workspace), recursively, with workspace-relative paths sorted bytewise.
// Symlinks are skipped and never followed, and so are files whose paths
// ValidatePath refuses (they could not be read anyway). At most maxEntries
// (DefaultListEntries if <= 0) are returned: the first ones in sorted order;
// truncated reports that more exist or that the walk hit its bounds.
func (w *Workspace) List(dir string, maxEntries int) ([]sandbox.FileInfo, bool, error) {
	if maxEntries <= 0 {
		maxEntries = DefaultListEntries
	}
	start := ""
	if dir != "" && dir != "." {
		d, err := w.validate(dir)
		if err != nil {
			return nil, false, err
		}
		start = d
	}
	h := &maxHeap{}
	truncated := false
	complete, err := w.walk(start, MaxPathDepth, func(rel string, typ fs.FileMode) error {
		if !typ.IsRegular() || !w.listable(rel) {
			return nil
		}
		if h.Len() < maxEntries {
			heap.Push(h, rel)
		} else {
			truncated = true
			if rel < (*h)[0] {
				(*h)[0] = rel
				heap.Fix(h, 0)
			}
		}
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	paths := []string(*h)
	slices.Sort(paths)
	out := make([]sandbox.FileInfo, 0, len(paths))
	for _, p := range paths {
		fi, err := w.root.Lstat(p)
		if err != nil || !fi.Mode().IsRegular() {
			continue // changed since it was listed
		}
		out = append(out, sandbox.FileInfo{Path: p, Size: fi.Size(), ModTime: fi.ModTime()})
	}
	return out, truncated || !complete, nil
}

// MaxListFiles bounds ListFiles.
const MaxListFiles = 10000

// ListFiles is a session's ListFiles: List of sub (at most MaxListFiles
// entries) in the workspace at dir, where a workspace not created yet is
// empty.
func ListFiles(dir string, l Limits, sub string) ([]sandbox.FileInfo, error) {
	w, err := Open(dir, l)
	if brokererr.CodeOf(err) == brokererr.SandboxNotFound && (sub == "" || sub == ".") {
		return []sandbox.FileInfo{}, nil
	}
	if err != nil {
		return nil, err
	}
	defer w.Close()
	list, _, err := w.List(sub, MaxListFiles)
	return list, err
}

// maxHeap keeps the smallest paths seen, largest on top.
type maxHeap []string

func (h maxHeap) Len() int           { return len(h) }
func (h maxHeap) Less(i, j int) bool { return h[i] > h[j] }
func (h maxHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *maxHeap) Push(x any)        { *h = append(*h, x.(string)) }
func (h *maxHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// FileStamp identifies one version of a regular file.
type FileStamp struct {
	Size    int64
	ModTime time.Time
	Inode   uint64 // 0 where unavailable
}

// Equal compares stamps (ModTime with time.Time.Equal).
func (s FileStamp) Equal(o FileStamp) bool {
	return s.Size == o.Size && s.Inode == o.Inode && s.ModTime.Equal(o.ModTime)
}

// Snapshot stamps every regular file List could return (symlinks are not
// followed; invalid names and Write's temporary files are skipped), keyed
// by workspace-relative path. If the walk hits its bounds it returns the
// partial snapshot with an error wrapping ErrWalkLimit.
func (w *Workspace) Snapshot() (map[string]FileStamp, error) {
	snap := make(map[string]FileStamp)
	complete, err := w.walk("", MaxPathDepth, func(rel string, typ fs.FileMode) error {
		if !typ.IsRegular() || !w.listable(rel) {
			return nil
		}
		fi, err := w.root.Lstat(rel)
		if err != nil || !fi.Mode().IsRegular() {
			return nil
		}
		st := FileStamp{Size: fi.Size(), ModTime: fi.ModTime()}
		if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
			st.Inode = sys.Ino
		}
		snap[rel] = st
		return nil
	})
	if err != nil {
		return snap, err
	}
	if !complete {
		return snap, brokererr.Wrap(ErrWalkLimit, brokererr.QuotaExceeded, "workspace has too many entries or is nested too deeply")
	}
	return snap, nil
}

// Changed returns the paths in after that are new or whose stamp differs
// from before, sorted. Deleted paths are not reported.
func Changed(before, after map[string]FileStamp) []string {
	var out []string
	for p, a := range after {
		if b, ok := before[p]; !ok || !b.Equal(a) {
			out = append(out, p)
		}
	}
	slices.Sort(out)
	return out
}

// ChangedFiles lists the files new or changed since before (see Changed)
// as they are now; nil when there are none or the walk fails.
func (w *Workspace) ChangedFiles(before map[string]FileStamp) []sandbox.FileInfo {
	after, err := w.Snapshot()
	if err != nil {
		return nil
	}
	var out []sandbox.FileInfo
	for _, p := range Changed(before, after) {
		out = append(out, sandbox.FileInfo{Path: p, Size: after[p].Size, ModTime: after[p].ModTime})
	}
	return out
}

// RemoveChanged deletes, as far as it can, the files new or changed since
// before: what a run or job that broke the quota wrote.
func (w *Workspace) RemoveChanged(before map[string]FileStamp) {
	for _, f := range w.ChangedFiles(before) {
		_ = w.Remove(f.Path)
	}
}
