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

func TestToolRefusesCallsOutsideTheChain(t *testing.T) {
	st := fakeTool("x", true)
	res, err := st.Handler(context.Background(), mcp.CallToolRequest{})
	if err == nil || res != nil {
		t.Fatalf("handler ran without validated arguments: %v %v", res, err)
	}
}
