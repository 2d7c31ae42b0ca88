package codesandbox

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
)

// sdkFixtures holds payloads shaped exactly like the published types of
// @codesandbox/sdk 2.4.2; testdata/sdk-2.4.2/typecheck.sh checks each one
// against those types with tsc.
const sdkFixtures = "testdata/sdk-2.4.2"

// fixture reads one fixture file.
func fixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(sdkFixtures, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// shape is what a set of fixtures of one type allows: at each path the
// JSON kinds seen, for objects the keys seen (allowed) and the keys every
// example had (required), for arrays the shape of all elements together.
// Fixture sets give each type a full example, a sparse one with only the
// required keys, and one with the nullable values null where those differ.
type shape struct {
	kinds    map[string]bool
	keys     map[string]*shape
	required map[string]bool
	objects  int
	elem     *shape
}

func kindOf(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "bool"
	case float64, json.Number:
		return "number"
	case string:
		return "string"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	}
	return fmt.Sprintf("%T", v)
}

func (s *shape) add(v any) {
	if s.kinds == nil {
		s.kinds = map[string]bool{}
	}
	s.kinds[kindOf(v)] = true
	switch v := v.(type) {
	case map[string]any:
		if s.keys == nil {
			s.keys = map[string]*shape{}
		}
		if s.objects == 0 {
			s.required = map[string]bool{}
			for k := range v {
				s.required[k] = true
			}
		} else {
			for k := range s.required {
				if _, ok := v[k]; !ok {
					delete(s.required, k)
				}
			}
		}
		s.objects++
		for k, e := range v {
			if s.keys[k] == nil {
				s.keys[k] = &shape{}
			}
			s.keys[k].add(e)
		}
	case []any:
		if s.elem == nil {
			s.elem = &shape{}
		}
		for _, e := range v {
			s.elem.add(e)
		}
	}
}

// shapeOf builds the shape of the named fixtures.
func shapeOf(t *testing.T, names ...string) *shape {
	t.Helper()
	s := &shape{}
	for _, n := range names {
		var v any
		if err := json.Unmarshal(fixture(t, n), &v); err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		s.add(v)
	}
	return s
}

// check lists how v departs from s: a kind no fixture had, a key no
// fixture had, a key every fixture had missing.
func (s *shape) check(v any, path string) []string {
	if !s.kinds[kindOf(v)] {
		kinds := slices.Sorted(maps.Keys(s.kinds))
		return []string{fmt.Sprintf("%s: %s, want %s", path, kindOf(v), strings.Join(kinds, "|"))}
	}
	var bad []string
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			ks := s.keys[k]
			if ks == nil {
				bad = append(bad, fmt.Sprintf("%s.%s: not in the SDK's type", path, k))
				continue
			}
			bad = append(bad, ks.check(e, path+"."+k)...)
		}
		for k := range s.required {
			if _, ok := v[k]; !ok {
				bad = append(bad, fmt.Sprintf("%s.%s: required by the SDK's type, missing", path, k))
			}
		}
	case []any:
		for i, e := range v {
			if s.elem == nil {
				bad = append(bad, fmt.Sprintf("%s[%d]: no element shape", path, i))
				break
			}
			bad = append(bad, s.elem.check(e, fmt.Sprintf("%s[%d]", path, i))...)
		}
	}
	sort.Strings(bad)
	return bad
}

// conforms fails t unless body has the shape of the fixtures.
func conforms(t *testing.T, what string, body []byte, fixtures ...string) {
	t.Helper()
	var v any
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatalf("%s: not JSON: %v: %s", what, err, body)
	}
	if bad := shapeOf(t, fixtures...).check(v, "$"); len(bad) > 0 {
		t.Errorf("%s does not match %v:\n  %s\nbody: %s", what, fixtures, strings.Join(bad, "\n  "), body)
	}
}

func TestShapeCheckerCatchesDepartures(t *testing.T) {
	s := shapeOf(t, "MetaInformation.full.json", "MetaInformation.sparse.json", "MetaInformation.nulls.json")
	for body, want := range map[string]string{
		`{"api":{"latest_version":"x","name":"y"},"extra":1}`:                                   "$.extra: not in the SDK's type",
		`{"api":{"latest_version":"x"}}`:                                                        "$.api.name: required by the SDK's type, missing",
		`{"api":{"latest_version":"x","name":"y"},"auth":{"scopes":[],"team":1,"version":"v"}}`: "$.auth.team: number, want null|string",
		`{"data":{"api":{"latest_version":"x","name":"y"}}}`:                                    "$.api: required by the SDK's type, missing",
	} {
		var v any
		if err := json.Unmarshal([]byte(body), &v); err != nil {
			t.Fatal(err)
		}
		if bad := s.check(v, "$"); !slices.Contains(bad, want) {
			t.Errorf("%s: got %v, want %q", body, bad, want)
		}
	}
	var ok any
	_ = json.Unmarshal(fixture(t, "MetaInformation.nulls.json"), &ok)
	if bad := s.check(ok, "$"); len(bad) > 0 {
		t.Errorf("a fixture departs from its own shape: %v", bad)
	}
}
