// Package workspace is one session's host directory, as the broker sees it.
//
// The sandbox (uid 1000 inside a container or process sandbox) writes the
// directory while the broker (root on the host) reads and writes it, so
// every name in it is attacker-controlled: file names, contents, symlinks,
// FIFOs, sockets and directory swaps. All access goes through an *os.Root
// opened once on the directory, so no symlink, ".." or renamed parent can
// make the broker touch anything outside it; the final component is opened
// with O_NOFOLLOW|O_NONBLOCK and must be a regular file.
//
// Quotas checked here are the broker's own bookkeeping for files it writes.
// The sandbox can write the directory directly, so the hard limit must come
// from the filesystem (project quota / size-limited mount).
package workspace

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// Limits bound what the broker itself writes into a workspace.
type Limits struct {
	MaxFiles     int   // entries of every type, directories included
	MaxBytes     int64 // total size of regular files
	MaxFileBytes int64 // one file, for Write and Read
}

// DefaultLimits is 1000 entries, 512 MiB in total, 64 MiB per file.
func DefaultLimits() Limits {
	return Limits{MaxFiles: 1000, MaxBytes: 512 << 20, MaxFileBytes: 64 << 20}
}

// WithDefaults fills zero or negative fields from DefaultLimits.
func (l Limits) WithDefaults() Limits {
	d := DefaultLimits()
	if l.MaxFiles <= 0 {
		l.MaxFiles = d.MaxFiles
	}
	if l.MaxBytes <= 0 {
		l.MaxBytes = d.MaxBytes
	}
	if l.MaxFileBytes <= 0 {
		l.MaxFileBytes = d.MaxFileBytes
	}
	return l
}

// DefaultUID and DefaultGID own what the broker creates: the sandbox user.
const (
	DefaultUID = 1000
	DefaultGID = 1000
)

// Modes of what the broker creates inside the workspace (the workspace
// directory itself is created 0o750).
const (
	FileMode os.FileMode = 0o644
	DirMode  os.FileMode = 0o755
)

// tmpPrefix names Write's temporary files; List and Snapshot skip them.
const tmpPrefix = ".sbx-tmp-"

type options struct {
	uid, gid  int
	dirOwner  bool
	limits    *Limits
	forbidden []string
}

// Option configures Create and Open.
type Option func(*options)

// WithOwner sets the owner given to the workspace directory (Create) and to
// every file and directory Write creates. It only takes effect when the
// broker runs as root (otherwise chown would fail and files are owned by the
// broker's uid). uid or gid < 0 disables chown. Default 1000:1000.
func WithOwner(uid, gid int) Option {
	return func(o *options) { o.uid, o.gid = uid, gid }
}

// WithDirOwner is WithOwner with the owner of the workspace directory as
// Open finds it (the session's sandbox user), for writers that do not know
// the session's uid, such as signed uploads.
func WithDirOwner() Option {
	return func(o *options) { o.dirOwner = true }
}

// WithLimits sets the limits for Create (Open takes them as an argument;
// a WithLimits passed to Open overrides it).
func WithLimits(l Limits) Option {
	return func(o *options) { o.limits = &l }
}

// WithForbiddenNames makes every path-taking method refuse paths with these
// components (see ValidatePath), e.g. ProjectForbiddenNames.
func WithForbiddenNames(names ...string) Option {
	return func(o *options) { o.forbidden = append(o.forbidden, names...) }
}

// Workspace is one session's directory, held open as an *os.Root for its
// lifetime: renaming the directory or replacing it by a symlink after Open
// does not redirect it. Methods are safe for concurrent use; Writes are
// serialised so their quota checks do not race each other.
type Workspace struct {
	root      *os.Root
	lim       Limits
	uid, gid  int
	chown     bool
	forbidden []string
	mu        sync.Mutex // serialises Write
}

// Create makes dir (MkdirAll 0o750; the last component is given to the
// sandbox owner) and opens it with DefaultLimits unless WithLimits is given.
// An existing dir is reused; a symlink at dir is refused.
func Create(dir string, opts ...Option) (*Workspace, error) {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot create workspace")
	}
	o := buildOptions(opts)
	l := DefaultLimits()
	if o.limits != nil {
		l = *o.limits
	}
	w, err := open(dir, l, o)
	if err != nil {
		return nil, err
	}
	if w.chown {
		d, err := w.root.Open(".")
		if err == nil {
			err = d.Chown(w.uid, w.gid)
			if cerr := d.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			_ = w.Close()
			return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot set workspace owner")
		}
	}
	return w, nil
}

// Open opens an existing workspace directory. dir itself must be a real
// directory, not a symlink. Zero fields of l take DefaultLimits' values.
func Open(dir string, l Limits, opts ...Option) (*Workspace, error) {
	o := buildOptions(opts)
	if o.limits != nil {
		l = *o.limits
	}
	return open(dir, l, o)
}

// OpenOwned is Open followed by EnsureOwner: for a session's workspace,
// which an earlier sandbox uid may have left (see EnsureOwner).
func OpenOwned(dir string, l Limits, opts ...Option) (*Workspace, error) {
	w, err := Open(dir, l, opts...)
	if err != nil {
		return nil, err
	}
	if err := w.EnsureOwner(); err != nil {
		_ = w.Close()
		return nil, err
	}
	return w, nil
}

func buildOptions(opts []Option) options {
	o := options{uid: DefaultUID, gid: DefaultGID}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return o
}

func open(dir string, l Limits, o options) (*Workspace, error) {
	fi, err := os.Lstat(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, brokererr.Wrap(err, brokererr.SandboxNotFound, "workspace not found")
		}
		return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot open workspace")
	}
	if !fi.IsDir() { // includes symlinks: Lstat does not follow
		return nil, brokererr.New(brokererr.InternalError, "workspace is not a directory")
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot open workspace")
	}
	// dir may have been swapped between Lstat and OpenRoot.
	rfi, err := root.Stat(".")
	if err != nil || !os.SameFile(fi, rfi) {
		_ = root.Close()
		return nil, brokererr.Wrap(err, brokererr.InternalError, "workspace changed while opening")
	}
	if st, ok := rfi.Sys().(*syscall.Stat_t); ok && o.dirOwner {
		o.uid, o.gid = int(st.Uid), int(st.Gid)
	}
	return &Workspace{
		root:      root,
		lim:       l.WithDefaults(),
		uid:       o.uid,
		gid:       o.gid,
		chown:     o.uid >= 0 && o.gid >= 0 && os.Geteuid() == 0,
		forbidden: o.forbidden,
	}, nil
}

// Close releases the directory handle.
func (w *Workspace) Close() error { return w.root.Close() }

// Limits returns the workspace's effective limits.
func (w *Workspace) Limits() Limits { return w.lim }

func (w *Workspace) validate(p string) (string, error) {
	return ValidatePath(p, w.forbidden...)
}

// Write stores data at p atomically (temporary file in the same directory,
// then link or rename). Missing parent directories are created inside the
// root. It refuses to write through or onto a symlink (PathTraversal) or
// onto anything but a regular file (InvalidInput); with overwrite false an
// existing entry of any type gives FileExists. Limits are checked before
// anything is written: FileSizeExceeded for MaxFileBytes, QuotaExceeded for
// MaxFiles (new parents and the new file count) and MaxBytes (the size being
// replaced is subtracted).
func (w *Workspace) Write(p string, data []byte, overwrite bool) error {
	if _, err := w.validate(p); err != nil { // a bad path is reported first
		return err
	}
	if int64(len(data)) > w.lim.MaxFileBytes {
		return brokererr.New(brokererr.FileSizeExceeded, "file is larger than %d bytes", w.lim.MaxFileBytes)
	}
	_, err := w.write(context.Background(), p, bytes.NewReader(data), int64(len(data)), w.lim.MaxFileBytes, overwrite)
	return err
}

// WriteResult is what WriteFrom stored.
type WriteResult struct {
	Size     int64
	Replaced bool // an existing file was replaced
}

// quotaRecheckBytes is how often, in bytes received, WriteFrom measures
// the workspace again while data arrives.
const quotaRecheckBytes = 8 << 20

// WriteFrom is Write for data of unknown length, streamed from r: at most
// max bytes (max <= 0 or above MaxFileBytes means MaxFileBytes;
// FileSizeExceeded past it) go to a temporary file next to p, which is
// renamed into place only once r ends, so the file appears whole or not at
// all. The quota is checked before the first byte, enforced on every byte
// against the usage measured then, measured again every
// quotaRecheckBytes (the sandbox and other writers share the workspace)
// and once more just before the rename: QuotaExceeded. When anything fails
// (a read error, ctx ending, a limit) the temporary file and the parent
// directories this call created are removed. Read errors are returned
// wrapped, so errors.Is finds their cause (os.ErrDeadlineExceeded, ...).
func (w *Workspace) WriteFrom(ctx context.Context, p string, r io.Reader, max int64, overwrite bool) (WriteResult, error) {
	if max <= 0 || max > w.lim.MaxFileBytes {
		max = w.lim.MaxFileBytes
	}
	return w.write(ctx, p, r, -1, max, overwrite)
}

// write is Write and WriteFrom: limit is the largest file accepted, and
// size the length of r's data when known in advance (checked against the
// quota before anything is created), else -1.
func (w *Workspace) write(ctx context.Context, p string, r io.Reader, size, limit int64, overwrite bool) (res WriteResult, err error) {
	rel, err := w.validate(p)
	if err != nil {
		return res, err
	}
	w.mu.Lock()
	defer w.mu.Unlock()

	dir, base := path.Split(rel)
	dir = strings.TrimSuffix(dir, "/")

	// What exists now: parents, and the target.
	var parents []string
	if dir != "" {
		segs := strings.Split(dir, "/")
		for i := range segs {
			parents = append(parents, strings.Join(segs[:i+1], "/"))
		}
	}
	missing := 0
	for _, d := range parents {
		if missing > 0 {
			missing++
			continue
		}
		fi, err := w.root.Stat(d) // follows in-root links; escapes are refused
		switch {
		case errors.Is(err, fs.ErrNotExist):
			missing++
		case err != nil:
			return res, mapErr(err)
		case !fi.IsDir():
			return res, brokererr.New(brokererr.InvalidInput, "a parent of the path is not a directory")
		}
	}
	var oldSize int64
	exists := false
	if missing == 0 {
		fi, err := w.root.Lstat(rel)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return res, mapErr(err)
		default:
			exists = true
			if !overwrite {
				return res, brokererr.New(brokererr.FileExists, "file already exists")
			}
			if err := checkTarget(fi); err != nil {
				return res, err
			}
			oldSize = fi.Size()
		}
	}

	// Quota, before anything is created.
	files, used, err := w.Usage()
	if err != nil {
		return res, err
	}
	newEntries := missing
	if !exists {
		newEntries++
	}
	if files+newEntries > w.lim.MaxFiles {
		return res, brokererr.New(brokererr.QuotaExceeded, "workspace file limit (%d) reached", w.lim.MaxFiles)
	}
	if used-oldSize+max(size, 0) > w.lim.MaxBytes {
		return res, errBytesQuota(w.lim.MaxBytes)
	}

	// Parents, created inside the root and given to the sandbox user; on
	// failure, removed again (innermost first; one the sandbox has filled
	// meanwhile stays).
	var created []string
	defer func() {
		if err != nil {
			for i := len(created) - 1; i >= 0; i-- {
				_ = w.root.Remove(created[i])
			}
		}
	}()
	for _, d := range parents {
		err := w.root.Mkdir(d, DirMode)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return res, mapErr(err)
		}
		created = append(created, d)
		if err := w.fixOwner(d, true); err != nil {
			return res, err
		}
	}

	// Pin the parent directory, then work by base name inside it.
	pr := w.root
	if dir != "" {
		pr, err = w.root.OpenRoot(dir)
		if err != nil {
			return res, mapErr(err)
		}
		defer pr.Close()
	}
	allowance := w.lim.MaxBytes - (used - oldSize)
	tmp, n, err := w.writeTemp(ctx, pr, r, limit, allowance, func() error { return w.fitsReplacing(pr, base) })
	if err != nil {
		return res, err
	}
	defer func() { _ = pr.Remove(tmp) }() // no-op after a successful rename
	// Others may have written meanwhile: the workspace, as it is now, must
	// fit once the temporary file takes the target's place.
	if err := w.fitsReplacing(pr, base); err != nil {
		return res, err
	}
	res = WriteResult{Size: n}

	if !overwrite {
		// link(2) never replaces: an entry created since the check above wins.
		err := pr.Link(tmp, base)
		if err == nil {
			return res, nil
		}
		if errors.Is(err, fs.ErrExist) {
			return res, brokererr.New(brokererr.FileExists, "file already exists")
		}
		// Filesystem without hard links: fall back to a checked rename.
		if _, lerr := pr.Lstat(base); lerr == nil {
			return res, brokererr.New(brokererr.FileExists, "file already exists")
		} else if !errors.Is(lerr, fs.ErrNotExist) {
			return res, mapErr(lerr)
		}
	} else if fi, err := pr.Lstat(base); err == nil {
		if err := checkTarget(fi); err != nil {
			return res, err
		}
		res.Replaced = true
	} else if !errors.Is(err, fs.ErrNotExist) {
		return res, mapErr(err)
	}
	// rename(2) replaces the entry itself and never follows a symlink there.
	if err := pr.Rename(tmp, base); err != nil {
		return res, mapErr(err)
	}
	return res, nil
}

func errBytesQuota(max int64) error {
	return brokererr.New(brokererr.QuotaExceeded, "workspace size limit (%d bytes) reached", max)
}

// fitsReplacing measures the workspace, which holds a temporary file about
// to take base's place in pr, and reports QuotaExceeded unless it fits its
// limits once base (if any) is gone.
func (w *Workspace) fitsReplacing(pr *os.Root, base string) error {
	files, used, err := w.Usage()
	if err != nil {
		return err
	}
	if fi, err := pr.Lstat(base); err == nil {
		files--
		if fi.Mode().IsRegular() {
			used -= fi.Size()
		}
	}
	if files > w.lim.MaxFiles {
		return brokererr.New(brokererr.QuotaExceeded, "workspace file limit (%d) reached", w.lim.MaxFiles)
	}
	if used > w.lim.MaxBytes {
		return errBytesQuota(w.lim.MaxBytes)
	}
	return nil
}

// checkTarget refuses to replace anything but a regular file.
func checkTarget(fi fs.FileInfo) error {
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		return brokererr.New(brokererr.PathTraversal, "refusing to write through a symlink")
	case !fi.Mode().IsRegular():
		return brokererr.New(brokererr.InvalidInput, "path exists and is not a regular file")
	}
	return nil
}

// copyBufBytes is writeTemp's read size.
const copyBufBytes = 256 << 10

// writeTemp streams r into a new uniquely named file in pr, owned by the
// workspace's owner and synced, and returns its name and size. Past limit
// bytes it fails with FileSizeExceeded and past allowance with
// QuotaExceeded, before writing the byte that crosses; every
// quotaRecheckBytes it calls recheck. On any error the file is removed.
func (w *Workspace) writeTemp(ctx context.Context, pr *os.Root, r io.Reader, limit, allowance int64, recheck func() error) (name string, n int64, err error) {
	var rnd [12]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return "", 0, brokererr.Wrap(err, brokererr.InternalError, "cannot write file")
	}
	tmp := tmpPrefix + hex.EncodeToString(rnd[:])
	f, err := pr.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, FileMode)
	if err != nil {
		return "", 0, mapErr(err)
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = brokererr.Wrap(cerr, brokererr.InternalError, "cannot write file")
		}
		if err != nil {
			_ = pr.Remove(tmp)
			name = ""
		}
	}()
	if err := f.Chmod(FileMode); err != nil { // independent of the umask
		return "", 0, brokererr.Wrap(err, brokererr.InternalError, "cannot write file")
	}
	if w.chown {
		if err := f.Chown(w.uid, w.gid); err != nil {
			return "", 0, brokererr.Wrap(err, brokererr.InternalError, "cannot write file")
		}
	}
	buf := make([]byte, min(copyBufBytes, limit+1))
	next := int64(quotaRecheckBytes)
	for {
		if err := ctx.Err(); err != nil {
			return "", n, brokererr.Wrap(err, brokererr.Unavailable, "the write was cancelled")
		}
		k, rerr := r.Read(buf)
		if k > 0 {
			if n+int64(k) > limit {
				return "", n, brokererr.New(brokererr.FileSizeExceeded, "file is larger than %d bytes", limit)
			}
			if n+int64(k) > allowance {
				return "", n, errBytesQuota(w.lim.MaxBytes)
			}
			if _, err := f.Write(buf[:k]); err != nil {
				return "", n, mapErr(err)
			}
			n += int64(k)
			if n >= next {
				next = n + quotaRecheckBytes
				if err := recheck(); err != nil {
					return "", n, err
				}
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return "", n, brokererr.Wrap(rerr, brokererr.InvalidInput, "the data ended early")
		}
	}
	if err := f.Sync(); err != nil {
		return "", n, mapErr(err)
	}
	return tmp, n, nil
}

// fixOwner sets mode and owner of an entry Write just created, by fd.
func (w *Workspace) fixOwner(rel string, dir bool) error {
	flag := os.O_RDONLY | syscall.O_NOFOLLOW | syscall.O_NONBLOCK
	if dir {
		flag |= syscall.O_DIRECTORY
	}
	f, err := w.root.OpenFile(rel, flag, 0)
	if err != nil {
		return mapErr(err)
	}
	defer f.Close()
	if err := f.Chmod(DirMode); err != nil {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot set directory mode")
	}
	if w.chown {
		if err := f.Chown(w.uid, w.gid); err != nil {
			return brokererr.Wrap(err, brokererr.InternalError, "cannot set directory owner")
		}
	}
	return nil
}

// EnsureOwner gives every entry to the workspace's owner (WithOwner) when
// the directory itself belongs to another uid or gid: a workspace made under
// another sandbox uid (before per-session uids, or under an older range)
// becomes the session's again. The directory goes last, so an interrupted
// pass is redone on the next call. Symlinks are changed, never followed;
// entries beyond the walk bounds keep their owner. Call it while no sandbox
// runs on the workspace. A no-op unless the broker is root.
func (w *Workspace) EnsureOwner() error {
	if !w.chown {
		return nil
	}
	fi, err := w.root.Lstat(".")
	if err != nil {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot read workspace owner")
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || (int(st.Uid) == w.uid && int(st.Gid) == w.gid) {
		return nil
	}
	_, err = w.walk("", WalkMaxDepth, func(rel string, _ fs.FileMode) error {
		if err := w.root.Lchown(rel, w.uid, w.gid); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	})
	if err == nil {
		err = w.root.Lchown(".", w.uid, w.gid)
	}
	if err != nil {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot give the workspace to its sandbox user")
	}
	return nil
}

// Read returns up to max bytes of the regular file p starting at offset.
// max <= 0 or above MaxFileBytes means MaxFileBytes. Anything that is not a
// regular file (missing, directory, symlink, FIFO, socket, device) is
// FileNotFound, without saying which.
func (w *Workspace) Read(p string, offset, max int64) (sandbox.File, error) {
	if offset < 0 {
		return sandbox.File{}, brokererr.New(brokererr.InvalidInput, "offset must not be negative")
	}
	if max <= 0 || max > w.lim.MaxFileBytes {
		max = w.lim.MaxFileBytes
	}
	f, fi, err := w.OpenFile(p)
	if err != nil {
		return sandbox.File{}, err
	}
	defer f.Close()
	size := fi.Size()
	if offset > size {
		return sandbox.File{}, brokererr.New(brokererr.InvalidInput, "offset %d is beyond the end of the file (%d bytes)", offset, size)
	}
	n := min(size-offset, max)
	buf := make([]byte, n)
	got, err := f.ReadAt(buf, offset)
	if err != nil && !errors.Is(err, io.EOF) { // the file may shrink meanwhile
		return sandbox.File{}, brokererr.Wrap(err, brokererr.InternalError, "cannot read file")
	}
	return sandbox.File{
		// OpenFile validated p, and ValidatePath returns it unchanged.
		FileInfo: sandbox.FileInfo{Path: p, Size: size, ModTime: fi.ModTime()},
		Data:     buf[:got],
	}, nil
}

// ReadFile is a session's ReadFile: Read on the workspace at dir, where a
// workspace not created yet holds no files.
func ReadFile(dir string, l Limits, p string, offset, max int64) (sandbox.File, error) {
	w, err := Open(dir, l)
	if brokererr.CodeOf(err) == brokererr.SandboxNotFound {
		return sandbox.File{}, brokererr.New(brokererr.FileNotFound, "file not found")
	}
	if err != nil {
		return sandbox.File{}, err
	}
	defer w.Close()
	return w.Read(p, offset, max)
}

// OpenFile opens the regular file p for reading, with the checks of Read,
// and returns it with its fstat information. The caller closes the file.
func (w *Workspace) OpenFile(p string) (*os.File, os.FileInfo, error) {
	rel, err := w.validate(p)
	if err != nil {
		return nil, nil, err
	}
	f, fi, err := w.openNoFollow(rel, os.O_RDONLY)
	if err != nil {
		return nil, nil, notFound(err)
	}
	if !fi.Mode().IsRegular() {
		_ = f.Close()
		return nil, nil, brokererr.New(brokererr.FileNotFound, "file not found or not a regular file")
	}
	return f, fi, nil
}

// openNoFollow opens rel through the root with O_NONBLOCK (a FIFO must not
// wait for a writer) and O_NOFOLLOW, and returns it with its fstat info.
// os.Root refuses symlinks that leave the root, but it resolves in-root
// symlinks itself, even the final component and even with O_NOFOLLOW; so
// the opened file must also be the very entry Lstat sees at rel, which is
// not a symlink. Intermediate in-root directory symlinks are followed.
func (w *Workspace) openNoFollow(rel string, flag int) (*os.File, fs.FileInfo, error) {
	f, err := w.root.OpenFile(rel, flag|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, nil, err
	}
	li, err := w.root.Lstat(rel)
	if err != nil || li.Mode()&fs.ModeSymlink != 0 || !os.SameFile(fi, li) {
		_ = f.Close()
		return nil, nil, &fs.PathError{Op: "open", Path: rel, Err: syscall.ELOOP}
	}
	return f, fi, nil
}

// notFound maps an open error on the read side. Whatever the cause
// (missing, symlink at the end, symlink escaping the root on the way, ...)
// the model sees the same FileNotFound; the cause stays server-side.
func notFound(err error) error {
	return brokererr.Wrap(err, brokererr.FileNotFound, "file not found or not a regular file")
}

// mapErr maps filesystem errors on the write side.
func mapErr(err error) error {
	switch {
	case err == nil:
		return nil
	case brokererr.As(err) != nil:
		return err
	case isEscape(err), errors.Is(err, syscall.ELOOP):
		return brokererr.Wrap(err, brokererr.PathTraversal, "path escapes the workspace or crosses a symlink")
	case errors.Is(err, fs.ErrNotExist):
		return brokererr.Wrap(err, brokererr.FileNotFound, "file not found")
	case errors.Is(err, fs.ErrExist):
		return brokererr.Wrap(err, brokererr.FileExists, "file already exists")
	case errors.Is(err, syscall.ENOTDIR):
		return brokererr.Wrap(err, brokererr.InvalidInput, "a parent of the path is not a directory")
	case errors.Is(err, syscall.EISDIR):
		return brokererr.Wrap(err, brokererr.InvalidInput, "path exists and is not a regular file")
	case errors.Is(err, syscall.ENAMETOOLONG):
		return brokererr.Wrap(err, brokererr.InvalidInput, "path is too long")
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return brokererr.Wrap(err, brokererr.QuotaExceeded, "workspace is full")
	}
	return brokererr.Wrap(err, brokererr.InternalError, "workspace I/O failed")
}

// isEscape recognises os.Root's unexported "path escapes from parent".
func isEscape(err error) bool {
	var pe *fs.PathError
	if errors.As(err, &pe) && pe.Err != nil {
		return pe.Err.Error() == "path escapes from parent"
	}
	var le *os.LinkError
	if errors.As(err, &le) && le.Err != nil {
		return le.Err.Error() == "path escapes from parent"
	}
	return false
}

// Remove deletes one regular file or symlink through the root (never
// following a link); a missing file is not an error.
func (w *Workspace) Remove(path string) error {
	rel, err := ValidatePath(path, w.forbidden...)
	if err != nil {
		return err
	}
	if err := w.root.Remove(rel); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return brokererr.Wrap(err, brokererr.InternalError, "cannot remove file")
	}
	return nil
}

// OverQuota reports whether the workspace holds more than its limits allow.
func (w *Workspace) OverQuota() (bool, error) {
	files, bytes, err := w.Usage()
	if err != nil {
		return brokererr.CodeOf(err) == brokererr.QuotaExceeded, err
	}
	return files > w.lim.MaxFiles || bytes > w.lim.MaxBytes, nil
}

// QuotaPoll is how often WatchQuota measures the workspace. The quota can
// be overshot by what the code writes within one interval, bounded per
// file by the sandbox's file size limit.
const QuotaPoll = 500 * time.Millisecond

// WatchQuota measures the workspace every QuotaPoll while a sandbox runs
// code (its bind mount has no quota of its own). Past the quota it calls
// kill once, with ctx's values but never cancelled, and stops watching;
// it also stops when ctx is done. stop ends the watch and reports whether
// kill was called (after kill has returned).
func (w *Workspace) WatchQuota(ctx context.Context, kill func(context.Context)) (stop func() bool) {
	done := make(chan struct{})
	fired := make(chan bool, 1)
	go func() {
		t := time.NewTicker(QuotaPoll)
		defer t.Stop()
		for {
			select {
			case <-done:
				fired <- false
				return
			case <-ctx.Done():
				fired <- false
				return
			case <-t.C:
				if over, _ := w.OverQuota(); over {
					kill(context.WithoutCancel(ctx))
					fired <- true
					return
				}
			}
		}
	}()
	return func() bool {
		close(done)
		return <-fired
	}
}
