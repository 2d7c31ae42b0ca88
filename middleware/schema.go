package middleware

import (
	"encoding/json"
	"reflect"
	"slices"
	"strconv"
	"strings"
)

// schemaFor derives the published JSON schema from the same tags that the
// validator enforces, so the two cannot drift apart.
// extra adds rules to top-level fields (see ArgSpec.WithRules).
func schemaFor(t reflect.Type, extra ...Rule) json.RawMessage {
	s := objectSchema(t)
	props := s["properties"].(map[string]any)
	ft := jsonFields(t)
	for _, r := range extra {
		rules := strings.Split(r.Tag, ",")
		applyRules(props[r.Field].(map[string]any), ft[r.Field], rules)
		if slices.Contains(rules, "required") {
			req, _ := s["required"].([]string)
			s["required"] = append(req, r.Field)
		}
	}
	b, err := json.Marshal(s)
	if err != nil {
		panic("middleware: schema for " + t.String() + ": " + err.Error())
	}
	return b
}

func objectSchema(t reflect.Type) map[string]any {
	props := map[string]any{}
	required := []string{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if isEmbedded(f) {
			inner := objectSchema(f.Type)
			for k, v := range inner["properties"].(map[string]any) {
				props[k] = v
			}
			if r, ok := inner["required"].([]string); ok {
				required = append(required, r...)
			}
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" || !f.IsExported() {
			continue
		}
		rules := strings.Split(f.Tag.Get("validate"), ",")
		p := typeSchema(f.Type)
		if d := f.Tag.Get("desc"); d != "" {
			p["description"] = d
		}
		applyRules(p, f.Type, rules)
		props[name] = p
		// Rules after "dive" are about the items, not the field itself.
		for _, r := range rules {
			if r == "dive" {
				break
			}
			if r == "required" {
				required = append(required, name)
			}
		}
	}
	s := map[string]any{"type": "object", "properties": props, "additionalProperties": false}
	if len(required) > 0 {
		s["required"] = required
	}
	return s
}

func typeSchema(t reflect.Type) map[string]any {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if isSelfDecoder(t) {
		return reflect.New(t).Interface().(SelfDecoder).JSONSchema()
	}
	switch t.Kind() {
	case reflect.String:
		return map[string]any{"type": "string"}
	case reflect.Bool:
		return map[string]any{"type": "boolean"}
	case reflect.Int, reflect.Int32, reflect.Int64:
		return map[string]any{"type": "integer"}
	case reflect.Float32, reflect.Float64:
		return map[string]any{"type": "number"}
	case reflect.Slice:
		return map[string]any{"type": "array", "items": typeSchema(t.Elem())}
	case reflect.Map:
		return map[string]any{"type": "object", "additionalProperties": typeSchema(t.Elem())}
	case reflect.Struct:
		return objectSchema(t)
	}
	panic("middleware: no schema for " + t.String())
}

// applyRules maps validator rules to schema keywords. Rules after "dive"
// apply to collection items.
func applyRules(p map[string]any, t reflect.Type, rules []string) {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	defer requireNonEmpty(p, t, rules)
	for i, r := range rules {
		name, arg, _ := strings.Cut(r, "=")
		switch name {
		case "dive":
			if items, ok := p["items"].(map[string]any); ok {
				applyRules(items, t.Elem(), rules[i+1:])
			} else if ap, ok := p["additionalProperties"].(map[string]any); ok {
				applyRules(ap, t.Elem(), rules[i+1:])
			}
			return
		case "oneof":
			vals := []any{}
			for _, v := range strings.Fields(arg) {
				vals = append(vals, v)
			}
			p["enum"] = vals
		case "min", "max", "gte", "lte":
			n, err := strconv.Atoi(arg)
			if err != nil {
				continue
			}
			lower := name == "min" || name == "gte"
			switch t.Kind() {
			case reflect.String:
				p[pick(lower, "minLength", "maxLength")] = n
			case reflect.Slice:
				p[pick(lower, "minItems", "maxItems")] = n
			case reflect.Map:
				p[pick(lower, "minProperties", "maxProperties")] = n
			default:
				p[pick(lower, "minimum", "maximum")] = n
			}
		default:
			if re, ok := patterns[name]; ok {
				p["pattern"] = re.String()
			}
		}
	}
}

// requireNonEmpty: the validator's "required" refuses an empty string,
// which the schema must say unless a pattern or enum already does.
func requireNonEmpty(p map[string]any, t reflect.Type, rules []string) {
	if i := slices.Index(rules, "dive"); i >= 0 {
		rules = rules[:i]
	}
	_, hasMin := p["minLength"]
	_, hasPattern := p["pattern"]
	_, hasEnum := p["enum"]
	if t.Kind() == reflect.String && slices.Contains(rules, "required") && !hasMin && !hasPattern && !hasEnum {
		p["minLength"] = 1
	}
}

func pick(cond bool, a, b string) string {
	if cond {
		return a
	}
	return b
}
