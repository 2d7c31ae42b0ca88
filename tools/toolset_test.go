package tools

import (
	"context"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

type noArgs struct{}

func fakeTool(name string, readOnly bool) ServerTool {
	ann := readAnnotations(name)
	if !readOnly {
		ann = writeAnnotations(name, true, false)
	}
	return newTool(name, "test tool", 0, ann, func(context.Context, identity.Principal, *noArgs) (*mcp.CallToolResult, error) {
		return mcp.NewToolResultText("ok"), nil
	})
}

func TestMislabelledToolsPanic(t *testing.T) {
	for name, add := range map[string]func(){
		"write tool as read": func() { NewToolset("x", "").AddReadTools(fakeTool("w", false)) },
		"read tool as write": func() { NewToolset("x", "").AddWriteTools(fakeTool("r", true)) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			add()
		}()
	}
}

func TestEnableToolsetsAndReadOnly(t *testing.T) {
	g := &Group{sets: []*Toolset{
		NewToolset("a", "").AddReadTools(fakeTool("a_read", true)).AddWriteTools(fakeTool("a_write", false)),
		NewToolset("b", "").AddReadTools(fakeTool("b_read", true)),
	}}
	names := func(ts []ServerTool) string {
		var out []string
		for _, t := range ts {
			out = append(out, t.Tool.Name)
		}
		return strings.Join(out, ",")
	}
	cases := []struct {
		sets     []string
		readOnly bool
		want     string
	}{
		{[]string{"all"}, false, "a_read,a_write,b_read"},
		{[]string{"all"}, true, "a_read,b_read"},
		{[]string{"b"}, false, "b_read"},
		{[]string{"a"}, true, "a_read"},
	}
	for _, c := range cases {
		got, err := g.Enable(c.sets, c.readOnly)
		if err != nil || names(got) != c.want {
			t.Errorf("Enable(%v, %v) = %s, %v; want %s", c.sets, c.readOnly, names(got), err, c.want)
		}
	}
	if _, err := g.Enable([]string{"a", "nope"}, false); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("unknown toolset: %v", err)
	}
}

func TestUnconfiguredServicesAreNotListed(t *testing.T) {
	needy := fakeTool("b_needs_gh", false)
	needy.Needs = []Service{ServiceGitHub}
	newGroup := func() *Group {
		return &Group{sets: []*Toolset{
			NewToolset("a", "").AddReadTools(fakeTool("a_read", true)),
			NewToolset("b", "").Needs(ServiceSandbox).AddReadTools(fakeTool("b_read", true)).
				AddResourceTemplates(FileResources(nil)),
			NewToolset("c", "").AddReadTools(fakeTool("c_read", true)).AddWriteTools(needy),
		}}
	}
	names := func(ts []ServerTool) string {
		var out []string
		for _, t := range ts {
			out = append(out, t.Tool.Name)
		}
		return strings.Join(out, ",")
	}
	g := newGroup()
	if got, err := g.Enable([]string{"all"}, false); err != nil || names(got) != "a_read,b_needs_gh,b_read,c_read" {
		t.Fatalf("all services configured: %s %v", names(got), err)
	}
	g.Unconfigured(ServiceSandbox, "SANDBOX_BACKEND=none")
	g.Unconfigured(ServiceGitHub, "GITHUB_REPOS_FILE is not set")
	got, err := g.Enable([]string{"all"}, false)
	if err != nil || names(got) != "a_read,c_read" {
		t.Fatalf("all without sandbox and GitHub: %s %v", names(got), err)
	}
	if rs := g.Resources([]string{"all"}); len(rs) != 0 {
		t.Fatalf("resources of an unconfigured toolset listed: %d", len(rs))
	}
	// Asking for the toolset by name is a start-up error that says what to set.
	_, err = g.Enable([]string{"a", "b"}, false)
	if err == nil || !strings.Contains(err.Error(), "toolset b") || !strings.Contains(err.Error(), "sandbox backend") ||
		!strings.Contains(err.Error(), "SANDBOX_BACKEND=none") {
		t.Fatalf("explicit unconfigured toolset: %v", err)
	}
	// A toolset whose own service is there loses only the tools that need more.
	if got, err := g.Enable([]string{"c"}, false); err != nil || names(got) != "c_read" {
		t.Fatalf("toolset c: %s %v", names(got), err)
	}
}

func TestToolRefusesCallsOutsideTheChain(t *testing.T) {
	st := fakeTool("x", true)
	res, err := st.Handler(context.Background(), mcp.CallToolRequest{})
	if err == nil || res != nil {
		t.Fatalf("handler ran without validated arguments: %v %v", res, err)
	}
}
