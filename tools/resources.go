package tools

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"strings"
	"unicode/utf8"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Session files as MCP resources. Every file a tool reports has a
// sandbox://{session_id}/{path} URI that its owner reads with
// resources/read on any transport; the signed download link is an extra that
// exists only when the broker knows its public address.
const (
	FileScheme      = "sandbox://"
	FileURITemplate = FileScheme + "{session_id}/{+path}"
	// ResourceRead names resources/read in the chain, the audit log and
	// metrics; it is not a tool and tools/list never shows it.
	ResourceRead = "resources/read"
	// maxURIBytes bounds a sandbox:// URI: the scheme, a session ID and a
	// path of workspace.MaxPathBytes with every byte escaped.
	maxURIBytes = len(FileScheme) + 64 + 1 + 3*workspace.MaxPathBytes
)

// Caps on file content in results.
const (
	maxResourceBytes = maxUploadBytes // resources/read: anything uploadable reads back
	maxEmbedText     = 16 << 10       // one small text file embedded in a tool result
	maxEmbedTotal    = 32 << 10       // all embedded text in one result
)

// FileRef is a file in a result. URI reads it with resources/read; URL is a
// signed download link, present when the broker has a public address.
type FileRef struct {
	Name string `json:"name"`
	Size int64  `json:"size"`
	MIME string `json:"mime"`
	URI  string `json:"uri"`
	URL  string `json:"url,omitempty"`
}

// fileRef is the one way a tool describes a workspace file. A path that no
// URI can name is not offered (ok false); a missing signed link is not an
// error, because the URI always works.
func (e *Engine) fileRef(lease *sessions.Lease, f sandbox.FileInfo) (FileRef, bool) {
	uri, err := FileURI(lease.ID, f.Path)
	if err != nil {
		return FileRef{}, false
	}
	ref := FileRef{Name: f.Path, Size: f.Size, MIME: workspace.DetectMIME(f.Path, nil), URI: uri}
	if e.URLs != nil {
		if u, _, err := e.URLs.URL(lease.WorkspaceID, f.Path); err == nil {
			ref.URL = u
		}
	}
	return ref, true
}

// links are ref's resource_link contents: the sandbox:// URI, and the
// signed link when there is one.
func (ref FileRef) links() []mcp.Content {
	size := ref.Size
	desc := fmt.Sprintf("%s (%d bytes)", ref.Name, ref.Size)
	l := mcp.NewResourceLink(ref.URI, path.Base(ref.Name), desc, ref.MIME)
	l.Size = &size
	out := []mcp.Content{l}
	if ref.URL != "" {
		d := mcp.NewResourceLink(ref.URL, path.Base(ref.Name), desc+", signed download link", ref.MIME)
		d.Size = &size
		out = append(out, d)
	}
	return out
}

// FileURI is the sandbox:// URI of path in session sessionID.
func FileURI(sessionID, p string) (string, error) {
	if !sessions.IDPattern.MatchString(sessionID) {
		return "", brokererr.New(brokererr.InvalidInput, "invalid session id")
	}
	rel, err := workspace.ValidatePath(p)
	if err != nil {
		return "", err
	}
	return FileScheme + sessionID + "/" + files.EscapePath(rel), nil
}

// ParseFileURI is FileURI's strict inverse. It refuses rather than cleans:
// another scheme or case, a query or fragment, a session ID outside
// sessions.IDPattern, and any path files.UnescapePath refuses ("..",
// "%2e%2e", "%2F", "//", absolute paths, NUL and other controls,
// non-canonical escapes). Which sessions the caller may read is the
// session manager's business, not the parser's.
func ParseFileURI(uri string) (sessionID, rel string, err error) {
	if len(uri) > maxURIBytes {
		return "", "", brokererr.New(brokererr.InvalidInput, "uri is longer than %d bytes", maxURIBytes)
	}
	rest, ok := strings.CutPrefix(uri, FileScheme)
	if !ok {
		return "", "", brokererr.New(brokererr.InvalidInput, "uri must start with %s", FileScheme)
	}
	if strings.ContainsAny(rest, "?#") {
		return "", "", brokererr.New(brokererr.InvalidInput, "uri must not have a query or fragment")
	}
	id, esc, ok := strings.Cut(rest, "/")
	if !ok || !sessions.IDPattern.MatchString(id) {
		return "", "", brokererr.New(brokererr.InvalidInput, "uri must be %s{session_id}/{path}", FileScheme)
	}
	if rel, err = files.UnescapePath(esc); err != nil {
		return "", "", err
	}
	return id, rel, nil
}

// exactText returns data as text when its type is textual and it is valid
// UTF-8 without control characters (bar tab, LF and CR) or bidi overrides,
// so the text is the file's bytes exactly; anything else goes as a blob.
func exactText(mime string, data []byte) (string, bool) {
	if !textual(mime) || !utf8.Valid(data) {
		return "", false
	}
	s := string(data)
	for _, r := range s {
		switch {
		case r == '\t' || r == '\n' || r == '\r':
		case r < 0x20 || r >= 0x7f && r <= 0x9f,
			r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069:
			return "", false
		}
	}
	return s, true
}

func textual(mime string) bool {
	base, _, _ := strings.Cut(mime, ";")
	switch {
	case strings.HasPrefix(base, "text/"), base == "application/json", base == "application/xml",
		base == "application/javascript", base == "application/x-yaml", base == "application/yaml",
		base == "application/toml", base == "application/jsonl", base == "application/x-ndjson",
		base == "application/geo+json", base == "application/x-ipynb+json":
		return true
	}
	return false
}

// resourceContents is a file as resources/read and embedded resources
// carry it: text as text, anything else as a base64 blob.
func resourceContents(uri, mime string, data []byte) mcp.ResourceContents {
	if text, ok := exactText(mime, data); ok {
		return mcp.TextResourceContents{URI: uri, MIMEType: mime, Text: text}
	}
	return mcp.BlobResourceContents{URI: uri, MIMEType: mime, Blob: base64.StdEncoding.EncodeToString(data)}
}

// ServerResource is a resource template whose reads run through the same
// chain as tool calls (identity, validation, rate limit, audit, error
// sanitising, redaction) as the pseudo-tool Read.
type ServerResource struct {
	Template mcp.ResourceTemplate
	Read     ServerTool
}

// Handler adapts chained, Read's handler wrapped in the tool chain, to
// resources/read. A refusal becomes a JSON-RPC error whose message is the
// chain's sanitised "CODE: message".
func (r ServerResource) Handler(chained server.ToolHandlerFunc) server.ResourceTemplateHandlerFunc {
	return func(ctx context.Context, req mcp.ReadResourceRequest) ([]mcp.ResourceContents, error) {
		var call mcp.CallToolRequest
		call.Params.Name = r.Read.Tool.Name
		call.Params.Arguments = map[string]any{"uri": req.Params.URI}
		res, err := chained(ctx, call)
		if err != nil || res == nil { // the chain sanitises errors into results
			return nil, errInternal
		}
		if res.IsError {
			var body struct{ Error, Message string }
			if tc, ok := firstText(res); ok && json.Unmarshal([]byte(tc), &body) == nil && body.Error != "" {
				return nil, errors.New(body.Error + ": " + body.Message)
			}
			return nil, errInternal
		}
		var out []mcp.ResourceContents
		for _, c := range res.Content {
			if er, ok := c.(mcp.EmbeddedResource); ok {
				out = append(out, er.Resource)
			}
		}
		return out, nil
	}
}

var errInternal = errors.New(string(brokererr.InternalError) + ": internal error")

func firstText(res *mcp.CallToolResult) (string, bool) {
	if len(res.Content) == 0 {
		return "", false
	}
	tc, ok := res.Content[0].(mcp.TextContent)
	return tc.Text, ok
}

// ReadResourceArgs is what the chain validates and audits for a
// resources/read of a session file.
type ReadResourceArgs struct {
	URI string `json:"uri" validate:"required,max=4000" audit:"clear" desc:"sandbox://{session_id}/{path} URI of a file in one of your sessions."`
}

// FileResources exposes every session file of the caller as a resource.
func FileResources(e *Engine) ServerResource {
	tmpl := mcp.NewResourceTemplate(FileURITemplate, "Session files",
		mcp.WithTemplateDescription(fmt.Sprintf("A file in one of your sandbox sessions (at most %d MiB). Tools return these URIs as resource links; list_artifacts lists them.", maxResourceBytes>>20)))
	read := newTool(ResourceRead, "Read a session file by its sandbox:// URI.", 8<<10, readAnnotations("Read session file"),
		func(ctx context.Context, p identity.Principal, a *ReadResourceArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			id, rel, err := ParseFileURI(a.URI)
			if err != nil {
				return nil, err
			}
			// Another principal's session does not exist for this caller.
			lease, err := e.Sessions.Acquire(ctx, p.ID, id, false)
			if err != nil {
				return nil, err
			}
			defer lease.Release()
			f, err := lease.Session.ReadFile(ctx, rel, 0, maxResourceBytes)
			if err != nil {
				return nil, err
			}
			if f.Size > maxResourceBytes {
				return nil, brokererr.New(brokererr.FileSizeExceeded,
					"the file is %d bytes; resources/read returns at most %d (read_artifact reads it in parts)", f.Size, maxResourceBytes)
			}
			rc := resourceContents(a.URI, workspace.DetectMIME(rel, f.Data), f.Data)
			return &mcp.CallToolResult{Content: []mcp.Content{mcp.NewEmbeddedResource(rc)}}, nil
		})
	return ServerResource{Template: tmpl, Read: read}
}
