package middleware

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/go-playground/validator/v10"
	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// DefaultMaxArgBytes caps a tool's raw arguments unless the tool says more.
const DefaultMaxArgBytes = 64 << 10

// ArgSpec says how one tool's arguments are decoded, validated and audited.
type ArgSpec struct {
	MaxBytes int
	// Toolset is the toolset the tool was enabled through; audit rows
	// record it.
	Toolset string
	decode  func(raw []byte) (any, error)
	schema  json.RawMessage
	summary func(v any) map[string]any
	typ     reflect.Type
	strict  func(raw []byte) (any, error) // decode without rules
	rules   []Rule
}

// Rule adds validator rules to one top-level argument field, for limits
// known only at start-up (SANDBOX_MAX_TIMEOUT, say). The validator and the
// published schema both apply it, so they cannot disagree.
type Rule struct {
	Field string // the field's JSON name
	Tag   string // validator rules, e.g. "max=600"
}

// Schema is the JSON schema published in tools/list.
func (s ArgSpec) Schema() json.RawMessage { return s.schema }

// Validate decodes and checks raw arguments as the chain does (the size
// cap aside), for tests that hold the schema to the validator.
func (s ArgSpec) Validate(raw []byte) error {
	_, err := s.decode(raw)
	return err
}

// WithRules returns the spec with rules added to fields, in both the
// validator and the schema. A rule naming no field is a programming error.
func (s ArgSpec) WithRules(rules ...Rule) ArgSpec {
	fields := jsonFields(s.typ)
	for _, r := range rules {
		if _, ok := fields[r.Field]; !ok {
			panic("middleware: rule for unknown field " + r.Field + " of " + s.typ.String())
		}
	}
	s.rules = append(append([]Rule{}, s.rules...), rules...)
	s.schema = schemaFor(s.typ, s.rules...)
	strict, rs := s.strict, s.rules
	s.decode = func(raw []byte) (any, error) {
		v, err := strict(raw)
		if err != nil {
			return nil, err
		}
		return v, checkRules(v, rs)
	}
	return s
}

// checkRules applies extra rules to the decoded struct *T.
func checkRules(v any, rules []Rule) error {
	rv := reflect.ValueOf(v).Elem()
	for _, r := range rules {
		fv, ok := fieldByJSONName(rv, r.Field)
		if !ok {
			continue
		}
		if err := validate.Var(fv.Interface(), r.Tag); err != nil {
			var verrs validator.ValidationErrors
			if errors.As(err, &verrs) && len(verrs) > 0 {
				return fieldError(r.Field, verrs[0])
			}
			return brokererr.New(brokererr.InvalidInput, "field %q is invalid", r.Field)
		}
	}
	return nil
}

// fieldByJSONName finds a field by its JSON name, through untagged
// embedded structs as encoding/json does.
func fieldByJSONName(rv reflect.Value, name string) (reflect.Value, bool) {
	rt := rv.Type()
	for i := 0; i < rt.NumField(); i++ {
		f := rt.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if isEmbedded(f) {
			if v, ok := fieldByJSONName(rv.Field(i), name); ok {
				return v, true
			}
			continue
		}
		if tag == name && f.IsExported() {
			return rv.Field(i), true
		}
	}
	return reflect.Value{}, false
}

// isEmbedded reports an untagged embedded struct, whose fields encoding/json
// promotes to the outer object. Argument structs embed exported types only:
// reflection cannot read values through an unexported one.
func isEmbedded(f reflect.StructField) bool {
	return f.Anonymous && f.IsExported() && f.Tag.Get("json") == "" && f.Type.Kind() == reflect.Struct
}

// Args builds the spec for argument struct T. T's fields use `json` names,
// `validate` rules (validator/v10 plus the custom rules below), `desc` for
// the schema description and `audit` for what the audit log keeps of them
// (see summary.go); a field that does not say is a programming error.
func Args[T any](maxBytes int) ArgSpec {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxArgBytes
	}
	var zero T
	if reflect.TypeOf(zero).Kind() != reflect.Struct {
		panic("middleware.Args: T must be a struct")
	}
	if err := checkAuditTags(reflect.TypeOf(zero)); err != nil {
		panic("middleware.Args: " + err.Error())
	}
	strict := func(raw []byte) (any, error) { return decodeStrict[T](raw) }
	return ArgSpec{
		MaxBytes: maxBytes,
		decode:   strict,
		strict:   strict,
		schema:   schemaFor(reflect.TypeOf(zero)),
		summary:  summarize,
		typ:      reflect.TypeOf(zero),
	}
}

type argsKey struct{}

// ArgsFrom returns the validated arguments the Validate middleware stored.
// A handler reached without validation gets ok=false and must refuse.
func ArgsFrom[T any](ctx context.Context) (*T, bool) {
	v, ok := ctx.Value(argsKey{}).(*T)
	return v, ok
}

// SelfDecoder is an argument field type that decodes and checks itself
// strictly (its UnmarshalJSON returns *brokererr.Error) and publishes its
// own schema, e.g. a value that is either a string or an object.
type SelfDecoder interface {
	json.Unmarshaler
	JSONSchema() map[string]any
}

var selfDecoderType = reflect.TypeFor[SelfDecoder]()

func isSelfDecoder(t reflect.Type) bool {
	return t.Implements(selfDecoderType) || reflect.PointerTo(t).Implements(selfDecoderType)
}

// Custom rules: name → pattern. The same pattern is published in the schema.
var patterns = map[string]*regexp.Regexp{
	"session_id": regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`),
	"identifier": regexp.MustCompile(`^[A-Za-z0-9_-]{1,50}$`),
}

var validate = newValidator()

func newValidator() *validator.Validate {
	v := validator.New(validator.WithRequiredStructEnabled())
	v.RegisterTagNameFunc(func(f reflect.StructField) string {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			return ""
		}
		return name
	})
	for name, re := range patterns {
		_ = v.RegisterValidation(name, func(fl validator.FieldLevel) bool {
			return re.MatchString(fl.Field().String())
		})
	}
	// Strings must be valid UTF-8 without NUL: Go's decoder would otherwise
	// turn bad bytes into U+FFFD silently, and NUL truncates C paths.
	_ = v.RegisterValidation("clean", func(fl validator.FieldLevel) bool {
		s := fl.Field().String()
		return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
	})
	return v
}

func decodeStrict[T any](raw []byte) (*T, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		raw = []byte("{}")
	}
	if !utf8.Valid(raw) {
		return nil, brokererr.New(brokererr.InvalidInput, "arguments are not valid UTF-8")
	}
	if raw[0] != '{' {
		return nil, brokererr.New(brokererr.InvalidInput, "arguments must be a JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	dec.UseNumber()
	v := new(T)
	if err := dec.Decode(v); err != nil {
		return nil, decodeError(err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, brokererr.New(brokererr.InvalidInput, "arguments must be a single JSON object")
	}
	// encoding/json matches keys case-insensitively and keeps the last of
	// duplicate keys; the published schema allows neither, and accepting them
	// would let {"path":"a","PATH":"b"} mean one thing to a proxy or log
	// reader and another to the tool.
	if err := checkKeys(json.NewDecoder(bytes.NewReader(raw)), reflect.TypeFor[T]()); err != nil {
		return nil, err
	}
	if err := validate.Struct(v); err != nil {
		return nil, validationError(err)
	}
	return v, nil
}

// checkKeys walks one JSON value, already known to be valid, and refuses
// duplicate object keys and struct keys that are not exactly a field's JSON
// name. t guides the walk; nil means "any value".
func checkKeys(dec *json.Decoder, t reflect.Type) error {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t != nil && isSelfDecoder(t) {
		t = nil // the type checks its own keys
	}
	tok, err := dec.Token()
	if err != nil {
		return decodeError(err)
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil
	}
	switch d {
	case '{':
		var fields map[string]reflect.Type
		if t != nil && t.Kind() == reflect.Struct {
			fields = jsonFields(t)
		}
		seen := map[string]bool{}
		for dec.More() {
			kt, err := dec.Token()
			if err != nil {
				return decodeError(err)
			}
			key, _ := kt.(string)
			if seen[key] {
				return brokererr.New(brokererr.InvalidInput, "duplicate field %q", key)
			}
			seen[key] = true
			var child reflect.Type
			switch {
			case fields != nil:
				ft, ok := fields[key]
				if !ok {
					return brokererr.New(brokererr.InvalidInput, "unknown field %q", key)
				}
				child = ft
			case t != nil && t.Kind() == reflect.Map:
				child = t.Elem()
			}
			if err := checkKeys(dec, child); err != nil {
				return err
			}
		}
	case '[':
		var child reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			child = t.Elem()
		}
		for dec.More() {
			if err := checkKeys(dec, child); err != nil {
				return err
			}
		}
	}
	if _, err := dec.Token(); err != nil { // the closing delimiter
		return decodeError(err)
	}
	return nil
}

// jsonFields maps a struct's exact JSON key names to field types, following
// untagged embedded structs as encoding/json does.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		name, _, _ := strings.Cut(tag, ",")
		if name == "-" && !strings.HasPrefix(tag, "-,") {
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if f.Anonymous && name == "" && ft.Kind() == reflect.Struct {
			for k, v := range jsonFields(ft) {
				if _, ok := out[k]; !ok {
					out[k] = v
				}
			}
			continue
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out[name] = f.Type
	}
	return out
}

func decodeError(err error) error {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		return brokererr.New(brokererr.InvalidInput, "field %q must be %s", te.Field, jsonKind(te.Type))
	case errors.As(err, &se):
		return brokererr.New(brokererr.InvalidInput, "arguments are not valid JSON (offset %d)", se.Offset)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return brokererr.New(brokererr.InvalidInput, "arguments are not valid JSON (unexpected end)")
	case errors.As(err, new(*brokererr.Error)):
		// A field type's own UnmarshalJSON refused the value (SelfDecoder).
		var be *brokererr.Error
		errors.As(err, &be)
		return be
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return brokererr.New(brokererr.InvalidInput, "unknown field %s", strings.TrimPrefix(err.Error(), "json: unknown field "))
	default:
		return brokererr.New(brokererr.InvalidInput, "arguments could not be decoded")
	}
}

func validationError(err error) error {
	var verrs validator.ValidationErrors
	if !errors.As(err, &verrs) || len(verrs) == 0 {
		return brokererr.New(brokererr.InvalidInput, "arguments are invalid")
	}
	fe := verrs[0]
	field := fe.Namespace()
	if i := strings.IndexByte(field, '.'); i >= 0 {
		field = field[i+1:]
	}
	return fieldError(field, fe)
}

// fieldError says which rule field broke, in the model's terms.
func fieldError(field string, fe validator.FieldError) error {
	var why string
	switch fe.Tag() {
	case "required":
		why = "is required"
	case "oneof":
		why = "must be one of: " + strings.ReplaceAll(fe.Param(), " ", ", ")
	case "max", "lte":
		why = "must be at most " + fe.Param() + sizeUnit(fe.Kind())
	case "min", "gte":
		why = "must be at least " + fe.Param() + sizeUnit(fe.Kind())
	case "clean":
		why = "must be valid UTF-8 without NUL characters"
	case "excluded_with":
		why = "cannot be combined with " + fe.Param()
	case "required_without":
		why = "is required unless " + fe.Param() + " is given"
	default:
		if re, ok := patterns[fe.Tag()]; ok {
			why = "must match " + re.String()
		} else {
			why = "fails rule " + fe.Tag()
		}
	}
	return brokererr.New(brokererr.InvalidInput, "field %q %s", field, why)
}

func sizeUnit(k reflect.Kind) string {
	switch k {
	case reflect.String:
		return " characters"
	case reflect.Slice, reflect.Map:
		return " items"
	}
	return ""
}

func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int64, reflect.Int32, reflect.Uint, reflect.Uint64, reflect.Uint32:
		return "an integer"
	case reflect.Float64, reflect.Float32:
		return "a number"
	case reflect.Map, reflect.Struct:
		return "an object"
	case reflect.Slice:
		return "an array"
	}
	return "of another type"
}

// rawArguments returns the call's argument bytes as received.
func rawArguments(req mcp.CallToolRequest) ([]byte, error) {
	if len(req.Params.RawArguments) > 0 {
		return req.Params.RawArguments, nil
	}
	if req.Params.Arguments == nil {
		return nil, nil
	}
	b, err := json.Marshal(req.Params.Arguments)
	if err != nil {
		return nil, fmt.Errorf("re-encode arguments: %w", err)
	}
	return b, nil
}
