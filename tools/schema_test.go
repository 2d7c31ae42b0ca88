package tools

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/sandbox-broker/sandbox-broker/middleware"
)

// validArgs is one valid call per tool: the base the test mutates.
var validArgs = map[string]string{
	"get_usage":                  `{}`,
	"list_runners":               `{}`,
	"run_code":                   `{"language":"python","code":"print(1)"}`,
	"close_session":              `{"session_id":"s1"}`,
	"list_artifacts":             `{"session_id":"s1"}`,
	"read_artifact":              `{"session_id":"s1","path":"a.txt"}`,
	"upload_file":                `{"path":"a.txt","content":"x"}`,
	"create_upload_url":          `{"path":"a.txt"}`,
	"cancel_execution":           `{"execution_id":"e1"}`,
	"execute_code":               `{"command":"true"}`,
	"execute_code_async":         `{"command":"true"}`,
	"get_execution_output":       `{"execution_id":"e1"}`,
	"get_execution_status":       `{"execution_id":"e1"}`,
	"list_executions":            `{}`,
	"send_stdin":                 `{"execution_id":"e1","input_data":"x"}`,
	"create_sandbox_for_project": `{"project_name":"p","template":"react"}`,
	"get_sandbox_output":         `{"sandbox_id":"s1","output_type":"console_log"}`,
	"list_sandboxes":             `{}`,
	"write_files_to_sandbox":     `{"sandbox_id":"s1","files":{"a.txt":"x"}}`,
	"commit_and_push_to_github":  `{"repo_id":"r","branch":"b","files":{"a.txt":"x"},"commit_message":"m"}`,
	"commit_session_files":       `{"repo_id":"r","branch":"b","session_id":"s1","paths":["a.txt"],"commit_message":"m"}`,
	"read_github_file":           `{"repo_id":"r","file_path":"a.txt"}`,
	ResourceRead:                 `{"uri":"sandbox://sessions/s1/files/a.txt"}`,
	"execute_task":               `{"task":"t"}`,
	"get_files":                  `{"session_id":"s1","paths":["a.txt"]}`,
	"cleanup_session":            `{"session_id":"s1"}`,
}

// fieldBases replace the base for one field whose rule excludes another
// (excluded_with is not a per-field bound and is left out of the schema).
var fieldBases = map[string]string{
	"upload_file.content_base64": `{"path":"a.txt"}`,
}

// TestSchemasMatchTheValidator holds every published schema to the
// validator the chain runs: values at and just past each bound the schema
// states (minimum/maximum, minLength/maxLength, min/maxItems,
// min/maxProperties, enum members and a non-member, pattern lengths,
// required fields) must be accepted or refused by both alike. Only the
// zero value of an optional field may differ: the server treats it as
// absent, the schema publishes the non-zero range. The engine's
// SANDBOX_MAX_TIMEOUT is not the default, to show the configured bound
// reaches both.
func TestSchemasMatchTheValidator(t *testing.T) {
	const maxTimeout = 300
	g := DefaultGroup(Deps{Engine: &Engine{MaxTimeout: maxTimeout * time.Second}})
	all, err := g.Enable([]string{"all"}, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range g.Resources([]string{"all"}) {
		all = append(all, r.Read)
	}
	for _, st := range all {
		name := st.Tool.Name
		base, ok := validArgs[name]
		if !ok {
			t.Errorf("%s: add a valid call to validArgs", name)
			continue
		}
		c := schemaChecker{t: t, tool: name, spec: st.Args, schema: compileSchema(t, name, st.Args.Schema())}
		var s map[string]any
		if err := json.Unmarshal(st.Args.Schema(), &s); err != nil {
			t.Fatal(err)
		}
		c.check(decodeJSON(t, base), nil, "base call", true)
		c.object(s, base, nil)
	}
	// The configured bound, not the default, is what both apply.
	for _, st := range all {
		var s struct {
			Properties map[string]map[string]any `json:"properties"`
		}
		_ = json.Unmarshal(st.Args.Schema(), &s)
		for _, f := range []string{"timeout_s", "timeout_seconds"} {
			if p, ok := s.Properties[f]; ok && p["maximum"] != float64(maxTimeout) {
				t.Errorf("%s.%s: maximum %v, want SANDBOX_MAX_TIMEOUT %d", st.Tool.Name, f, p["maximum"], maxTimeout)
			}
		}
	}
}

type schemaChecker struct {
	t      *testing.T
	tool   string
	spec   middleware.ArgSpec
	schema *jsonschema.Schema
}

func compileSchema(t *testing.T, name string, raw json.RawMessage) *jsonschema.Schema {
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	url := "mem://" + name + ".json"
	if err := c.AddResource(url, doc); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile(url)
	if err != nil {
		t.Fatalf("%s: schema does not compile: %v", name, err)
	}
	return s
}

func decodeJSON(t *testing.T, s string) map[string]any {
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// check compares the schema's and the validator's verdicts on args. Unless
// strict, the server may accept what the schema refuses (the zero value of
// an optional field).
func (c schemaChecker) check(args map[string]any, path []string, what string, strict bool) {
	c.t.Helper()
	raw, err := json.Marshal(args)
	if err != nil {
		c.t.Fatal(err)
	}
	inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		c.t.Fatal(err)
	}
	schemaOK := c.schema.Validate(inst) == nil
	serverErr := c.spec.Validate(raw)
	serverOK := serverErr == nil
	if schemaOK == serverOK || (!strict && serverOK) {
		return
	}
	c.t.Errorf("%s %s (%s): the schema says valid=%v, the validator %v\n  args %s", c.tool, strings.Join(path, "."), what, schemaOK, serverErr, truncate(raw))
}

func truncate(b []byte) string {
	if len(b) > 200 {
		return string(b[:200]) + "…"
	}
	return string(b)
}

// object mutates each property of the object schema s inside the base call.
func (c schemaChecker) object(s map[string]any, base string, path []string) {
	props, _ := s["properties"].(map[string]any)
	required := map[string]bool{}
	if r, ok := s["required"].([]any); ok {
		for _, n := range r {
			required[n.(string)] = true
		}
	}
	names := make([]string, 0, len(props))
	for n := range props {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		p := props[n].(map[string]any)
		fieldPath := append(append([]string{}, path...), n)
		b := base
		if alt, ok := fieldBases[c.tool+"."+strings.Join(fieldPath, ".")]; ok {
			b = alt
		}
		if required[n] && len(path) == 0 {
			args := decodeJSON(c.t, b)
			delete(args, n)
			c.check(args, fieldPath, "required field left out", true)
		}
		for _, v := range cases(p) {
			args := decodeJSON(c.t, b)
			setPath(args, fieldPath, v.value)
			c.check(args, fieldPath, v.what, required[n] || !isZero(v.value))
		}
	}
}

func setPath(m map[string]any, path []string, v any) {
	for _, k := range path[:len(path)-1] {
		next, ok := m[k].(map[string]any)
		if !ok {
			next = map[string]any{}
			m[k] = next
		}
		m = next
	}
	m[path[len(path)-1]] = v
}

func isZero(v any) bool {
	switch x := v.(type) {
	case string:
		return x == ""
	case int:
		return x == 0
	case []any:
		return len(x) == 0
	case map[string]any:
		return len(x) == 0
	}
	return false
}

type probe struct {
	value any
	what  string
}

// cases are the values to try for a property with schema p: each bound
// and one step past it, each enum member and a non-member, and, inside
// arrays, objects and oneOf alternatives, the same for their parts.
func cases(p map[string]any) []probe {
	var out []probe
	add := func(v any, format string, a ...any) { out = append(out, probe{v, fmt.Sprintf(format, a...)}) }
	num := func(k string) (int, bool) {
		f, ok := p[k].(float64)
		return int(f), ok
	}
	if enum, ok := p["enum"].([]any); ok {
		for _, e := range enum {
			add(e, "enum member %v", e)
		}
		add("not-a-member", "not an enum member")
	}
	if alts, ok := p["oneOf"].([]any); ok {
		for _, a := range alts {
			for _, v := range cases(a.(map[string]any)) {
				add(v.value, "oneOf: %s", v.what)
			}
		}
	}
	switch p["type"] {
	case "integer":
		if n, ok := num("minimum"); ok {
			add(n, "minimum %d", n)
			add(n-1, "below minimum %d", n)
		}
		if n, ok := num("maximum"); ok {
			add(n, "maximum %d", n)
			add(n+1, "above maximum %d", n)
		}
	case "string":
		lengths := map[int]string{0: "empty"}
		if n, ok := num("minLength"); ok {
			lengths[n], lengths[n-1] = "minLength", "below minLength"
		}
		if n, ok := num("maxLength"); ok {
			lengths[n], lengths[n+1] = "maxLength", "above maxLength"
		}
		if pat, ok := p["pattern"].(string); ok {
			// Lengths around the bounds the pattern holds, e.g. {1,64}.
			for _, m := range regexp.MustCompile(`\{(\d+),(\d+)\}`).FindAllStringSubmatch(pat, -1) {
				var lo, hi int
				fmt.Sscan(m[1], &lo)
				fmt.Sscan(m[2], &hi)
				lengths[lo], lengths[hi], lengths[hi+1] = "pattern's least length", "pattern's greatest length", "past the pattern's length"
			}
			add("not valid!", "breaks the pattern")
		}
		for n, what := range lengths {
			if n >= 0 {
				add(strings.Repeat("a", n), "%s (%d)", what, n)
			}
		}
	case "array":
		items, _ := p["items"].(map[string]any)
		for _, k := range []string{"minItems", "maxItems"} {
			if n, ok := num(k); ok {
				for _, m := range []int{n - 1, n, n + 1} {
					if m >= 0 {
						add(repeatSample(items, m), "%s %d: %d items", k, n, m)
					}
				}
			}
		}
		for _, v := range cases(items) {
			add([]any{v.value}, "item: %s", v.what)
		}
	case "object":
		if ap, ok := p["additionalProperties"].(map[string]any); ok {
			for _, k := range []string{"minProperties", "maxProperties"} {
				if n, ok := num(k); ok {
					for _, m := range []int{n - 1, n, n + 1} {
						if m >= 0 {
							add(sampleMap(ap, m), "%s %d: %d entries", k, n, m)
						}
					}
				}
			}
			for _, v := range cases(ap) {
				add(map[string]any{"k": v.value}, "entry: %s", v.what)
			}
		}
		if props, ok := p["properties"].(map[string]any); ok {
			base, _ := sample(p).(map[string]any)
			for name, sub := range props {
				for _, v := range cases(sub.(map[string]any)) {
					obj := map[string]any{}
					for k, x := range base {
						obj[k] = x
					}
					obj[name] = v.value
					add(obj, "%s: %s", name, v.what)
				}
			}
		}
	}
	return out
}

// sample is a value the schema p accepts, for filling arrays and maps.
func sample(p map[string]any) any {
	if enum, ok := p["enum"].([]any); ok {
		return enum[0]
	}
	if alts, ok := p["oneOf"].([]any); ok {
		return sample(alts[0].(map[string]any))
	}
	switch p["type"] {
	case "integer":
		if n, ok := p["minimum"].(float64); ok {
			return int(n)
		}
		return 1
	case "boolean":
		return true
	case "array":
		n, _ := p["minItems"].(float64)
		items, _ := p["items"].(map[string]any)
		return repeatSample(items, max(int(n), 1))
	case "object":
		if ap, ok := p["additionalProperties"].(map[string]any); ok {
			n, _ := p["minProperties"].(float64)
			return sampleMap(ap, max(int(n), 1))
		}
		out := map[string]any{}
		props, _ := p["properties"].(map[string]any)
		if req, ok := p["required"].([]any); ok {
			for _, r := range req {
				out[r.(string)] = sample(props[r.(string)].(map[string]any))
			}
		}
		return out
	}
	// A string: one the pattern accepts, of at least minLength.
	n, _ := p["minLength"].(float64)
	s := strings.Repeat("a", max(int(n), 1))
	if pat, ok := p["pattern"].(string); ok && !regexp.MustCompile(pat).MatchString(s) {
		s = "a.example.com"
	}
	return s
}

func repeatSample(items map[string]any, n int) []any {
	out := make([]any, n)
	for i := range out {
		v := sample(items)
		if s, ok := v.(string); ok && strings.HasSuffix(s, ".example.com") {
			v = fmt.Sprintf("a%d.example.com", i) // distinct names
		}
		out[i] = v
	}
	return out
}

func sampleMap(ap map[string]any, n int) map[string]any {
	out := map[string]any{}
	for i := 0; i < n; i++ {
		out[fmt.Sprintf("k%d.txt", i)] = sample(ap)
	}
	return out
}

// execute_code_async returns at once: it neither shows nor accepts
// execute_code's wait_for_completion.
func TestExecuteCodeAsyncHasNoWaitOption(t *testing.T) {
	j := &Jobs{}
	for _, tc := range []struct {
		tool ServerTool
		has  bool
	}{{j.ExecuteCode(), true}, {j.ExecuteCodeAsync(), false}} {
		var s struct {
			Properties map[string]any `json:"properties"`
		}
		if err := json.Unmarshal(tc.tool.Args.Schema(), &s); err != nil {
			t.Fatal(err)
		}
		_, shown := s.Properties["wait_for_completion"]
		err := tc.tool.Args.Validate([]byte(`{"command":"true","wait_for_completion":false}`))
		if shown != tc.has || (err == nil) != tc.has {
			t.Errorf("%s: wait_for_completion shown %v, refused %v", tc.tool.Tool.Name, shown, err)
		}
	}
}
