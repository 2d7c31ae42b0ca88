// Package runnerfs keeps the runner images' file systems as plain
// directories, so that the process (bubblewrap) backend runs code on the
// same Python, TypeScript and Bash as the Docker backend without a Docker
// daemon.
//
// A runners directory holds, per language, a symlink to the generation in
// use and the generation itself:
//
//	python -> python.4ae0acc56c3f
//	python.4ae0acc56c3f/manifest.json
//	python.4ae0acc56c3f/rootfs/{usr,etc,opt,…}
//
// `make runners` writes a new generation beside the old one and swaps the
// symlink, so a broker that is running keeps the tree it verified. Seal
// normalises a freshly exported tree (root-owned, not writable by anyone
// else, no devices or setuid files, the sandbox's mount points present) and
// writes its manifest: the image it came from and a digest of every
// entry's metadata. Open verifies each generation against its manifest, so
// a tree that was changed, partly extracted or left without its manifest
// is refused rather than run.
package runnerfs

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// File names inside a generation.
const (
	ManifestName = "manifest.json"
	RootfsName   = "rootfs"
	// Format is the manifest format this package writes and reads.
	Format = 1
	// maxManifestBytes bounds what Open reads of a manifest.
	maxManifestBytes = 64 << 10
	maxEnv           = 64
	maxEnvBytes      = 4096
)

// Manifest describes one generation.
type Manifest struct {
	Format   int    `json:"format"`
	Language string `json:"language"`
	// Image is the runner image's name (sandbox-broker/runner-python:latest)
	// and ImageID the ID of the image that was exported ("" when the tree
	// was built without Docker).
	Image   string `json:"image"`
	ImageID string `json:"image_id,omitempty"`
	// BuiltBy says how: "docker-export" or "debootstrap".
	BuiltBy string    `json:"built_by"`
	Created time.Time `json:"created"`
	// Env is the image's environment (KEY=value), which the sandbox's
	// agent starts with, as in a container of the image.
	Env []string `json:"env"`
	// Entries and Bytes count the tree; Tree is the sha256 of every
	// entry's path, type, mode, owner, size, mtime and link target.
	Entries int    `json:"entries"`
	Bytes   int64  `json:"bytes"`
	Tree    string `json:"tree"`
}

// Layout is what the sandbox mounts over the tree: the directories,
// files and symlinks that must exist (bubblewrap cannot create a mount
// point in a read-only tree).
type Layout struct {
	Dirs     []string          // absolute in-sandbox paths
	Files    []string          // created empty
	Symlinks map[string]string // path → target
}

// Runner is a verified generation.
type Runner struct {
	Manifest
	// Name is the generation's directory name; Rootfs the host path of its
	// tree.
	Name   string
	Rootfs string
}

// Short is the manifest's image ID cut to 12 hex digits, or how the tree
// was built when no image was exported.
func (m Manifest) Short() string {
	if id := strings.TrimPrefix(m.ImageID, "sha256:"); len(id) >= 12 {
		return "sha256:" + id[:12]
	}
	return m.BuiltBy
}

// ValidLanguage reports whether s can name a runner (and its symlink).
func ValidLanguage(s string) bool {
	if s == "" || len(s) > 32 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// validEnv checks one KEY=value entry.
func validEnv(e string) error {
	k, v, ok := strings.Cut(e, "=")
	if !ok || k == "" || len(e) > maxEnvBytes || strings.ContainsRune(v, 0) {
		return fmt.Errorf("env entry %.40q is not KEY=value", e)
	}
	for i, c := range k {
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return fmt.Errorf("env name %.40q is invalid", k)
		}
	}
	return nil
}

// ParseManifest parses and checks a manifest strictly.
func ParseManifest(b []byte) (Manifest, error) {
	var m Manifest
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return Manifest{}, fmt.Errorf("manifest: %w", err)
	}
	if dec.More() {
		return Manifest{}, errors.New("manifest: trailing data")
	}
	return m, m.check()
}

func (m Manifest) check() error {
	switch {
	case m.Format != Format:
		return fmt.Errorf("manifest: format %d, want %d (rebuild with make runners)", m.Format, Format)
	case !ValidLanguage(m.Language):
		return errors.New("manifest: invalid language")
	case m.Image == "" || len(m.Image) > 256 || strings.ContainsAny(m.Image, "\x00\n"):
		return errors.New("manifest: invalid image name")
	case m.ImageID != "" && !validImageID(m.ImageID):
		return errors.New("manifest: invalid image ID")
	case m.BuiltBy != "docker-export" && m.BuiltBy != "debootstrap":
		return errors.New("manifest: built_by must be docker-export or debootstrap")
	case len(m.Env) > maxEnv:
		return errors.New("manifest: too many env entries")
	case !strings.HasPrefix(m.Tree, "sha256:") || len(m.Tree) != len("sha256:")+64:
		return errors.New("manifest: invalid tree digest")
	}
	for _, e := range m.Env {
		if err := validEnv(e); err != nil {
			return fmt.Errorf("manifest: %w", err)
		}
	}
	return nil
}

func validImageID(s string) bool {
	h, ok := strings.CutPrefix(s, "sha256:")
	if !ok || len(h) != 64 {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil
}

// Open verifies every runner in dir (a language symlink to a generation)
// and returns them sorted by language. A dir that does not exist holds no
// runners. Any runner that fails verification fails Open: a changed tree
// is never run. Errors name no host path (they reach logs).
func Open(dir string, layout Layout) ([]Runner, error) {
	fi, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("runners dir: %w", noPath(err))
	}
	if err := safeDir(fi, "runners dir"); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("runners dir: %w", noPath(err))
	}
	var out []Runner
	var errs []error
	for _, e := range ents {
		lang := e.Name()
		if e.Type()&fs.ModeSymlink == 0 || !ValidLanguage(lang) {
			continue // generations, builds in progress (dot names)
		}
		r, err := openRunner(dir, lang, layout)
		if err != nil {
			errs = append(errs, fmt.Errorf("runner %s: %w", lang, err))
			continue
		}
		out = append(out, r)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b Runner) int { return strings.Compare(a.Language, b.Language) })
	return out, nil
}

func openRunner(dir, lang string, layout Layout) (Runner, error) {
	gen, err := os.Readlink(filepath.Join(dir, lang))
	if err != nil {
		return Runner{}, err
	}
	if gen == "" || gen == "." || gen == ".." || strings.ContainsRune(gen, '/') {
		return Runner{}, errors.New("the symlink must name a generation in the same directory")
	}
	m, err := Verify(filepath.Join(dir, gen), layout)
	if err != nil {
		return Runner{}, err
	}
	if m.Language != lang {
		return Runner{}, fmt.Errorf("the generation is for %q", m.Language)
	}
	return Runner{Manifest: m, Name: gen, Rootfs: filepath.Join(dir, gen, RootfsName)}, nil
}

// Verify checks one generation: the directory, its manifest and every
// entry of its tree against the manifest and Seal's rules.
func Verify(genDir string, layout Layout) (Manifest, error) {
	fi, err := os.Lstat(genDir)
	if err != nil {
		return Manifest{}, fmt.Errorf("generation: %w", noPath(err))
	}
	if err := safeDir(fi, "generation"); err != nil {
		return Manifest{}, err
	}
	m, err := readManifest(filepath.Join(genDir, ManifestName))
	if err != nil {
		return Manifest{}, err
	}
	r, err := os.OpenRoot(filepath.Join(genDir, RootfsName))
	if err != nil {
		return Manifest{}, fmt.Errorf("rootfs: %w", noPath(err))
	}
	defer r.Close()
	sum, err := digest(r, layout)
	if err != nil {
		return Manifest{}, err
	}
	if sum.tree != m.Tree || sum.entries != m.Entries || sum.bytes != m.Bytes {
		return Manifest{}, fmt.Errorf("the tree does not match its manifest (%d entries, %d bytes; manifest %d, %d): it changed since it was built; rebuild it with make runners",
			sum.entries, sum.bytes, m.Entries, m.Bytes)
	}
	return m, nil
}

func readManifest(p string) (Manifest, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return Manifest{}, fmt.Errorf("manifest: %w", noPath(err))
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return Manifest{}, err
	}
	if !fi.Mode().IsRegular() {
		return Manifest{}, errors.New("manifest: not a regular file")
	}
	if err := safeOwner(fi, "manifest"); err != nil {
		return Manifest{}, err
	}
	b, err := io.ReadAll(io.LimitReader(f, maxManifestBytes+1))
	if err != nil {
		return Manifest{}, err
	}
	if len(b) > maxManifestBytes {
		return Manifest{}, errors.New("manifest: too large")
	}
	return ParseManifest(b)
}

// safeDir: a real directory owned by root, writable by root only, and
// searchable by everyone (sandboxes run as other uids).
func safeDir(fi fs.FileInfo, what string) error {
	if !fi.IsDir() {
		return fmt.Errorf("%s: not a directory", what)
	}
	if fi.Mode().Perm()&0o001 == 0 {
		return fmt.Errorf("%s: not searchable by sandbox uids (needs o+x)", what)
	}
	return safeOwner(fi, what)
}

func safeOwner(fi fs.FileInfo, what string) error {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || st.Uid != 0 || st.Gid != 0 {
		return fmt.Errorf("%s: not owned by root:root", what)
	}
	if fi.Mode()&fs.ModeSymlink == 0 && fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%s: writable by group or others", what)
	}
	return nil
}

type treeSum struct {
	entries int
	bytes   int64
	tree    string
}

// digest walks the tree, checks Seal's rules on every entry and the
// layout's mount points, and hashes each entry's metadata. Contents are
// not read (a full read of a 700 MB tree would slow every start by
// seconds): a change shows in size or mtime, and only root, who could
// rewrite the manifest too, can change a file and reset its mtime.
func digest(r *os.Root, layout Layout) (treeSum, error) {
	h := sha256.New()
	var s treeSum
	err := fs.WalkDir(r.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("rootfs: %s: %w", p, noPath(err))
		}
		fi, err := d.Info()
		if err != nil {
			return fmt.Errorf("rootfs: %s: %w", p, noPath(err))
		}
		mode := fi.Mode()
		if mode&(fs.ModeDevice|fs.ModeCharDevice|fs.ModeNamedPipe|fs.ModeSocket|fs.ModeIrregular) != 0 {
			return fmt.Errorf("rootfs: %s: a device, FIFO or socket", p)
		}
		if mode&(fs.ModeSetuid|fs.ModeSetgid) != 0 {
			return fmt.Errorf("rootfs: %s: setuid or setgid", p)
		}
		if err := safeOwner(fi, "rootfs: "+p); err != nil {
			return err
		}
		if p == "." && mode.Perm()&0o001 == 0 {
			return errors.New("rootfs: not searchable by sandbox uids (needs o+x)")
		}
		var size, mtime int64
		var link string
		switch {
		case mode.IsRegular():
			size, mtime = fi.Size(), fi.ModTime().Unix()
			s.bytes += size
		case mode&fs.ModeSymlink != 0:
			if link, err = r.Readlink(p); err != nil {
				return fmt.Errorf("rootfs: %s: %w", p, noPath(err))
			}
		}
		s.entries++
		fmt.Fprintf(h, "%s\x00%o\x00%d\x00%d\x00%s\x00", p, uint32(mode), size, mtime, link)
		return nil
	})
	if err != nil {
		return treeSum{}, err
	}
	if err := checkLayout(r, layout); err != nil {
		return treeSum{}, err
	}
	s.tree = "sha256:" + hex.EncodeToString(h.Sum(nil))
	return s, nil
}

func checkLayout(r *os.Root, l Layout) error {
	for _, d := range l.Dirs {
		if fi, err := r.Lstat(rel(d)); err != nil || !fi.IsDir() {
			return fmt.Errorf("rootfs: mount point %s is not a directory", d)
		}
	}
	for _, f := range l.Files {
		if fi, err := r.Lstat(rel(f)); err != nil || !fi.Mode().IsRegular() {
			return fmt.Errorf("rootfs: mount point %s is not a file", f)
		}
	}
	for p, target := range l.Symlinks {
		if got, err := r.Readlink(rel(p)); err != nil || got != target {
			return fmt.Errorf("rootfs: %s is not a symlink to %s", p, target)
		}
	}
	return nil
}

// noPath is err without the host path a *PathError carries.
func noPath(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		return le.Err
	}
	return err
}
