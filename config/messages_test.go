package config

import (
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// badValue is one bad setting of a variable and what its error must say
// besides the variable's name.
type badValue struct {
	value string
	want  []string
}

// badValues derives, from a field's validate tag, a value that breaks each
// of its rules, and what the error must then say: the rule and the values
// it accepts. Deriving them from the tags means a new variable is covered
// the day it is added.
func badValues(t *testing.T, c Config, f reflect.StructField) []badValue {
	tags := tagsOf(f.Tag.Get("validate"))
	var out []badValue
	str := f.Type.Kind() == reflect.String || f.Type.Kind() == reflect.Slice
	pad := func(n int) string {
		if _, ok := tags["http_url"]; ok {
			return "https://example.com/" + strings.Repeat("a", max(n-20, 0))
		}
		return strings.Repeat("x", n)
	}
	rangeWords := func() []string {
		var w []string
		for _, k := range []string{"min", "max"} {
			if v, ok := tags[k]; ok {
				w = append(w, v)
			}
		}
		return append(w, "accepted")
	}
	for rule, param := range tags {
		switch rule {
		case "oneof":
			out = append(out, badValue{"not-an-option", append([]string{"must be one of"}, strings.Fields(param)...)})
		case "min":
			n, _ := strconv.Atoi(param)
			v := strconv.Itoa(n - 1)
			if str {
				v = pad(n - 1)
			}
			if n-1 <= 0 && str {
				continue // empty means unset
			}
			out = append(out, badValue{v, append([]string{"at least " + param}, rangeWords()...)})
		case "max":
			n, _ := strconv.Atoi(param)
			v := strconv.Itoa(n + 1)
			if str {
				v = pad(n + 1)
			}
			out = append(out, badValue{v, append([]string{"at most " + param}, rangeWords()...)})
		case "ltefield", "gtefield":
			other, _ := reflect.TypeOf(c).FieldByName(param)
			ov := reflect.ValueOf(c).FieldByName(param).Int()
			v := ov + 1
			if rule == "gtefield" {
				v = ov - 1
			}
			out = append(out, badValue{strconv.FormatInt(v, 10), []string{other.Tag.Get("env"), strconv.FormatInt(ov, 10)}})
		case "principal":
			out = append(out, badValue{"has space", []string{"1 to 64 characters", "A-Z a-z 0-9 _ . @ -"}})
		case "listen_addr":
			out = append(out, badValue{"localhost", []string{"host:port", "0 to 65535"}})
		case "eq":
			if param != "off|listen_addr" {
				t.Errorf("%s: no bad value for rule eq=%s: teach badValues", f.Tag.Get("env"), param)
				continue
			}
			out = append(out, badValue{"localhost", []string{"off", "host:port", "0 to 65535"}})
		case "filepath":
			out = append(out, badValue{"/tmp/", []string{"path of a file"}})
		case "http_url":
			out = append(out, badValue{"not a url", []string{"http:// or https:// URL"}})
		case "printascii":
			out = append(out, badValue{strings.Repeat("x", 20) + "\x01", []string{"printable ASCII"}})
		case "json":
			out = append(out, badValue{"{", []string{"JSON"}})
		case "postgres_url":
			out = append(out, badValue{"mysql://u:pw@db/x", []string{"postgres:// or postgresql:// URL"}})
		case "model_name":
			out = append(out, badValue{"bad model!", []string{"model name", "1 to 64 characters"}})
		case "excludesall":
			out = append(out, badValue{"a" + param + "b", []string{"must not contain"}})
		case "hostname_rfc1123":
			out = append(out, badValue{"bad_name!", []string{"DNS name"}})
		case "cidr":
			out = append(out, badValue{"10.0.0.1", []string{"address block"}})
		case "required", "omitempty":
		default:
			t.Errorf("%s: no bad value for rule %q: teach badValues", f.Tag.Get("env"), rule)
		}
	}
	if dive := strings.SplitN(f.Tag.Get("validate"), "dive,", 2); len(dive) == 2 {
		switch dive[1] {
		case "toolset":
			out = append(out, badValue{"all,nope", append([]string{"each entry", "must be one of"}, toolsetNames()...)})
		case "hostname_rfc1123|ip":
			out = append(out, badValue{"ok.example.com,bad_host!", []string{"each entry", "DNS host name or an IP address"}})
		case "http_url":
			out = append(out, badValue{"not a url", []string{"each entry", "http:// or https:// URL"}})
		case "model_name":
			out = append(out, badValue{"claude-sonnet-4-5,bad model!", []string{"each entry", "model name"}})
		default:
			t.Errorf("%s: no bad value for list rule %q", f.Tag.Get("env"), dive[1])
		}
	}
	switch f.Type.Kind() {
	case reflect.Int, reflect.Int64:
		out = append(out, badValue{"ten", append([]string{"must be an integer"}, rangeWords()...)})
	case reflect.Bool:
		out = append(out, badValue{"maybe", []string{"true or false"}})
	}
	return out
}

// TestEveryVariableErrorSaysRuleAndAcceptedValues sets every variable to
// a value that breaks each of its rules in turn: the error names the
// variable, says the rule and what is accepted, and never shows a secret.
func TestEveryVariableErrorSaysRuleAndAcceptedValues(t *testing.T) {
	for _, n := range []string{"account", "sandbox", "files"} {
		if !KnownToolsets[n] {
			KnownToolsets[n] = true
			t.Cleanup(func() { delete(KnownToolsets, n) })
		}
	}
	c := Defaults()
	typ := reflect.TypeOf(c)
	covered := 0
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		name := f.Tag.Get("env")
		if name == "" {
			continue
		}
		secret := f.Type == reflect.TypeOf(Secret(""))
		bad := badValues(t, c, f)
		if len(bad) == 0 && f.Tag.Get("validate") != "required" {
			t.Errorf("%s: no bad value tried", name)
		}
		for _, b := range bad {
			covered++
			_, err := Load(nil, envOf(map[string]string{name: b.value}))
			if err == nil {
				t.Errorf("%s=%q accepted", name, b.value)
				continue
			}
			msg := err.Error()
			for _, w := range append([]string{name}, b.want...) {
				if !strings.Contains(msg, w) {
					t.Errorf("%s=%q: error %q does not say %q", name, b.value, msg, w)
				}
			}
			if secret && strings.Contains(msg, b.value) {
				t.Errorf("%s: error %q shows the secret", name, msg)
			}
		}
	}
	// Required variables cannot be unset through the environment (empty
	// means default), only in a Config.
	for _, name := range []string{"Root", "OAuthPrincipalClaim"} {
		c := Defaults()
		reflect.ValueOf(&c).Elem().FieldByName(name).SetString("")
		f, _ := typ.FieldByName(name)
		if err := Validate(c); err == nil || !strings.Contains(err.Error(), f.Tag.Get("env")) || !strings.Contains(err.Error(), "must be set") {
			t.Errorf("%s unset: %v", name, err)
		}
	}
	if covered < 100 {
		t.Errorf("only %d bad values tried", covered)
	}
}

// The messages the issue quoted, exactly.
func TestConfigErrorMessages(t *testing.T) {
	KnownToolsets["sandbox"] = true
	t.Cleanup(func() { delete(KnownToolsets, "sandbox") })
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, map[string]string{"SANDBOX_TIMEOUT": "0"},
			`config: SANDBOX_TIMEOUT="0" is invalid: must be at least 1 (accepted: 1 to 3600)`},
		{nil, map[string]string{"FILE_SECRET": "short-secret"},
			`config: FILE_SECRET is invalid: must be at least 32 characters (accepted: unset, or 32 to 512 characters); its value is not shown`},
		{[]string{"--toolsets", "sandbox,sandboxes"}, nil,
			`config: MCP_TOOLSETS (--toolsets)="sandboxes" is invalid: each entry must be one of: all, sandbox`},
		{nil, map[string]string{"SANDBOX_MAX_TIMEOUT": "30"},
			`config: SANDBOX_MAX_TIMEOUT="30" is invalid: must be at least SANDBOX_TIMEOUT (now 60)`},
		{nil, map[string]string{"SANDBOX_POOL_SIZE": "two"},
			`config: SANDBOX_POOL_SIZE="two" is invalid: must be an integer (accepted: 0 to 32)`},
		{[]string{"--nope"}, nil,
			`config: flag provided but not defined: -nope (flags: --transport, --addr, --root, --log-level, --toolsets, --read-only)`},
	} {
		_, err := Load(tc.args, envOf(tc.env))
		if err == nil || err.Error() != tc.want {
			t.Errorf("%v %v:\n got  %v\n want %s", tc.args, tc.env, err, tc.want)
		}
	}
}
