package tools

import (
	"encoding/base64"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/microcosm-cc/bluemonday"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// Rich outputs of a run (a notebook cell's result and displays, matplotlib
// figures) in run_code's result: images inline, HTML as text/html resource
// content, and a line per output in the structured result.
const (
	// DisplayScheme names a rich output inside the one result that carries
	// it; such a URI is not readable with resources/read.
	DisplayScheme    = "sandbox-display://"
	maxDisplayImages = 8
	maxResultText    = maxStreamBytes // a cell's result, text/plain
	maxDisplayText   = 4 << 10        // other displays' text/plain
	maxHTMLInput     = 256 << 10      // larger HTML is not even parsed
	maxHTMLOutput    = 64 << 10       // one sanitized HTML value
	maxHTMLTotal     = 128 << 10
)

// DisplayRef is one rich output in the structured result. The images and
// HTML it lists follow the JSON as content, in the same order.
type DisplayRef struct {
	Kind      string   `json:"kind"` // "result" (a cell's last expression) or "display"
	MIMETypes []string `json:"mime_types"`
	Text      string   `json:"text,omitempty"` // its text/plain
}

// ExceptionRef is a notebook cell's uncaught exception; its traceback ends
// stderr.
type ExceptionRef struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// KernelRef tells what a notebook call did to the session's kernel.
type KernelRef struct {
	ExecutionCount int `json:"execution_count"`
	// New: this call started the kernel, so it began with no state.
	New bool `json:"new"`
	// StateLost: an earlier kernel of the session had run; its variables
	// and imports are gone.
	StateLost bool `json:"state_lost"`
	// Ended: the kernel ended in this call; the next one starts anew.
	Ended bool   `json:"ended"`
	Note  string `json:"note,omitempty"`
}

func kernelRef(k *sandbox.KernelStatus) *KernelRef {
	if k == nil {
		return nil
	}
	ref := &KernelRef{ExecutionCount: k.ExecutionCount, New: k.Started, StateLost: k.StateLost, Ended: k.Ended != ""}
	var notes []string
	if k.StateLost {
		notes = append(notes, fmt.Sprintf("a new kernel was started and the previous kernel's state (variables, imports) is lost: %s", k.Reason))
	}
	if k.Ended != "" {
		notes = append(notes, k.Ended+"; its state is lost and the next notebook call starts a new kernel")
	}
	if len(notes) > 0 {
		ref.Note, _ = cleanOutput([]byte(strings.Join(notes, ". ")), 1<<10)
	}
	return ref
}

// htmlPolicy is what "safe" HTML means here: tables and text formatting
// (what pandas and most _repr_html_ produce) and nothing that runs or
// reaches anything: no scripts, styles, event handlers, forms, frames,
// images, links or URLs of any kind. The broker never renders it; this
// protects a client that does.
var htmlPolicy = func() *bluemonday.Policy {
	p := bluemonday.NewPolicy()
	p.AllowElements("table", "thead", "tbody", "tfoot", "tr", "th", "td", "caption", "colgroup", "col",
		"div", "span", "p", "br", "hr", "b", "i", "em", "strong", "code", "pre", "sub", "sup", "small",
		"ul", "ol", "li", "dl", "dt", "dd", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6")
	p.AllowAttrs("colspan", "rowspan").Matching(bluemonday.Integer).OnElements("th", "td")
	return p
}()

// safeHTML sanitizes one HTML value; ok is false when nothing is left or
// it is too large.
func safeHTML(raw []byte) (string, bool) {
	if len(raw) > maxHTMLInput {
		return "", false
	}
	s, _ := cleanOutput(raw, maxHTMLInput)
	s = strings.TrimSpace(htmlPolicy.Sanitize(s))
	if s == "" || len(s) > maxHTMLOutput {
		return "", false
	}
	return s, true
}

// richOutput fills out's notebook and display fields from res and returns
// the content its displays add.
func richOutput(out *RunCodeResult, sessionID string, res sandbox.ExecResult) []mcp.Content {
	out.Kernel = kernelRef(res.Kernel)
	if x := res.Exception; x != nil {
		out.Exception = &ExceptionRef{}
		out.Exception.Name, _ = cleanOutput([]byte(x.Name), 200)
		out.Exception.Value, _ = cleanOutput([]byte(x.Value), 2000)
	}
	var count int
	if res.Kernel != nil {
		count = res.Kernel.ExecutionCount
	}
	shown, omitted := displaysResult(sessionID, count, res.Displays, &out.Displays, &out.Result)
	out.DisplaysOmitted = omitted + res.DisplaysDropped
	return shown
}

// displaysResult describes a run's displays in refs and returns their
// content blocks; omitted counts what did not fit.
func displaysResult(sessionID string, execCount int, list []sandbox.Display, refs *[]DisplayRef, result *string) (content []mcp.Content, omitted int) {
	images, htmlBytes := 0, 0
	for i, d := range list {
		ref := DisplayRef{Kind: d.Kind, MIMETypes: slices.Sorted(maps.Keys(d.Data))}
		if text, ok := d.Data["text/plain"]; ok {
			max := maxDisplayText
			if d.Kind == sandbox.DisplayResult {
				max = maxResultText
			}
			ref.Text, _ = cleanOutput(text, max)
			if d.Kind == sandbox.DisplayResult {
				*result = ref.Text
			}
		}
		shown := false
		for _, mime := range []string{"image/png", "image/jpeg"} {
			if b, ok := d.Data[mime]; ok && !shown {
				if images < maxDisplayImages && len(b) <= maxInlineImage {
					content = append(content, mcp.NewImageContent(base64.StdEncoding.EncodeToString(b), mime))
					images++
				} else {
					omitted++
				}
				shown = true
			}
		}
		if raw, ok := d.Data["text/html"]; ok {
			if html, ok := safeHTML(raw); ok && htmlBytes+len(html) <= maxHTMLTotal {
				uri := fmt.Sprintf("%s%s/%d/%d.html", DisplayScheme, sessionID, execCount, i+1)
				content = append(content, mcp.NewEmbeddedResource(mcp.TextResourceContents{URI: uri, MIMEType: "text/html", Text: html}))
				htmlBytes += len(html)
			} else {
				omitted++
			}
		}
		*refs = append(*refs, ref)
	}
	return content, omitted
}
