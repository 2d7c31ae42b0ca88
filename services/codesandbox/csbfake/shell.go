package csbfake

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"
)

func sortedKeys[K cmp.Ordered, V any](m map[K]V) []K { return slices.Sorted(maps.Keys(m)) }

var errSyntax = errors.New("unsupported shell syntax")

// ShellWords splits a command line like a POSIX shell would for the
// subset the fake understands: blanks separate words; single quotes,
// double quotes (with \" \\ \$ \` escapes) and backslash escapes join.
// Operators (; & | < > $ ` ( )) outside quotes are refused.
func ShellWords(s string) ([]string, error) {
	var (
		words []string
		cur   strings.Builder
		in    bool // inside a word
	)
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n':
			if in {
				words = append(words, cur.String())
				cur.Reset()
				in = false
			}
		case c == '\'':
			j := strings.IndexByte(s[i+1:], '\'')
			if j < 0 {
				return nil, errSyntax
			}
			cur.WriteString(s[i+1 : i+1+j])
			i += j + 1
			in = true
		case c == '"':
			i++
			for ; i < len(s) && s[i] != '"'; i++ {
				if s[i] == '\\' && i+1 < len(s) && strings.IndexByte("\"\\$`", s[i+1]) >= 0 {
					i++
				} else if s[i] == '$' || s[i] == '`' {
					return nil, errSyntax
				}
				cur.WriteByte(s[i])
			}
			if i >= len(s) {
				return nil, errSyntax
			}
			in = true
		case c == '\\':
			if i+1 >= len(s) {
				return nil, errSyntax
			}
			i++
			cur.WriteByte(s[i])
			in = true
		case strings.IndexByte(";&|<>$`()", c) >= 0:
			return nil, errSyntax
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	if in {
		words = append(words, cur.String())
	}
	return words, nil
}

// runCommand interprets the tiny command set the fake VM knows: `npm run
// build`, `cat`, `echo`, `ls` and `sleep`, optionally wrapped in `bash -c
// '…'`. Anything else exits 127. The caller holds the server lock.
func runCommand(fs *vmFS, line, cwd string) (out string, code int, wait time.Duration) {
	argv, err := ShellWords(line)
	if err != nil {
		return "bash: " + err.Error() + "\n", 2, 0
	}
	if len(argv) == 3 && argv[0] == "bash" && argv[1] == "-c" {
		if argv, err = ShellWords(argv[2]); err != nil {
			return "bash: " + err.Error() + "\n", 2, 0
		}
	}
	if len(argv) == 0 {
		return "", 0, 0
	}
	switch argv[0] {
	case "echo":
		return strings.Join(argv[1:], " ") + "\n", 0, 0
	case "cat":
		var b strings.Builder
		code := 0
		for _, a := range argv[1:] {
			p := absFrom(cwd, a)
			if c, e := fs.read(p); e == 0 {
				b.Write(c)
			} else if e == errEISDIR {
				fmt.Fprintf(&b, "cat: %s: Is a directory\n", a)
				code = 1
			} else {
				fmt.Fprintf(&b, "cat: %s: No such file or directory\n", a)
				code = 1
			}
		}
		return b.String(), code, 0
	case "ls":
		dir := cwd
		if len(argv) > 1 {
			dir = absFrom(cwd, argv[1])
		}
		if fs.isFile(dir) {
			return argv[1] + "\n", 0, 0
		}
		if !fs.isDir(dir) {
			return fmt.Sprintf("ls: cannot access '%s': No such file or directory\n", argv[1]), 2, 0
		}
		names := fs.list(dir)
		if len(names) == 0 {
			return "", 0, 0
		}
		return strings.Join(names, "\n") + "\n", 0, 0
	case "sleep":
		if len(argv) == 2 {
			if n, err := strconv.ParseFloat(argv[1], 64); err == nil && n >= 0 && n <= 3600 {
				return "", 0, time.Duration(n * float64(time.Second))
			}
		}
		return "sleep: invalid time interval\n", 1, 0
	case "npm":
		if len(argv) == 3 && argv[1] == "run" && argv[2] == "build" {
			return npmBuild(fs, cwd)
		}
	}
	return "bash: line 1: " + argv[0] + ": command not found\n", 127, 0
}

// npmBuild is a deterministic stand-in for a bundler: it needs
// package.json with a build script and writes dist/index.html from
// index.html, or from the src/ files when there is none.
func npmBuild(fs *vmFS, cwd string) (string, int, time.Duration) {
	pkgPath := path.Join(cwd, "package.json")
	raw, e := fs.read(pkgPath)
	if e != 0 {
		return "npm error code ENOENT\nnpm error syscall open\nnpm error path " + pkgPath +
			"\nnpm error errno -2\nnpm error enoent Could not read package.json: Error: ENOENT: no such file or directory, open '" + pkgPath + "'\n", 1, 0
	}
	var pkg struct {
		Scripts map[string]string `json:"scripts"`
	}
	if err := json.Unmarshal(raw, &pkg); err != nil {
		return "npm error code EJSONPARSE\nnpm error JSON.parse Invalid package.json\n", 1, 0
	}
	script, ok := pkg.Scripts["build"]
	if !ok {
		return "npm error Missing script: \"build\"\n", 1, 0
	}
	html, e := fs.read(path.Join(cwd, "index.html"))
	if e != 0 {
		var b strings.Builder
		b.WriteString("<!doctype html>\n<html><body>\n<script type=\"module\">\n")
		prefix := path.Join(cwd, "src") + "/"
		all := fs.files()
		for _, p := range sortedKeys(all) {
			if rest, ok := strings.CutPrefix(p, prefix); ok {
				fmt.Fprintf(&b, "// src/%s\n%s\n", rest, all[p])
			}
		}
		b.WriteString("</script>\n</body></html>\n")
		html = []byte(b.String())
	}
	fs.write(path.Join(cwd, "dist", "index.html"), html, true)
	return fmt.Sprintf("\n> build\n> %s\n\n\x1b[32m✓\x1b[39m built dist/index.html (%d bytes)\n", script, len(html)), 0, 0
}
