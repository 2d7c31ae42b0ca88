package middleware

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
)

// How arguments reach the audit log. Numbers and booleans are recorded as
// they are; every other field must say, in its `audit` tag, what is kept,
// and Args panics on one that does not, so a new tool can neither drop a
// security-relevant argument nor log a secret by accident:
//
//	audit:"clear"   the value: strings up to maxClearBytes, structs field
//	                by field (their fields tagged in turn), anything else,
//	                or a type with its own MarshalJSON, as JSON up to
//	                maxClearJSON (beyond that, as digest)
//	audit:"keys"    a map's keys (environment names, file paths) with the
//	                digest, never its values
//	audit:"digest"  size and a SHA-256 prefix only: code, file contents,
//	                stdin, messages
//
// The summary passes through the redactor before it is written.
const (
	auditClear  = "clear"
	auditKeys   = "keys"
	auditDigest = "digest"
)

// Caps on what one argument adds to an audit row.
const (
	maxClearBytes = 4096     // a clear string (paths, URIs)
	maxClearJSON  = 16 << 10 // a clear value in JSON
	maxKeys       = 100      // keys listed of a map
	maxKeyBytes   = 1024     // one listed key
)

var jsonMarshalerType = reflect.TypeFor[json.Marshaler]()

// isScalar reports kinds that are recorded as they are.
func isScalar(k reflect.Kind) bool {
	switch k {
	case reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
		return true
	}
	return false
}

// recursesInto reports a clear struct that is summarised field by field.
func recursesInto(t reflect.Type) bool {
	return t.Kind() == reflect.Struct && !t.Implements(jsonMarshalerType) && !reflect.PointerTo(t).Implements(jsonMarshalerType)
}

// auditedField is one argument field as the summary sees it.
type auditedField struct {
	name string
	tag  string
	typ  reflect.Type // pointers removed
	idx  int
}

// auditedFields lists t's own argument fields; callers walk embedded
// structs (isEmbedded) themselves.
func auditedFields(t reflect.Type) []auditedField {
	var out []auditedField
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if isEmbedded(f) || name == "" || name == "-" || !f.IsExported() {
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		out = append(out, auditedField{name: name, tag: f.Tag.Get("audit"), typ: ft, idx: i})
	}
	return out
}

// checkAuditTags returns an error naming the first field of t whose audit
// tag is missing or does not fit its type.
func checkAuditTags(t reflect.Type) error {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		switch {
		case isEmbedded(f):
			if err := checkAuditTags(f.Type); err != nil {
				return err
			}
		case f.Anonymous && !f.IsExported() && f.Tag.Get("json") == "":
			return fmt.Errorf("%s embeds unexported %s: the audit summary cannot read its fields; export it", t, f.Type)
		}
	}
	for _, f := range auditedFields(t) {
		where := t.String() + "." + f.name
		switch {
		case isScalar(f.typ.Kind()):
			if f.tag != "" && f.tag != auditClear {
				return fmt.Errorf("%s: numbers and booleans are recorded as they are; drop audit:%q", where, f.tag)
			}
		case f.tag == auditClear && recursesInto(f.typ):
			if err := checkAuditTags(f.typ); err != nil {
				return err
			}
		case f.tag == auditClear, f.tag == auditDigest:
		case f.tag == auditKeys:
			if f.typ.Kind() != reflect.Map || f.typ.Key().Kind() != reflect.String {
				return fmt.Errorf("%s: audit:\"keys\" needs a map with string keys", where)
			}
		default:
			return fmt.Errorf("%s: say what the audit log keeps of it: audit:\"clear\", \"keys\" or \"digest\" (got %q)", where, f.tag)
		}
	}
	return nil
}

// summarize turns validated arguments (a pointer to the argument struct)
// into audit parameters, by the fields' audit tags. Zero fields are left
// out.
func summarize(v any) map[string]any {
	return summarizeStruct(reflect.Indirect(reflect.ValueOf(v)))
}

func summarizeStruct(rv reflect.Value) map[string]any {
	out := map[string]any{}
	for i := 0; i < rv.NumField(); i++ {
		if isEmbedded(rv.Type().Field(i)) {
			maps.Copy(out, summarizeStruct(rv.Field(i)))
		}
	}
	for _, f := range auditedFields(rv.Type()) {
		fv := rv.Field(f.idx)
		if fv.IsZero() {
			continue
		}
		for fv.Kind() == reflect.Pointer {
			fv = fv.Elem()
		}
		out[f.name] = summarizeValue(fv, f.tag)
	}
	return out
}

func summarizeValue(fv reflect.Value, tag string) any {
	if isScalar(fv.Kind()) {
		return fv.Interface()
	}
	switch tag {
	case auditClear:
		if fv.Kind() == reflect.String {
			return redact.Truncate(fv.String(), maxClearBytes)
		}
		if recursesInto(fv.Type()) {
			return summarizeStruct(fv)
		}
		if b, err := json.Marshal(fv.Interface()); err == nil && len(b) <= maxClearJSON {
			return json.RawMessage(b)
		}
	case auditKeys:
		d := digestValue(fv)
		keys := make([]string, 0, fv.Len())
		for _, k := range fv.MapKeys() {
			keys = append(keys, redact.Truncate(k.String(), maxKeyBytes))
		}
		slices.Sort(keys)
		d["keys"] = keys[:min(len(keys), maxKeys)]
		return d
	}
	return digestValue(fv)
}

// digestValue is a value's size and SHA-256 prefix (strings by their bytes,
// anything else by its JSON), with the item count of a collection.
func digestValue(fv reflect.Value) map[string]any {
	if fv.Kind() == reflect.String {
		return digest([]byte(fv.String()))
	}
	b, _ := json.Marshal(fv.Interface())
	d := digest(b)
	if fv.Kind() == reflect.Map || fv.Kind() == reflect.Slice {
		d["count"] = fv.Len()
	}
	return d
}

func digest(b []byte) map[string]any {
	h := sha256.Sum256(b)
	return map[string]any{"bytes": len(b), "sha256": hex.EncodeToString(h[:8])}
}

// CheckAudit fills every argument field of the spec's type, summarises the
// value as the chain does, and reports a field the summary lost, or a
// digest field's value or a keys field's map value that reached it. Tests
// run it over every tool.
func (s ArgSpec) CheckAudit() error {
	v := reflect.New(s.typ)
	var hidden []string
	fill(v.Elem(), s.typ.Name(), false, false, &hidden)
	sum := s.summary(v.Interface())
	if err := covered(s.typ, sum); err != nil {
		return err
	}
	b, err := json.Marshal(sum)
	if err != nil {
		return err
	}
	for _, h := range hidden {
		if strings.Contains(string(b), h) {
			return fmt.Errorf("%s reaches the audit log: %s", h, b)
		}
	}
	return nil
}

// fill sets every field below v to a non-zero value; strings are their own
// path, so a leak names its field. Strings under a digest (and a keys map's
// values) are added to hidden.
func fill(v reflect.Value, path string, hideKeys, hideValues bool, hidden *[]string) {
	switch v.Kind() {
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fill(v.Elem(), path, hideKeys, hideValues, hidden)
	case reflect.String:
		v.SetString("probe:" + path)
		if hideValues {
			*hidden = append(*hidden, "probe:"+path)
		}
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(7)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(7)
	case reflect.Float32, reflect.Float64:
		v.SetFloat(7.5)
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fill(v.Index(0), path+"[0]", hideKeys, hideValues, hidden)
	case reflect.Map:
		k := reflect.New(v.Type().Key()).Elem()
		fill(k, path+".key", hideKeys, hideKeys, hidden)
		e := reflect.New(v.Type().Elem()).Elem()
		fill(e, path+".value", hideKeys, hideValues, hidden)
		v.Set(reflect.MakeMap(v.Type()))
		v.SetMapIndex(k, e)
	case reflect.Struct:
		for i := 0; i < v.NumField(); i++ {
			if f := v.Type().Field(i); f.IsExported() {
				tag := f.Tag.Get("audit")
				hk, hv := hideKeys || tag == auditDigest, hideValues || tag == auditDigest || tag == auditKeys
				fill(v.Field(i), path+"."+f.Name, hk, hv, hidden)
			}
		}
	}
}

// covered reports the first field of t missing from its summary.
func covered(t reflect.Type, sum map[string]any) error {
	for i := 0; i < t.NumField(); i++ {
		if f := t.Field(i); isEmbedded(f) {
			if err := covered(f.Type, sum); err != nil {
				return err
			}
		}
	}
	for _, f := range auditedFields(t) {
		got, ok := sum[f.name]
		if !ok {
			return fmt.Errorf("%s.%s is missing from the audit summary", t, f.name)
		}
		if f.tag == auditClear && recursesInto(f.typ) {
			m, ok := got.(map[string]any)
			if !ok {
				return fmt.Errorf("%s.%s is summarised as %T, want its fields", t, f.name, got)
			}
			if err := covered(f.typ, m); err != nil {
				return err
			}
		}
	}
	return nil
}
