package tools

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

func TestFileURIRoundTrip(t *testing.T) {
	for _, c := range []struct{ id, path, uri string }{
		{"sess_0123456789ab", "chart.png", "sandbox://sess_0123456789ab/chart.png"},
		{"A-b_9", "out/a b/café.txt", "sandbox://A-b_9/out/a%20b/caf%C3%A9.txt"},
		{"s", "100%.txt", "sandbox://s/100%25.txt"},
		{"s", "%2e%2e", "sandbox://s/%252e%252e"}, // a literal name, not a traversal
		{"s", "a+b=c@d:e$f&g.txt", "sandbox://s/a+b=c@d:e$f&g.txt"},
		{"s", "q?.txt", "sandbox://s/q%3F.txt"},
	} {
		uri, err := FileURI(c.id, c.path)
		if err != nil || uri != c.uri {
			t.Errorf("FileURI(%q, %q) = %q, %v; want %q", c.id, c.path, uri, err, c.uri)
			continue
		}
		id, rel, err := ParseFileURI(uri)
		if err != nil || id != c.id || rel != c.path {
			t.Errorf("ParseFileURI(%q) = %q, %q, %v", uri, id, rel, err)
		}
		// The template mcp-go matches must accept every URI FileURI makes,
		// or the read would never reach the handler.
		if !mcp.NewResourceTemplate(FileURITemplate, "x").URITemplate.Regexp().MatchString(uri) {
			t.Errorf("template %s does not match %q", FileURITemplate, uri)
		}
	}
	for _, c := range []struct{ id, path string }{{"", "x"}, {"a/b", "x"}, {"s", "../x"}, {"s", "/etc/passwd"}, {"s", ""}} {
		if _, err := FileURI(c.id, c.path); err == nil {
			t.Errorf("FileURI(%q, %q) accepted", c.id, c.path)
		}
	}
}

func TestParseFileURIRefusesHostileURIs(t *testing.T) {
	for _, uri := range []string{
		"",
		"sandbox://",
		"sandbox://s",
		"sandbox://s/",
		"SANDBOX://s/x",
		"file:///etc/passwd",
		"https://evil.example/x",
		"sandbox:s/x",
		"sandbox:///etc/passwd",        // no session: an absolute path
		"sandbox://s//etc/passwd",      // absolute path after the session
		"sandbox://s/../x",             // traversal
		"sandbox://s/a/../../x",        //
		"sandbox://s/%2e%2e/x",         // encoded traversal
		"sandbox://s/%2E%2E/x",         //
		"sandbox://s/.%2e/x",           //
		"sandbox://s/a%2F..%2F..%2Fx",  // encoded separators
		"sandbox://s/a%2fb",            //
		"sandbox://s/./x",              //
		"sandbox://s/a//b",             //
		"sandbox://s/x/",               //
		"sandbox://s/x%00.txt",         // NUL
		"sandbox://s/x\x00.txt",        //
		"sandbox://s/x%0a.txt",         // other controls
		"sandbox://s/a%5Cb",            // backslash
		"sandbox://s/a\\b",             //
		"sandbox://s/%E2%80%AEgnp.exe", // bidi override
		"sandbox://s/caf%c3%a9.txt",    // lower-case escape: not canonical
		"sandbox://s/%61.txt",          // needless escape
		"sandbox://s/a b.txt",          // unescaped space
		"sandbox://s/%zz",              // bad escape
		"sandbox://s/%",                //
		"sandbox://s/%ff.txt",          // invalid UTF-8
		"sandbox://s/x?y=1",            // query
		"sandbox://s/x#frag",           // fragment
		"sandbox://s%2Fother/x",        // escaped session
		"sandbox://../x",               // session "..": not an ID
		"sandbox://s:80/x",             //
		"sandbox://user@s/x",           //
		"sandbox://" + strings.Repeat("a", 65) + "/x",
		"sandbox://s/" + strings.Repeat("a/", workspace.MaxPathDepth) + "x",
		"sandbox://s/" + strings.Repeat("%C3%A9", 400),
	} {
		if id, rel, err := ParseFileURI(uri); err == nil {
			t.Errorf("ParseFileURI(%q) = %q, %q; want an error", uri, id, rel)
		} else if brokererr.As(err) == nil {
			t.Errorf("ParseFileURI(%q): untyped error %v", uri, err)
		}
	}
}

// FuzzParseFileURI: whatever ParseFileURI accepts names a valid session ID
// and a path the workspace validator accepts, and is exactly the URI
// FileURI makes for them, so no two spellings reach the same file.
func FuzzParseFileURI(f *testing.F) {
	for _, s := range []string{
		"sandbox://sess_0123456789ab/chart.png", "sandbox://s/out/a%20b/caf%C3%A9.txt", "sandbox://s/100%25.txt",
		"sandbox://s/%2e%2e/x", "sandbox://s//etc/passwd", "sandbox:///etc/passwd", "sandbox://s/x%00",
		"sandbox://s/a%2Fb", "sandbox://s/%252e%252e", "sandbox://s/x?y", "sandbox://other/../s/x",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, uri string) {
		id, rel, err := ParseFileURI(uri)
		if err != nil {
			if brokererr.As(err) == nil {
				t.Fatalf("untyped error for %q: %v", uri, err)
			}
			return
		}
		if !sessions.IDPattern.MatchString(id) {
			t.Fatalf("%q: session %q", uri, id)
		}
		if _, err := workspace.ValidatePath(rel); err != nil {
			t.Fatalf("%q: path %q: %v", uri, rel, err)
		}
		if strings.HasPrefix(rel, "/") || strings.Contains("/"+rel+"/", "/../") || strings.ContainsRune(rel, 0) || !utf8.ValidString(rel) {
			t.Fatalf("%q: unsafe path %q", uri, rel)
		}
		back, err := FileURI(id, rel)
		if err != nil || back != uri {
			t.Fatalf("%q is not canonical: FileURI gives %q, %v", uri, back, err)
		}
	})
}

func TestResourceContentsTextOrBlob(t *testing.T) {
	png := []byte("\x89PNG\r\n\x1a\n\x00\x00")
	for _, c := range []struct {
		name, mime string
		data       []byte
		text       bool
	}{
		{"plain", "text/plain; charset=utf-8", []byte("hello\n"), true},
		{"crlf and tabs", "text/csv; charset=utf-8", []byte("a,b\r\n1,\t2\r\n"), true},
		{"json", "application/json", []byte(`{"a":"é"}`), true},
		{"png", "image/png", png, false},
		{"pdf", "application/pdf", []byte("%PDF-1.4\n"), false},
		{"escape codes", "text/plain; charset=utf-8", []byte("\x1b[31mred"), false},
		{"nul", "text/plain; charset=utf-8", []byte("a\x00b"), false},
		{"invalid utf-8", "text/plain; charset=utf-8", []byte("a\xffb"), false},
		{"bidi override", "text/plain; charset=utf-8", []byte("a\u202eb"), false},
		{"c1 control", "text/plain; charset=utf-8", []byte("a\u0085b"), false},
	} {
		rc := resourceContents("sandbox://s/x", c.mime, c.data)
		switch v := rc.(type) {
		case mcp.TextResourceContents:
			if !c.text || v.Text != string(c.data) || v.MIMEType != c.mime || v.URI != "sandbox://s/x" {
				t.Errorf("%s: text %+v", c.name, v)
			}
		case mcp.BlobResourceContents:
			got, err := base64.StdEncoding.DecodeString(v.Blob)
			if c.text || err != nil || string(got) != string(c.data) || v.MIMEType != c.mime {
				t.Errorf("%s: blob %+v", c.name, v)
			}
		default:
			t.Errorf("%s: %T", c.name, rc)
		}
	}
}

// TestResourceHandlerPassesRefusals: a refused read reaches the client as
// the chain's sanitised code and message, never as a success.
func TestResourceHandlerPassesRefusals(t *testing.T) {
	r := FileResources(nil)
	h := r.Handler(func(ctx context.Context, req mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		if req.Params.Name != ResourceRead {
			t.Errorf("chain called with %q", req.Params.Name)
		}
		return &mcp.CallToolResult{IsError: true, Content: []mcp.Content{
			mcp.NewTextContent(`{"error":"SANDBOX_NOT_FOUND","message":"no session \"x\"","retryable":false}`)}}, nil
	})
	_, err := h(context.Background(), mcp.ReadResourceRequest{Params: mcp.ReadResourceParams{URI: "sandbox://x/y"}})
	if err == nil || err.Error() != `SANDBOX_NOT_FOUND: no session "x"` {
		t.Fatalf("refusal: %v", err)
	}
	h = r.Handler(func(context.Context, mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		return &mcp.CallToolResult{IsError: true}, nil
	})
	if _, err := h(context.Background(), mcp.ReadResourceRequest{}); err == nil || !strings.HasPrefix(err.Error(), "INTERNAL_ERROR") {
		t.Fatalf("bare error result: %v", err)
	}
}

func TestGroupResourcesOncePerTemplate(t *testing.T) {
	g := DefaultGroup(Deps{})
	for _, c := range []struct {
		sets []string
		want int
	}{{[]string{"all"}, 1}, {[]string{"sandbox"}, 1}, {[]string{"files"}, 1}, {[]string{"sandbox", "files"}, 1}, {[]string{"account"}, 0}} {
		rs := g.Resources(c.sets)
		if len(rs) != c.want {
			t.Errorf("Resources(%v) = %d templates, want %d", c.sets, len(rs), c.want)
		}
		for _, r := range rs {
			if r.Template.URITemplate.Raw() != FileURITemplate || r.Read.Tool.Name != ResourceRead || !r.Read.ReadOnly() {
				t.Errorf("resource %+v", r.Template)
			}
		}
	}
}
