package middleware

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

type schemaInner struct {
	Name string `json:"name" validate:"required,identifier" audit:"clear"`
	Port int    `json:"port,omitempty" validate:"omitempty,gte=1,lte=65535"`
}

type schemaArgs struct {
	Session  string              `json:"session_id" validate:"required,session_id" audit:"clear" desc:"the session"`
	Language string              `json:"language" validate:"required,oneof=python node bash" audit:"clear"`
	Code     string              `json:"code,omitempty" validate:"omitempty,min=1,max=1000,clean" audit:"digest"`
	Timeout  int                 `json:"timeout_s,omitempty" validate:"omitempty,min=1,max=300"`
	Ratio    float64             `json:"ratio,omitempty"`
	Files    []string            `json:"files,omitempty" validate:"omitempty,max=5,dive,required,max=64" audit:"clear"`
	Env      map[string]string   `json:"env,omitempty" validate:"omitempty,max=8,dive,max=100" audit:"keys"`
	Inner    *schemaInner        `json:"inner,omitempty" audit:"clear"`
	Matrix   [][]int             `json:"matrix,omitempty" audit:"digest"`
	Labels   map[string][]string `json:"labels,omitempty" audit:"digest"`
	Verbose  *bool               `json:"verbose,omitempty"`
	Skipped  string              `json:"-"`
}

func TestSchemaFromTags(t *testing.T) {
	spec := Args[schemaArgs](0)
	if spec.MaxBytes != DefaultMaxArgBytes {
		t.Errorf("MaxBytes = %d", spec.MaxBytes)
	}
	var s map[string]any
	if err := json.Unmarshal(spec.Schema(), &s); err != nil {
		t.Fatal(err)
	}
	want := `{
	  "additionalProperties": false,
	  "properties": {
	    "code": {"maxLength": 1000, "minLength": 1, "type": "string"},
	    "env": {"additionalProperties": {"maxLength": 100, "type": "string"}, "maxProperties": 8, "type": "object"},
	    "files": {"items": {"maxLength": 64, "minLength": 1, "type": "string"}, "maxItems": 5, "type": "array"},
	    "inner": {"additionalProperties": false, "properties": {
	        "name": {"pattern": "^[A-Za-z0-9_-]{1,50}$", "type": "string"},
	        "port": {"maximum": 65535, "minimum": 1, "type": "integer"}},
	      "required": ["name"], "type": "object"},
	    "labels": {"additionalProperties": {"items": {"type": "string"}, "type": "array"}, "type": "object"},
	    "language": {"enum": ["python", "node", "bash"], "type": "string"},
	    "matrix": {"items": {"items": {"type": "integer"}, "type": "array"}, "type": "array"},
	    "ratio": {"type": "number"},
	    "session_id": {"description": "the session", "pattern": "^[A-Za-z0-9_-]{1,64}$", "type": "string"},
	    "timeout_s": {"maximum": 300, "minimum": 1, "type": "integer"},
	    "verbose": {"type": "boolean"}
	  },
	  "required": ["session_id", "language"],
	  "type": "object"
	}`
	var w map[string]any
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(s, w) {
		got, _ := json.MarshalIndent(s, "", "  ")
		t.Errorf("schema:\n%s", got)
	}
}

func TestArgsRejectsNonStruct(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("Args[string] did not panic")
		}
	}()
	Args[string](0)
}

// The schema and the validator agree: a value at each published bound is
// accepted and one past it refused.
func TestSchemaBoundsMatchValidation(t *testing.T) {
	ok := `{"session_id":"` + strings.Repeat("s", 64) + `","language":"bash","timeout_s":300,"files":["a","b","c","d","` + strings.Repeat("f", 64) + `"],"inner":{"name":"` + strings.Repeat("n", 50) + `","port":65535}}`
	if _, err := decodeStrict[schemaArgs]([]byte(ok)); err != nil {
		t.Fatalf("at the bounds: %v", err)
	}
	for _, bad := range []string{
		`{"session_id":"` + strings.Repeat("s", 65) + `","language":"bash"}`,
		`{"session_id":"s/1","language":"bash"}`,
		`{"session_id":"s","language":"ruby"}`,
		`{"session_id":"s","language":"bash","timeout_s":301}`,
		`{"session_id":"s","language":"bash","timeout_s":-1}`,
		`{"session_id":"s","language":"bash","files":["a","b","c","d","e","f"]}`,
		`{"session_id":"s","language":"bash","files":[""]}`,
		`{"session_id":"s","language":"bash","files":["` + strings.Repeat("f", 65) + `"]}`,
		`{"session_id":"s","language":"bash","inner":{}}`,
		`{"session_id":"s","language":"bash","inner":{"name":"a","port":65536}}`,
		`{"session_id":"s","language":"bash","inner":{"name":"a","extra":1}}`,
		`{"session_id":"s","language":"bash","code":""}`, // omitempty: empty is absent, so this is fine
	} {
		_, err := decodeStrict[schemaArgs]([]byte(bad))
		if strings.Contains(bad, `"code":""`) {
			if err != nil {
				t.Errorf("%s: %v", bad, err)
			}
			continue
		}
		if brokererr.CodeOf(err) != brokererr.InvalidInput {
			t.Errorf("%s: err = %v, want INVALID_INPUT", bad, err)
		}
	}
}

func TestValidationMessages(t *testing.T) {
	cases := map[string]string{
		`{"language":"bash"}`:                                                                 `field "session_id" is required`,
		`{"session_id":"a b","language":"bash"}`:                                              `field "session_id" must match ^[A-Za-z0-9_-]{1,64}$`,
		`{"session_id":"s","language":"bash","inner":{"name":"a","port":0.5}}`:                `field "inner.port" must be an integer`,
		`{"session_id":"s","language":"bash","inner":{"name":"a b"}}`:                         `field "inner.name" must match`,
		`{"session_id":"s","language":"bash","env":{"a":"` + strings.Repeat("x", 101) + `"}}`: `field "env[a]" must be at most 100 characters`,
		`{"session_id":"s","language":"bash","ratio":"1"}`:                                    `field "ratio" must be a number`,
		`{"session_id":"s","language":"bash","verbose":1}`:                                    `field "verbose" must be a boolean`,
		`{"session_id":"s","language":"bash","Skipped":"x"}`:                                  `unknown field "Skipped"`,
		`{"session_id":"s","language":"bash","timeout_s":1e400}`:                              `timeout_s`,
		` {"session_id":"s"`: `not valid JSON`,
		`{"session_id":"s","language":"bash","SESSION_ID":"t"}`:                     `unknown field "SESSION_ID"`,
		`{"session_id":"s","language":"bash","Language":"node"}`:                    `unknown field "Language"`,
		`{"session_id":"s","language":"bash","session_id":"t"}`:                     `duplicate field "session_id"`,
		`{"session_id":"s","language":"bash","inner":{"name":"a","NAME":"b"}}`:      `unknown field "NAME"`,
		`{"session_id":"s","language":"bash","env":{"k":"1","k":"2"}}`:              `duplicate field "k"`,
		`{"session_id":"s","language":"bash","labels":{"a":[],"b":[]},"labels":{}}`: `duplicate field "labels"`,
	}
	for in, want := range cases {
		_, err := decodeStrict[schemaArgs]([]byte(in))
		e := brokererr.As(err)
		if e == nil || e.Code != brokererr.InvalidInput || !strings.Contains(e.Message, want) {
			t.Errorf("%s: err = %v, want message containing %q", in, err, want)
		}
	}
}

func TestSummarize(t *testing.T) {
	v := true
	got := summarize(&chainArgs{Path: "p", Mode: "read", Label: strings.Repeat("L", 5000), Count: 2, Force: &v})
	if got["mode"] != "read" || got["count"] != 2 || got["force"] != true {
		t.Errorf("summary %v", got)
	}
	if l := got["label"].(string); len(l) > maxClearBytes || !strings.HasPrefix(l, strings.Repeat("L", 4000)) {
		t.Errorf("clear label: %d bytes, want capped at %d", len(l), maxClearBytes)
	}
	if p := got["path"].(map[string]any); p["bytes"] != 1 || len(p["sha256"].(string)) != 16 {
		t.Errorf("path digest %v", p)
	}
	if _, ok := got["tags"]; ok {
		t.Error("zero fields are omitted")
	}
}

type netPolicy struct{ allowed []string }

func (n netPolicy) MarshalJSON() ([]byte, error) {
	return json.Marshal(map[string]any{"mode": "allow", "allowed_domains": n.allowed})
}

type sandboxOpts struct {
	Network *netPolicy `json:"network,omitempty" audit:"clear"`
	Image   string     `json:"image,omitempty" audit:"clear"`
	Token   string     `json:"token,omitempty" audit:"digest"`
}

type EmbeddedCommon struct {
	Session string `json:"session_id" audit:"clear"`
}

type securityArgs struct {
	EmbeddedCommon
	Code    string            `json:"code" audit:"digest"`
	Env     map[string]string `json:"environment,omitempty" audit:"keys"`
	Files   map[string]string `json:"files,omitempty" audit:"keys"`
	Paths   []string          `json:"paths,omitempty" audit:"clear"`
	Sandbox *sandboxOpts      `json:"sandbox_config,omitempty" audit:"clear"`
	PR      bool              `json:"create_pr,omitempty"`
	Wait    *bool             `json:"wait,omitempty"`
}

// Issue 10 item 20: an argument struct behind a pointer (sandbox_config)
// was dropped; environment names and file paths were only digests.
func TestSummaryKeepsSecurityArguments(t *testing.T) {
	yes := true
	got := summarize(&securityArgs{
		EmbeddedCommon: EmbeddedCommon{Session: "sess_1"},
		Code:           "print(secret)",
		Env:            map[string]string{"API_KEY": "value-never-logged", "DEBUG": "1"},
		Files:          map[string]string{"src/b.go": "content-never-logged", "a.md": "x"},
		Paths:          []string{"out/report.csv"},
		Sandbox:        &sandboxOpts{Network: &netPolicy{allowed: []string{"api.example.com"}}, Token: "tok-never-logged"},
		PR:             true,
		Wait:           &yes,
	})
	b, _ := json.Marshal(got)
	js := string(b)
	for _, want := range []string{`"session_id":"sess_1"`, `"keys":["API_KEY","DEBUG"]`, `"keys":["a.md","src/b.go"]`,
		`"paths":["out/report.csv"]`, `"network":{"allowed_domains":["api.example.com"],"mode":"allow"}`, `"create_pr":true`, `"wait":true`} {
		if !strings.Contains(js, want) {
			t.Errorf("summary lacks %s: %s", want, js)
		}
	}
	for _, never := range []string{"value-never-logged", "content-never-logged", "tok-never-logged", "print(secret)"} {
		if strings.Contains(js, never) {
			t.Errorf("summary holds %q: %s", never, js)
		}
	}
	if err := Args[securityArgs](0).CheckAudit(); err != nil {
		t.Fatal(err)
	}
}

func TestArgsRequireAuditTags(t *testing.T) {
	type untagged struct {
		N int    `json:"n"`
		S string `json:"s"`
	}
	type nestedUntagged struct {
		Opts *struct {
			Host string `json:"host"`
		} `json:"opts" audit:"clear"`
	}
	type keysOnSlice struct {
		L []string `json:"l" audit:"keys"`
	}
	type tagOnNumber struct {
		N int `json:"n" audit:"digest"`
	}
	for name, build := range map[string]func(){
		"untagged string":      func() { Args[untagged](0) },
		"untagged nested":      func() { Args[nestedUntagged](0) },
		"keys on a slice":      func() { Args[keysOnSlice](0) },
		"digest on a number":   func() { Args[tagOnNumber](0) },
		"untagged in embedded": func() { Args[struct{ Embedded }](0) },
		"unexported embedded":  func() { Args[embedsHidden](0) },
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("Args accepted it")
				}
			}()
			build()
		})
	}
}

// hiddenBase's fields are tagged, but an unexported embedding hides them
// from reflection, so they would never reach the summary.
type hiddenBase struct {
	S string `json:"s" audit:"clear"`
}

type embedsHidden struct{ hiddenBase }

// Embedded has an untagged string field.
type Embedded struct {
	S string `json:"s"`
}

// CheckAudit catches a summary that loses a field or leaks a digest.
func TestCheckAuditFindsGaps(t *testing.T) {
	if err := Args[schemaArgs](0).CheckAudit(); err != nil {
		t.Fatalf("schemaArgs: %v", err)
	}
	spec := Args[securityArgs](0)
	spec.summary = func(v any) map[string]any {
		m := summarize(v)
		delete(m["sandbox_config"].(map[string]any), "network")
		return m
	}
	if err := spec.CheckAudit(); err == nil || !strings.Contains(err.Error(), "network is missing") {
		t.Errorf("lossy summary: %v", err)
	}
	spec.summary = func(v any) map[string]any {
		m := summarize(v)
		m["environment"] = v.(*securityArgs).Env
		return m
	}
	if err := spec.CheckAudit(); err == nil || !strings.Contains(err.Error(), "Env.value reaches the audit log") {
		t.Errorf("leaky summary: %v", err)
	}
}

type fuzzArgs struct {
	Session string            `json:"session_id" validate:"required,session_id"`
	Lang    string            `json:"language,omitempty" validate:"omitempty,oneof=python node"`
	Code    string            `json:"code" validate:"max=200,clean"`
	N       int               `json:"n" validate:"min=-5,max=1000"`
	F       float64           `json:"f"`
	Ok      *bool             `json:"ok"`
	Items   []string          `json:"items" validate:"max=4,dive,max=16,clean"`
	Env     map[string]string `json:"env" validate:"max=4,dive,max=16"`
	Inner   *schemaInner      `json:"inner"`
	Nested  [][]int64         `json:"nested" validate:"max=3"`
}

func FuzzDecodeArgs(f *testing.F) {
	for _, s := range []string{
		`{"session_id":"s"}`,
		`{"session_id":"abc_DEF-1","language":"python","code":"print(1)\n","n":-5,"f":1.5e3,"ok":false,"items":["a"],"env":{"K":"V"},"inner":{"name":"x","port":80},"nested":[[1,2],[]]}`,
		`{"session_id":"s","code":"\u0000"}`,
		`{"session_id":"s","code":"\ud800"}`,
		`{"session_id":"s","SESSION_ID":"t"}`,
		`{"session_id":"s","session_id":"t"}`,
		`{"session_id":"s"} {}`,
		`{"session_id":"s","n":1e2}`,
		`{"session_id":"s","n":9223372036854775808}`,
		`{"session_id":"s","f":-0}`,
		`{"session_id":"s","items":null,"env":{}}`,
		`{"session_id":"s","inner":null}`,
		"{\"session_id\":\"s\xff\"}",
		`[]`, `null`, ``, `   `, `{`, `{"a":`, `"x"`, `1`,
		`{"session_id":"s","nested":[[1],[2],[3],[4]]}`,
		`{"session_id":"s","env":{"\u00e9":"<>&"}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		v, err := decodeStrict[fuzzArgs](raw)
		if err != nil {
			if brokererr.CodeOf(err) != brokererr.InvalidInput {
				t.Fatalf("decode error is %v, want INVALID_INPUT", err)
			}
			if v != nil {
				t.Fatal("value returned with an error")
			}
			return
		}
		if err := validate.Struct(v); err != nil {
			t.Fatalf("accepted value fails validation: %v", err)
		}
		enc, err := json.Marshal(v)
		if err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		v2, err := decodeStrict[fuzzArgs](enc)
		if err != nil {
			t.Fatalf("re-encoding %s of accepted %q refused: %v", enc, raw, err)
		}
		if !reflect.DeepEqual(v, v2) {
			t.Fatalf("round trip changed the value:\n in  %q\n 1st %#v\n 2nd %#v", raw, v, v2)
		}
		enc2, _ := json.Marshal(v2)
		if !bytes.Equal(enc, enc2) {
			t.Fatalf("encoding not stable: %s vs %s", enc, enc2)
		}
		// The audit summary of any accepted value is encodable.
		if _, err := json.Marshal(summarize(v)); err != nil {
			t.Fatalf("summary: %v", err)
		}
	})
}

type EmbeddedBase struct {
	Session string `json:"session_id" validate:"required" audit:"clear"`
}

type embeddingArgs struct {
	EmbeddedBase
	Items []schemaInner `json:"items" validate:"dive" audit:"clear"`
}

func TestExactKeysFollowEmbeddingAndSlices(t *testing.T) {
	if _, err := decodeStrict[embeddingArgs]([]byte(`{"session_id":"s","items":[{"name":"a"}]}`)); err != nil {
		t.Fatalf("valid: %v", err)
	}
	for in, want := range map[string]string{
		`{"session_id":"s","items":[{"name":"a","Name":"b"}]}`: `unknown field "Name"`,
		`{"Session_Id":"s"}`: `unknown field "Session_Id"`,
		`{"session_id":"s","items":[{"name":"a"},{"name":"b","port":1,"port":2}]}`: `duplicate field "port"`,
	} {
		_, err := decodeStrict[embeddingArgs]([]byte(in))
		if e := brokererr.As(err); e == nil || !strings.Contains(e.Message, want) {
			t.Errorf("%s: %v, want %q", in, err, want)
		}
	}
}

// A rule known only at start-up tightens the validator and the schema alike.
func TestWithRulesReachSchemaAndValidator(t *testing.T) {
	spec := Args[embeddingArgs](0).WithRules(Rule{Field: "session_id", Tag: "max=4"})
	var s struct {
		Properties map[string]map[string]any `json:"properties"`
		Required   []string                  `json:"required"`
	}
	if err := json.Unmarshal(spec.Schema(), &s); err != nil {
		t.Fatal(err)
	}
	if s.Properties["session_id"]["maxLength"] != float64(4) || s.Properties["items"] == nil ||
		strings.Join(s.Required, ",") != "session_id" {
		t.Fatalf("schema %s", spec.Schema())
	}
	if err := spec.Validate([]byte(`{"session_id":"abcd","items":[]}`)); err != nil {
		t.Fatalf("at the bound: %v", err)
	}
	err := spec.Validate([]byte(`{"session_id":"abcde","items":[]}`))
	if e := brokererr.As(err); e == nil || e.Message != `field "session_id" must be at most 4 characters` {
		t.Fatalf("past the bound: %v", err)
	}
	// Embedded fields are audited like the outer ones.
	v, err := decodeStrict[embeddingArgs]([]byte(`{"session_id":"abcd","items":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	if sum := summarize(v); sum["session_id"] == nil {
		t.Fatalf("summary %v lacks the embedded field", sum)
	}
	defer func() {
		if recover() == nil {
			t.Error("a rule for an unknown field did not panic")
		}
	}()
	Args[embeddingArgs](0).WithRules(Rule{Field: "nope", Tag: "max=1"})
}
