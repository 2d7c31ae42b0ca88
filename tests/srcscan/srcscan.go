// Package srcscan reads the broker's own Go sources for tests that hold
// something outside the code (a dashboard, the log's redaction) to what
// the code defines.
package srcscan

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// Submatches walks the non-test Go files under root (skipping hidden
// directories, testdata and node_modules) and returns every first
// submatch of re, each with a file it was found in.
func Submatches(root string, re *regexp.Regexp) (map[string]string, error) {
	found := map[string]string{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != root && (d.Name() == "node_modules" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range re.FindAllSubmatch(src, -1) {
			found[string(m[1])] = path
		}
		return nil
	})
	return found, err
}
