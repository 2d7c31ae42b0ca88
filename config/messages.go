package config

import (
	"fmt"
	"reflect"
	"sort"
	"strings"

	"github.com/go-playground/validator/v10"
)

// fieldMessage turns a validation failure into an operator's message: the
// variable, its value (unless secret), the rule it broke and what it
// accepts. Secret values, and URLs that may carry credentials, are never
// shown.
func fieldMessage(c Config, fe validator.FieldError) error {
	field, _ := reflect.TypeOf(c).FieldByName(fieldName(fe.StructNamespace()))
	name := field.Tag.Get("env")
	if fl := field.Tag.Get("flag"); fl != "" {
		name += " (--" + fl + ")"
	}
	rule := describeRule(c, field, fe)
	shown := fmt.Sprint(fe.Value())
	hidden := field.Type == reflect.TypeOf(Secret("")) ||
		strings.Contains(field.Tag.Get("validate"), "http_url") && strings.ContainsAny(shown, "@?#")
	if field.Type.Kind() == reflect.Slice {
		rule = "each entry " + rule
	}
	if hidden {
		return fmt.Errorf("config: %s is invalid: %s; its value is not shown", name, rule)
	}
	return fmt.Errorf("config: %s=%q is invalid: %s", name, shown, rule)
}

// describeRule says what the failed tag requires, with the accepted values.
func describeRule(c Config, field reflect.StructField, fe validator.FieldError) string {
	tags := tagsOf(field.Tag.Get("validate"))
	switch fe.Tag() {
	case "oneof":
		return "must be one of: " + strings.ReplaceAll(fe.Param(), " ", ", ")
	case "min", "max":
		return fmt.Sprintf("must be %s %s (accepted: %s)", map[string]string{"min": "at least", "max": "at most"}[fe.Tag()],
			withUnit(fe.Param(), field.Type), acceptedRange(tags, field.Type))
	case "required":
		return "must be set"
	case "printascii":
		return "must be printable ASCII (' ' to '~', no control characters)"
	case "principal":
		return "must be 1 to 64 characters from A-Z a-z 0-9 _ . @ -"
	case "listen_addr":
		return "must be host:port with a port from 0 to 65535 and an IP address, DNS name or nothing as host (e.g. 127.0.0.1:8080 or :8080)"
	case "filepath":
		return "must be the path of a file (not a directory)"
	case "http_url":
		return "must be an absolute http:// or https:// URL"
	case "eq=off|listen_addr":
		return "must be off, or host:port with a port from 0 to 65535 and an IP address, DNS name or nothing as host (e.g. 127.0.0.1:8081)"
	case "hostname_rfc1123|ip":
		return "must be a DNS host name or an IP address"
	case "hostname_rfc1123":
		return "must be a DNS name (lower-case letters, digits, '-' and '.')"
	case "cidr":
		return "must be an address block such as 10.0.0.0/8"
	case "toolset":
		return "must be one of: " + strings.Join(toolsetNames(), ", ")
	case "model_name":
		return "must be a model name: 1 to 64 characters from A-Z a-z 0-9 . _ : @ -, starting with a letter or digit"
	case "postgres_url":
		return "must be a postgres:// or postgresql:// URL with a host"
	case "json":
		return "must be a JSON document"
	case "excludesall":
		return fmt.Sprintf("must not contain any of %q", fe.Param())
	case "ltefield", "gtefield":
		other, _ := reflect.TypeOf(c).FieldByName(fe.Param())
		cmp := map[string]string{"ltefield": "at most", "gtefield": "at least"}[fe.Tag()]
		return fmt.Sprintf("must be %s %s (now %v)", cmp, other.Tag.Get("env"), reflect.ValueOf(c).FieldByName(fe.Param()).Interface())
	}
	return fmt.Sprintf("breaks rule %q%s", fe.Tag(), param(fe.Param()))
}

// tagsOf maps a validate tag's rules (before any dive) to their parameters.
func tagsOf(tag string) map[string]string {
	out := map[string]string{}
	for _, r := range strings.Split(tag, ",") {
		if r == "dive" {
			break
		}
		if r == "" {
			continue
		}
		k, v, _ := strings.Cut(r, "=")
		out[k] = v
	}
	return out
}

func acceptedRange(tags map[string]string, t reflect.Type) string {
	lo, hasLo := tags["min"]
	hi, hasHi := tags["max"]
	var s string
	switch {
	case hasLo && hasHi:
		s = lo + " to " + withUnit(hi, t)
	case hasLo:
		s = withUnit(lo, t) + " or more"
	default:
		s = "up to " + withUnit(hi, t)
	}
	if _, ok := tags["omitempty"]; ok {
		s = "unset, or " + s
	}
	return s
}

// withUnit adds "characters" for a length bound on a string.
func withUnit(n string, t reflect.Type) string {
	if t.Kind() == reflect.String {
		return n + " characters"
	}
	return n
}

// toolsetNames is "all" and then every known toolset, sorted.
func toolsetNames() []string {
	var names []string
	for n := range KnownToolsets {
		if n != "all" {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return append([]string{"all"}, names...)
}
