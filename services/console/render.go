package console

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
)

// Pages are full documents (layout.html around the page's "content");
// fragments are htmx swaps and SSE event bodies.
var pageNames = []string{"landing", "login", "playground", "audit", "operator", "error"}

func (c *Console) parseTemplates() error {
	if err := c.hashAssets(); err != nil {
		return err
	}
	funcs := template.FuncMap{
		"inert":   inert,
		"inertN":  inertN,
		"output":  output,
		"size":    humanSize,
		"when":    when,
		"json":    prettyJSON,
		"dataURL": dataURL,
		"asset":   c.assetURL,
		"list":    func(v ...string) []string { return v },
		"dict":    dict,
	}
	base, err := template.New("console").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/fragments.html")
	if err != nil {
		return err
	}
	c.frags = base
	c.pages = map[string]*template.Template{}
	for _, name := range pageNames {
		t, err := template.Must(base.Clone()).ParseFS(templateFS, "templates/"+name+".html")
		if err != nil {
			return fmt.Errorf("console: template %s: %w", name, err)
		}
		c.pages[name] = t
	}
	return nil
}

// page is what every full page gets besides its own data.
type page struct {
	Title string
	User  *userView // nil when not logged in
	CSRF  string
	Data  any
}

type userView struct {
	Principal string
	Tier      string
	Admin     bool
}

// render writes a full page.
func (c *Console) render(w http.ResponseWriter, r *http.Request, status int, name string, data any) {
	p := page{Title: name, Data: data}
	if sess := sessionFrom(r.Context()); sess != nil {
		p.User = &userView{Principal: sess.principal.ID, Tier: string(sess.principal.Tier), Admin: sess.principal.Admin}
		p.CSRF = sess.csrf
	}
	var buf bytes.Buffer
	if err := c.pages[name].ExecuteTemplate(&buf, "layout", p); err != nil {
		c.d.Log.Error().Err(err).Str("page", name).Msg("console_render_failed")
		http.Error(w, "the page could not be rendered", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fragment renders one fragment template to a string.
func (c *Console) fragment(name string, data any) (string, error) {
	var buf bytes.Buffer
	if err := c.frags.ExecuteTemplate(&buf, name, data); err != nil {
		return "", err
	}
	return buf.String(), nil
}

// writeFragment answers an htmx request with a fragment.
func (c *Console) writeFragment(w http.ResponseWriter, status int, name string, data any) {
	s, err := c.fragment(name, data)
	if err != nil {
		c.d.Log.Error().Err(err).Str("fragment", name).Msg("console_render_failed")
		http.Error(w, "the fragment could not be rendered", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(s))
}

// errorPage answers with a message: a fragment for htmx, a page otherwise.
func (c *Console) errorPage(w http.ResponseWriter, r *http.Request, status int, msg string) {
	if r.Header.Get("HX-Request") != "" {
		c.writeFragment(w, status, "error", map[string]any{"Status": status, "Message": msg})
		return
	}
	c.render(w, r, status, "error", map[string]any{"Status": status, "Message": msg})
}

// toolFailed answers a failed tool call: its structured error, with the
// status it implies (403 for PERMISSION_DENIED).
func (c *Console) toolFailed(w http.ResponseWriter, r *http.Request, err error) {
	var te *toolError
	if errors.As(err, &te) {
		if te.RetryAfterS > 0 {
			w.Header().Set("Retry-After", fmt.Sprint(te.RetryAfterS))
		}
		c.errorPage(w, r, te.status(), te.Code+": "+te.Message)
		return
	}
	c.d.Log.Error().Err(err).Str("path", r.URL.Path).Msg("console_call_failed")
	c.errorPage(w, r, http.StatusBadGateway, "The call could not be made.")
}

// Display bounds: a name this long is cut, with the rest counted.
const (
	maxInertRunes = 200
	maxOutputRune = 256 << 10
)

// inert makes attacker-chosen text safe to look at, beyond the HTML
// escaping html/template does anyway: control characters (ANSI escapes
// start with one), bidi overrides and other invisible characters become
// visible ⟨U+XXXX⟩ marks, so a reviewer sees that they were there and
// they cannot reorder or hide what follows; long text is cut.
func inert(s string) string { return inertN(maxInertRunes, s) }

func inertN(max int, s string) string {
	return reveal(s, max, false)
}

// output is program output: newlines and tabs kept, the rest as inert.
func output(s string) string { return reveal(s, maxOutputRune, true) }

func reveal(s string, max int, keepLines bool) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	var b strings.Builder
	n := 0
	for i, r := range s {
		if n >= max {
			fmt.Fprintf(&b, "… (%d more characters)", utf8.RuneCountInString(s[i:]))
			break
		}
		n++
		switch {
		case keepLines && (r == '\n' || r == '\t'):
			b.WriteRune(r)
		case unicode.IsControl(r) || textsafe.Invisible(r):
			fmt.Fprintf(&b, "⟨U+%04X⟩", r)
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// dict builds a map for a sub-template from key, value pairs.
func dict(kv ...any) (map[string]any, error) {
	if len(kv)%2 != 0 {
		return nil, errors.New("dict: odd number of arguments")
	}
	m := make(map[string]any, len(kv)/2)
	for i := 0; i < len(kv); i += 2 {
		k, ok := kv[i].(string)
		if !ok {
			return nil, errors.New("dict: keys must be strings")
		}
		m[k] = kv[i+1]
	}
	return m, nil
}

func humanSize(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func when(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format("2006-01-02 15:04:05.000Z")
}

// prettyJSON indents raw JSON for reading, with <, > and & as
// themselves rather than \u003c…: the template escapes them, and the
// caller reveals invisible characters with output.
func prettyJSON(raw json.RawMessage) string {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return string(raw)
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return string(raw)
	}
	return strings.TrimSuffix(buf.String(), "\n")
}

// imageTypes are the image types shown inline, as data: URLs in <img>
// (where an SVG's scripts never run).
var imageTypes = map[string]bool{"image/png": true, "image/jpeg": true, "image/gif": true, "image/webp": true, "image/svg+xml": true}

// dataURL is an inline image's src. Only the image types above and valid
// base64 pass; html/template would refuse any data: URL otherwise.
func dataURL(mime, b64 string) template.URL {
	if !imageTypes[mime] {
		return ""
	}
	if _, err := base64.StdEncoding.DecodeString(b64); err != nil {
		return ""
	}
	return template.URL("data:" + mime + ";base64," + b64)
}
