package tools

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"
)

// Markers around the README's generated tool reference.
const (
	DocsStart = "<!-- START AUTOMATED TOOLS -->"
	DocsEnd   = "<!-- END AUTOMATED TOOLS -->"
)

// DocsMarkdown renders every toolset and tool, generated from the live
// definitions so the README cannot drift from the code.
func DocsMarkdown(g *Group) string {
	var b strings.Builder
	b.WriteString("| Toolset | Tool | Read-only | Description | Arguments |\n|---|---|---|---|---|\n")
	for _, ts := range g.Toolsets() {
		list := ts.Tools(false)
		sort.Slice(list, func(i, j int) bool { return list[i].Tool.Name < list[j].Tool.Name })
		for _, t := range list {
			ro := "no"
			if t.ReadOnly() {
				ro = "yes"
			}
			fmt.Fprintf(&b, "| `%s` | `%s` | %s | %s | %s |\n", ts.Name, t.Tool.Name, ro,
				escapeCell(t.Tool.Description), escapeCell(argsSummary(t.Args.Schema())))
		}
	}
	return b.String()
}

func argsSummary(schema json.RawMessage) string {
	var s struct {
		Properties map[string]struct {
			Type        any    `json:"type"`
			Description string `json:"description"`
		} `json:"properties"`
		Required []string `json:"required"`
	}
	if json.Unmarshal(schema, &s) != nil || len(s.Properties) == 0 {
		return "none"
	}
	req := map[string]bool{}
	for _, r := range s.Required {
		req[r] = true
	}
	names := make([]string, 0, len(s.Properties))
	for n := range s.Properties {
		names = append(names, n)
	}
	sort.Strings(names)
	parts := make([]string, 0, len(names))
	for _, n := range names {
		opt := "optional"
		if req[n] {
			opt = "required"
		}
		parts = append(parts, fmt.Sprintf("`%s` (%v, %s)", n, s.Properties[n].Type, opt))
	}
	return strings.Join(parts, ", ")
}

func escapeCell(s string) string {
	return strings.ReplaceAll(strings.ReplaceAll(s, "|", `\|`), "\n", " ")
}

// ReplaceDocs swaps the text between the markers in readme for generated.
func ReplaceDocs(readme, generated string) (string, error) {
	return ReplaceSection(readme, DocsStart, DocsEnd, generated)
}

// ReplaceSection puts generated between the README's start and end markers.
func ReplaceSection(readme, startMarker, endMarker, generated string) (string, error) {
	start := strings.Index(readme, startMarker)
	end := strings.Index(readme, endMarker)
	if start < 0 || end < start {
		return "", fmt.Errorf("README lacks %s … %s markers", startMarker, endMarker)
	}
	return readme[:start+len(startMarker)] + "\n" + generated + readme[end:], nil
}
