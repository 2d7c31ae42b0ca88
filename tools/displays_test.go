package tools

import (
	"bytes"
	"strings"
	"testing"

	"github.com/mark3labs/mcp-go/mcp"
	"golang.org/x/net/html"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

var onePixelPNG = []byte("\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")

func TestDisplaysResult(t *testing.T) {
	list := []sandbox.Display{
		{Kind: "display", Data: map[string][]byte{"image/png": onePixelPNG, "text/plain": []byte("<Figure>")}},
		{Kind: "result", Data: map[string][]byte{
			"text/plain": []byte("\x1b[1mDataFrame\x1b[0m"),
			"text/html":  []byte(`<div><style>td{color:red}</style><table class="dataframe" onmouseover="x()"><tr><th colspan="2">a</th><td><a href="javascript:x()">1</a><img src="http://example.com/p"></td></tr></table><script>alert(1)</script></div>`),
		}},
		{Kind: "display", Data: map[string][]byte{"text/html": []byte("<script>only()</script>")}},
	}
	var refs []DisplayRef
	var result string
	content, omitted := displaysResult("sess_1", 3, list, &refs, &result)
	if result != "DataFrame" || omitted != 1 || len(refs) != 3 || refs[1].Kind != "result" || strings.Join(refs[1].MIMETypes, ",") != "text/html,text/plain" {
		t.Fatalf("refs %+v result %q omitted %d", refs, result, omitted)
	}
	if len(content) != 2 {
		t.Fatalf("content: %+v", content)
	}
	if img, ok := content[0].(mcp.ImageContent); !ok || img.MIMEType != "image/png" {
		t.Fatalf("image: %+v", content[0])
	}
	er, ok := content[1].(mcp.EmbeddedResource)
	tr, ok2 := er.Resource.(mcp.TextResourceContents)
	if !ok || !ok2 || tr.MIMEType != "text/html" || tr.URI != "sandbox-display://sess_1/3/2.html" ||
		tr.Text != `<div><table><tr><th colspan="2">a</th><td>1</td></tr></table></div>` {
		t.Fatalf("html: %+v", content[1])
	}
}

func TestDisplaysResultCapsImages(t *testing.T) {
	var list []sandbox.Display
	for range maxDisplayImages + 2 {
		list = append(list, sandbox.Display{Kind: "display", Data: map[string][]byte{"image/png": onePixelPNG}})
	}
	list = append(list, sandbox.Display{Kind: "display", Data: map[string][]byte{"image/jpeg": make([]byte, maxInlineImage+1)}})
	var refs []DisplayRef
	var result string
	content, omitted := displaysResult("s", 0, list, &refs, &result)
	if len(content) != maxDisplayImages || omitted != 3 || len(refs) != len(list) {
		t.Fatalf("%d images, %d omitted, %d refs", len(content), omitted, len(refs))
	}
}

// FuzzSafeHTML: whatever HTML a sandbox returns, what the broker passes on
// has no element or attribute outside the allow-list: nothing that runs
// code or fetches anything when a client renders it.
func FuzzSafeHTML(f *testing.F) {
	for _, s := range []string{
		"<table><tr><td>1</td></tr></table>",
		`<img src=x onerror=alert(1)>`,
		`<svg><script>alert(1)</script></svg>`,
		`<a href="javascript:alert(1)">x</a><iframe src="//e"></iframe>`,
		`<td colspan="2" style="background:url(http://e)">`,
		"<scr<script>ipt>alert(1)</script>",
		`<math><mi xlink:href="data:x,<script>alert(4)</script>">`,
	} {
		f.Add([]byte(s))
	}
	allowed := map[string]bool{}
	for _, e := range strings.Fields("table thead tbody tfoot tr th td caption colgroup col div span p br hr b i em strong code pre sub sup small ul ol li dl dt dd blockquote h1 h2 h3 h4 h5 h6") {
		allowed[e] = true
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		s, ok := safeHTML(raw)
		if !ok {
			return
		}
		if len(s) > maxHTMLOutput {
			t.Fatalf("output over the cap: %d", len(s))
		}
		z := html.NewTokenizer(bytes.NewReader([]byte(s)))
		for {
			switch z.Next() {
			case html.ErrorToken:
				return
			case html.StartTagToken, html.EndTagToken, html.SelfClosingTagToken:
				tok := z.Token()
				if !allowed[tok.Data] {
					t.Fatalf("element %q survived in %q", tok.Data, s)
				}
				for _, a := range tok.Attr {
					if a.Key != "colspan" && a.Key != "rowspan" {
						t.Fatalf("attribute %q survived in %q", a.Key, s)
					}
				}
			}
		}
	})
}
