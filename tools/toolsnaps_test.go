package tools

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// TestToolSnapshots guards every tool's public schema. A change shows up as
// a diff in review; UPDATE_TOOLSNAPS=true go test ./tools/ rewrites them.
// A missing snapshot is created locally but fails in CI.
func TestToolSnapshots(t *testing.T) {
	all, err := DefaultGroup(Deps{}).Enable([]string{"all"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(all) == 0 {
		t.Fatal("no tools")
	}
	seen := map[string]bool{}
	for _, st := range all {
		name := st.Tool.Name
		seen[name+".snap"] = true
		got, err := json.MarshalIndent(st.Tool, "", "  ")
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got = append(got, '\n')
		path := filepath.Join("__toolsnaps__", name+".snap")
		want, err := os.ReadFile(path)
		switch {
		case os.Getenv("UPDATE_TOOLSNAPS") == "true" || (os.IsNotExist(err) && os.Getenv("CI") != "true"):
			if err := os.MkdirAll("__toolsnaps__", 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, got, 0o644); err != nil {
				t.Fatal(err)
			}
		case err != nil:
			t.Errorf("%s: snapshot missing (%v); run UPDATE_TOOLSNAPS=true go test ./tools/", name, err)
		case !bytes.Equal(got, want):
			t.Errorf("%s: schema changed; review and run UPDATE_TOOLSNAPS=true go test ./tools/\n--- want\n%s\n--- got\n%s", name, want, got)
		}
	}
	entries, _ := os.ReadDir("__toolsnaps__")
	for _, e := range entries {
		if !seen[e.Name()] {
			t.Errorf("stale snapshot %s has no tool", e.Name())
		}
	}
}

// TestReadmeToolTableIsCurrent fails when the README's generated section
// differs from the code; `go run ./cmd/sandbox-broker docs` fixes it.
func TestReadmeToolTableIsCurrent(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	want, err := ReplaceDocs(string(readme), DocsMarkdown(DefaultGroup(Deps{})))
	if err != nil {
		t.Fatal(err)
	}
	if want != string(readme) {
		t.Fatal("README tool table is stale; run: go run ./cmd/sandbox-broker docs")
	}
}
