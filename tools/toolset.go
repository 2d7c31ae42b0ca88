// Package tools defines the broker's MCP tools. Each tool is a small
// constructor that returns its definition and handler with its dependencies
// injected; tools are grouped into toolsets an operator can enable.
package tools

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"

	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// ServerTool is a tool ready to register: definition, handler, argument spec.
type ServerTool struct {
	Tool    mcp.Tool
	Handler server.ToolHandlerFunc
	Args    middleware.ArgSpec
	// Needs lists services the tool needs beyond its toolset's.
	Needs []Service
}

// Service is a part of the broker that a toolset needs. Tools whose
// service is not configured are not listed: they could only ever answer
// NOT_CONFIGURED.
type Service string

// Services.
const (
	ServiceSandbox  Service = "sandbox backend"
	ServiceProjects Service = "project provider"
	ServiceGitHub   Service = "GitHub allow-list"
	ServiceModels   Service = "model gateway" // agent tasks
)

// ReadOnly reports the tool's readOnlyHint, the single source of truth for
// read-only mode.
func (t ServerTool) ReadOnly() bool {
	return t.Tool.Annotations.ReadOnlyHint != nil && *t.Tool.Annotations.ReadOnlyHint
}

// Handler is a typed tool body. It runs only after the chain has
// authenticated, validated, rate-limited and audited the call.
type Handler[A any] func(ctx context.Context, p identity.Principal, args *A) (*mcp.CallToolResult, error)

// newTool builds a ServerTool whose input schema comes from A's tags.
func newTool[A any](name, description string, maxArgBytes int, ann mcp.ToolAnnotation, h Handler[A]) ServerTool {
	spec := middleware.Args[A](maxArgBytes)
	def := mcp.NewTool(name, mcp.WithDescription(description), mcp.WithToolAnnotation(ann))
	// The raw schema replaces the default one; mcp-go refuses both at once.
	def.InputSchema = mcp.ToolInputSchema{}
	def.RawInputSchema = spec.Schema()
	handler := func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		ctx = withProgressToken(ctx, req)
		p, ok := identity.FromContext(ctx)
		args, okArgs := middleware.ArgsFrom[A](ctx)
		if !ok || !okArgs {
			// Reached without the chain: refuse rather than run unchecked.
			return nil, brokererr.New(brokererr.InternalError, "tool called outside the middleware chain")
		}
		return h(ctx, p, args)
	}
	return ServerTool{Tool: def, Handler: handler, Args: spec}
}

// withRules adds argument rules known only at start-up (configuration) to
// the validator and the published schema.
func (t ServerTool) withRules(rules ...middleware.Rule) ServerTool {
	t.Args = t.Args.WithRules(rules...)
	t.Tool.RawInputSchema = t.Args.Schema()
	return t
}

func boolPtr(b bool) *bool { return &b }

// readAnnotations marks a tool that changes nothing.
func readAnnotations(title string) mcp.ToolAnnotation {
	return mcp.ToolAnnotation{Title: title, ReadOnlyHint: boolPtr(true), DestructiveHint: boolPtr(false),
		IdempotentHint: boolPtr(true), OpenWorldHint: boolPtr(false)}
}

// writeAnnotations marks a tool that changes state; destructive says whether
// it can delete or overwrite.
func writeAnnotations(title string, destructive, idempotent bool) mcp.ToolAnnotation {
	return mcp.ToolAnnotation{Title: title, ReadOnlyHint: boolPtr(false), DestructiveHint: boolPtr(destructive),
		IdempotentHint: boolPtr(idempotent), OpenWorldHint: boolPtr(false)}
}

// Toolset is a named group of tools, and the resource templates they
// return links to, that an operator can enable.
type Toolset struct {
	Name        string
	Description string
	read, write []ServerTool
	resources   []ServerResource
	needs       []Service
}

// NewToolset starts an empty toolset.
func NewToolset(name, description string) *Toolset {
	return &Toolset{Name: name, Description: description}
}

// Needs declares services every tool of the toolset needs.
func (ts *Toolset) Needs(s ...Service) *Toolset {
	ts.needs = append(ts.needs, s...)
	return ts
}

// AddReadTools adds tools that must declare readOnlyHint=true; a mislabelled
// tool is a programming error and cannot ship.
func (ts *Toolset) AddReadTools(tools ...ServerTool) *Toolset {
	for _, t := range tools {
		if !t.ReadOnly() {
			panic(fmt.Sprintf("tool %s added as read-only but does not declare readOnlyHint=true", t.Tool.Name))
		}
	}
	ts.read = append(ts.read, tools...)
	return ts
}

// AddWriteTools adds tools that must not claim to be read-only.
func (ts *Toolset) AddWriteTools(tools ...ServerTool) *Toolset {
	for _, t := range tools {
		if t.ReadOnly() {
			panic(fmt.Sprintf("tool %s added as a write tool but declares readOnlyHint=true", t.Tool.Name))
		}
	}
	ts.write = append(ts.write, tools...)
	return ts
}

// AddResourceTemplates adds resource templates; reading changes nothing,
// so they are served in read-only mode too.
func (ts *Toolset) AddResourceTemplates(rs ...ServerResource) *Toolset {
	ts.resources = append(ts.resources, rs...)
	return ts
}

// Tools returns the toolset's tools; write tools only when readOnly is false.
func (ts *Toolset) Tools(readOnly bool) []ServerTool {
	out := append([]ServerTool{}, ts.read...)
	if !readOnly {
		out = append(out, ts.write...)
	}
	return out
}

// Group is every toolset the broker knows.
type Group struct {
	sets    []*Toolset
	missing map[Service]string // service → what to configure
}

// Toolsets returns the group's toolsets in registration order.
func (g *Group) Toolsets() []*Toolset { return g.sets }

// Unconfigured records that s is not available and why (what the operator
// would set); Enable and Resources then leave out what needs it.
func (g *Group) Unconfigured(s Service, why string) {
	if g.missing == nil {
		g.missing = map[Service]string{}
	}
	g.missing[s] = why
}

// lacking returns the first of needs that is not configured, if any.
func (g *Group) lacking(needs []Service) (Service, bool) {
	for _, s := range needs {
		if _, ok := g.missing[s]; ok {
			return s, true
		}
	}
	return "", false
}

// Enable resolves toolset names ("all" enables every one) into tools,
// sorted by name. Unknown names are an error, not silently ignored. "all"
// leaves out toolsets and tools whose service is not configured; naming
// such a toolset explicitly is an error that says what to configure.
func (g *Group) Enable(names []string, readOnly bool) ([]ServerTool, error) {
	want := nameSet(names)
	var out []ServerTool
	seen := map[string]bool{}
	for _, ts := range g.sets {
		if !selected(want, ts) {
			continue
		}
		explicit := want[ts.Name]
		delete(want, ts.Name)
		if s, ok := g.lacking(ts.needs); ok {
			if explicit {
				return nil, fmt.Errorf("toolset %s needs the %s, which is not configured: %s", ts.Name, s, g.missing[s])
			}
			continue
		}
		for _, t := range ts.Tools(readOnly) {
			if _, ok := g.lacking(t.Needs); ok {
				continue
			}
			if seen[t.Tool.Name] {
				return nil, fmt.Errorf("tool %s is defined twice", t.Tool.Name)
			}
			seen[t.Tool.Name] = true
			t.Args.Toolset = ts.Name // for the audit rows
			out = append(out, t)
		}
	}
	delete(want, "all")
	if len(want) > 0 {
		var unknown []string
		for n := range want {
			unknown = append(unknown, n)
		}
		sort.Strings(unknown)
		return nil, fmt.Errorf("unknown toolset(s) %s; known: %s", strings.Join(unknown, ", "), strings.Join(g.names(), ", "))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Tool.Name < out[j].Tool.Name })
	return out, nil
}

// Resources returns the resource templates of the named toolsets ("all"
// for every one), each once however many toolsets carry it. Enable has
// already refused unknown names.
func (g *Group) Resources(names []string) []ServerResource {
	want := nameSet(names)
	var out []ServerResource
	seen := map[string]bool{}
	for _, ts := range g.sets {
		if _, ok := g.lacking(ts.needs); ok || !selected(want, ts) {
			continue
		}
		for _, r := range ts.resources {
			if raw := r.Template.URITemplate.Raw(); !seen[raw] {
				seen[raw] = true
				r.Read.Args.Toolset = ts.Name // the first that carries it
				out = append(out, r)
			}
		}
	}
	return out
}

func nameSet(names []string) map[string]bool {
	set := map[string]bool{}
	for _, n := range names {
		set[n] = true
	}
	return set
}

// selected reports whether the names in want enable ts.
func selected(want map[string]bool, ts *Toolset) bool { return want["all"] || want[ts.Name] }

func (g *Group) names() []string {
	out := []string{"all"}
	for _, ts := range g.sets {
		out = append(out, ts.Name)
	}
	return out
}
