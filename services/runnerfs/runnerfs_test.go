package runnerfs

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

var testLayout = Layout{
	Dirs:     []string{"/proc", "/mnt/data", "/run/sandbox"},
	Files:    []string{"/opt/sandbox/broker", "/etc/passwd"},
	Symlinks: map[string]string{"/data": "/mnt/data"},
}

// requireRoot: Seal chowns to root, and only root can make the trees the
// verifier accepts.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI=true but the tests do not run as root")
		}
		t.Skip("needs root")
	}
}

// newTree makes dir/rootfs the way an export leaves it: files of another
// uid, group-writable and setuid entries, a device node, /.dockerenv.
func newTree(t *testing.T) (runners, gen string) {
	t.Helper()
	runners = t.TempDir()
	if err := os.Chmod(runners, 0o755); err != nil {
		t.Fatal(err)
	}
	gen = filepath.Join(runners, "python.0123456789ab")
	root := filepath.Join(gen, RootfsName)
	for _, d := range []string{"usr/bin", "etc", "home/sandbox", "tmp", "var/mail"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p string, mode os.FileMode, data string) {
		if err := os.WriteFile(filepath.Join(root, p), []byte(data), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(filepath.Join(root, p), mode); err != nil {
			t.Fatal(err)
		}
	}
	write("usr/bin/python3", 0o755, "#!python")
	write("usr/bin/passwd", os.ModeSetuid|0o755, "setuid")
	write("etc/passwd", 0o644, "root:x:0:0::/root:/bin/sh\n")
	write("home/sandbox/.bashrc", 0o644, "# rc")
	write(".dockerenv", 0o755, "")
	if err := os.Chown(filepath.Join(root, "home/sandbox"), 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(root, "tmp"), os.ModeSticky|0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(root, "var/mail"), os.ModeSetgid|0o775); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("usr/bin", filepath.Join(root, "bin")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mknod(filepath.Join(root, "null"), syscall.S_IFCHR|0o666, int(1<<8|3)); err != nil {
		t.Fatal(err)
	}
	return runners, gen
}

func seal(t *testing.T, gen string) Manifest {
	t.Helper()
	m, err := Seal(gen, Manifest{Language: "python", Image: "sandbox-broker/runner-python:latest",
		ImageID: "sha256:" + strings.Repeat("ab", 32), BuiltBy: "docker-export", Env: []string{"LANG=C.UTF-8", "MPLBACKEND=Agg"}}, testLayout)
	if err != nil {
		t.Fatalf("Seal: %v", err)
	}
	return m
}

func link(t *testing.T, runners, lang, gen string) {
	t.Helper()
	if err := os.Symlink(filepath.Base(gen), filepath.Join(runners, lang)); err != nil {
		t.Fatal(err)
	}
}

func TestSealNormalisesAndOpenVerifies(t *testing.T) {
	requireRoot(t)
	runners, gen := newTree(t)
	m := seal(t, gen)
	root := filepath.Join(gen, RootfsName)
	for p, want := range map[string]os.FileMode{
		"usr/bin/passwd": 0o755,
		"tmp":            os.ModeDir | os.ModeSticky | 0o755,
		"var/mail":       os.ModeDir | 0o755,
		"home/sandbox":   os.ModeDir | 0o755,
		"opt/sandbox":    os.ModeDir | 0o755,
		"run/sandbox":    os.ModeDir | 0o755,
	} {
		fi, err := os.Lstat(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode() != want || st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s: %v %d:%d, want %v root:root", p, fi.Mode(), st.Uid, st.Gid, want)
		}
	}
	for _, gone := range []string{".dockerenv", "null"} {
		if _, err := os.Lstat(filepath.Join(root, gone)); !os.IsNotExist(err) {
			t.Errorf("%s is still there: %v", gone, err)
		}
	}
	if fi, err := os.Lstat(filepath.Join(root, "opt/sandbox/broker")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("mount point file: %v %v", fi, err)
	}
	if got, _ := os.Readlink(filepath.Join(root, "data")); got != "/mnt/data" {
		t.Errorf("/data -> %q", got)
	}
	if m.Entries == 0 || m.Bytes == 0 || m.Created.IsZero() || m.Format != Format {
		t.Errorf("manifest: %+v", m)
	}
	// Not linked yet: a build in progress is not a runner.
	if list, err := Open(runners, testLayout); err != nil || len(list) != 0 {
		t.Fatalf("Open before the symlink: %v %v", list, err)
	}
	link(t, runners, "python", gen)
	list, err := Open(runners, testLayout)
	if err != nil || len(list) != 1 {
		t.Fatalf("Open: %v %v", list, err)
	}
	r := list[0]
	if r.Language != "python" || r.Rootfs != root || r.Tree != m.Tree || r.Short() != "sha256:abababababab" || strings.Join(r.Env, " ") != "LANG=C.UTF-8 MPLBACKEND=Agg" {
		t.Errorf("runner: %+v", r)
	}
	if list, err := Open(filepath.Join(runners, "missing"), testLayout); err != nil || list != nil {
		t.Errorf("a missing dir holds no runners: %v %v", list, err)
	}
}

// TestOpenRefusesChangedTrees: every way a tree can drift from its
// manifest, or from the rules, fails Open, and the error names no host
// path.
func TestOpenRefusesChangedTrees(t *testing.T) {
	requireRoot(t)
	cases := map[string]struct {
		change func(t *testing.T, runners, gen string)
		want   string
	}{
		"file grew": {func(t *testing.T, _, gen string) {
			appendTo(t, filepath.Join(gen, "rootfs/usr/bin/python3"), "x")
		}, "does not match its manifest"},
		"same size, new mtime": {func(t *testing.T, _, gen string) {
			p := filepath.Join(gen, "rootfs/usr/bin/python3")
			if err := os.WriteFile(p, []byte("#!pythoN"), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.Chtimes(p, time.Now(), time.Now().Add(time.Hour)); err != nil {
				t.Fatal(err)
			}
		}, "does not match its manifest"},
		"file added": {func(t *testing.T, _, gen string) {
			if err := os.WriteFile(filepath.Join(gen, "rootfs/usr/bin/extra"), nil, 0o755); err != nil {
				t.Fatal(err)
			}
		}, "does not match its manifest"},
		"file removed": {func(t *testing.T, _, gen string) {
			if err := os.Remove(filepath.Join(gen, "rootfs/usr/bin/python3")); err != nil {
				t.Fatal(err)
			}
		}, "does not match its manifest"},
		"mode changed": {func(t *testing.T, _, gen string) {
			if err := os.Chmod(filepath.Join(gen, "rootfs/usr/bin/python3"), 0o700); err != nil {
				t.Fatal(err)
			}
		}, "does not match its manifest"},
		"symlink retargeted": {func(t *testing.T, _, gen string) {
			p := filepath.Join(gen, "rootfs/bin")
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink("usr/sbin", p); err != nil {
				t.Fatal(err)
			}
		}, "does not match its manifest"},
		"group-writable file": {func(t *testing.T, _, gen string) {
			if err := os.Chmod(filepath.Join(gen, "rootfs/usr/bin/python3"), 0o775); err != nil {
				t.Fatal(err)
			}
		}, "writable by group or others"},
		"owned by a sandbox uid": {func(t *testing.T, _, gen string) {
			if err := os.Lchown(filepath.Join(gen, "rootfs/etc/passwd"), 1900000000, 1900000000); err != nil {
				t.Fatal(err)
			}
		}, "not owned by root"},
		"setuid file": {func(t *testing.T, _, gen string) {
			if err := os.Chmod(filepath.Join(gen, "rootfs/usr/bin/python3"), os.ModeSetuid|0o755); err != nil {
				t.Fatal(err)
			}
		}, "setuid"},
		"device node": {func(t *testing.T, _, gen string) {
			if err := syscall.Mknod(filepath.Join(gen, "rootfs/usr/bin/mem"), syscall.S_IFCHR|0o600, int(1<<8|1)); err != nil {
				t.Fatal(err)
			}
		}, "a device"},
		"mount point gone": {func(t *testing.T, _, gen string) {
			if err := os.Remove(filepath.Join(gen, "rootfs/opt/sandbox/broker")); err != nil {
				t.Fatal(err)
			}
		}, "mount point /opt/sandbox/broker"},
		"manifest missing": {func(t *testing.T, _, gen string) {
			if err := os.Remove(filepath.Join(gen, ManifestName)); err != nil {
				t.Fatal(err)
			}
		}, "manifest"},
		"manifest edited": {func(t *testing.T, _, gen string) {
			p := filepath.Join(gen, ManifestName)
			b, _ := os.ReadFile(p)
			if err := os.WriteFile(p, []byte(strings.Replace(string(b), `"language": "python"`, `"language": "bash"`, 1)), 0o644); err != nil {
				t.Fatal(err)
			}
		}, `generation is for "bash"`},
		"manifest writable by others": {func(t *testing.T, _, gen string) {
			if err := os.Chmod(filepath.Join(gen, ManifestName), 0o666); err != nil {
				t.Fatal(err)
			}
		}, "manifest: writable by group or others"},
		"manifest a symlink": {func(t *testing.T, _, gen string) {
			p := filepath.Join(gen, ManifestName)
			if err := os.Rename(p, p+".real"); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(ManifestName+".real", p); err != nil {
				t.Fatal(err)
			}
		}, "manifest"},
		"symlink leaves the dir": {func(t *testing.T, runners, gen string) {
			p := filepath.Join(runners, "python")
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(gen, p); err != nil { // absolute
				t.Fatal(err)
			}
		}, "same directory"},
		"runners dir writable by others": {func(t *testing.T, runners, _ string) {
			if err := os.Chmod(runners, 0o777); err != nil {
				t.Fatal(err)
			}
		}, "runners dir: writable by group or others"},
		"generation not searchable": {func(t *testing.T, _, gen string) {
			if err := os.Chmod(gen, 0o750); err != nil {
				t.Fatal(err)
			}
		}, "not searchable"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			runners, gen := newTree(t)
			seal(t, gen)
			link(t, runners, "python", gen)
			if _, err := Open(runners, testLayout); err != nil {
				t.Fatalf("before the change: %v", err)
			}
			c.change(t, runners, gen)
			list, err := Open(runners, testLayout)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Open after %s: %v %v, want an error with %q", name, list, err, c.want)
			}
			if strings.Contains(err.Error(), runners) {
				t.Errorf("the error names a host path: %v", err)
			}
		})
	}
}

func appendTo(t *testing.T, p, s string) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

func TestParseManifestStrict(t *testing.T) {
	ok := `{"format":1,"language":"python","image":"x","built_by":"debootstrap","created":"2026-01-01T00:00:00Z","env":["A=b"],"entries":1,"bytes":1,"tree":"sha256:` + strings.Repeat("0", 64) + `"}`
	if _, err := ParseManifest([]byte(ok)); err != nil {
		t.Fatalf("valid manifest: %v", err)
	}
	for name, bad := range map[string]string{
		"unknown field": strings.Replace(ok, `"entries"`, `"extra":1,"entries"`, 1),
		"format":        strings.Replace(ok, `"format":1`, `"format":2`, 1),
		"language":      strings.Replace(ok, `"python"`, `"Py/thon"`, 1),
		"built_by":      strings.Replace(ok, `"debootstrap"`, `"magic"`, 1),
		"env name":      strings.Replace(ok, `"A=b"`, `"1A=b"`, 1),
		"env no =":      strings.Replace(ok, `"A=b"`, `"A"`, 1),
		"env NUL":       strings.Replace(ok, `"A=b"`, `"A=\u0000"`, 1),
		"image id":      strings.Replace(ok, `"image":"x"`, `"image":"x","image_id":"sha256:zz"`, 1),
		"tree":          strings.Replace(ok, `"tree":"sha256:`, `"tree":"md5:`, 1),
		"trailing data": ok + `{}`,
	} {
		if _, err := ParseManifest([]byte(bad)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzParseManifest(f *testing.F) {
	f.Add([]byte(`{"format":1,"language":"python","image":"x","built_by":"docker-export","image_id":"sha256:` + strings.Repeat("a", 64) + `","env":["PATH=/usr/bin"],"tree":"sha256:` + strings.Repeat("0", 64) + `"}`))
	f.Add([]byte(`{"env":["=x"]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseManifest(b)
		if err != nil {
			return
		}
		// Whatever parses is safe to hand to bwrap --setenv and to name a
		// directory entry.
		if !ValidLanguage(m.Language) || strings.ContainsAny(m.Language, "/.") {
			t.Fatalf("language %q accepted", m.Language)
		}
		for _, e := range m.Env {
			k, v, ok := strings.Cut(e, "=")
			if !ok || k == "" || strings.ContainsAny(k, "=\x00") || strings.ContainsRune(v, 0) {
				t.Fatalf("env %q accepted", e)
			}
		}
	})
}
