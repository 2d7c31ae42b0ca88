package tools

import (
	"context"
	"encoding/base64"
	"unicode/utf8"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// UploadFileArgs are upload_file's arguments.
type UploadFileArgs struct {
	SessionID      string `json:"session_id,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Session to use; omit to start a new one."`
	ConversationID string `json:"conversationId,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Alias of session_id."`
	Path           string `json:"path" validate:"required,max=1024,clean" audit:"clear" desc:"Relative path inside the session workspace (/mnt/data)."`
	Content        string `json:"content,omitempty" validate:"excluded_with=ContentBase64,clean" audit:"digest" desc:"File content as UTF-8 text."`
	ContentBase64  string `json:"content_base64,omitempty" validate:"excluded_with=Content" audit:"digest" desc:"File content as standard base64, for binary files (at most 10 MiB decoded)."`
	Overwrite      bool   `json:"overwrite,omitempty" desc:"Replace an existing file (default false)."`
}

// UploadFileResult is upload_file's structured output.
type UploadFileResult struct {
	SessionID string `json:"session_id"`
	Path      string `json:"path"`
	Size      int    `json:"size"`
	URI       string `json:"uri"`
	URL       string `json:"url,omitempty"`
}

// UploadFile writes a file into the caller's session workspace.
func UploadFile(e *Engine) ServerTool {
	return newTool("upload_file", "Upload a file (text or base64) into your session workspace, creating the session if needed.",
		14<<20, writeAnnotations("Upload file", true, false),
		func(ctx context.Context, p identity.Principal, a *UploadFileArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			id, err := sessionID(a.SessionID, a.ConversationID)
			if err != nil {
				return nil, err
			}
			rel, err := workspace.ValidatePath(a.Path)
			if err != nil {
				return nil, err
			}
			var data []byte
			if a.ContentBase64 != "" {
				// Checked before decoding, so an oversized upload costs nothing.
				if base64.StdEncoding.DecodedLen(len(a.ContentBase64)) > maxUploadBytes+2 {
					return nil, brokererr.New(brokererr.FileSizeExceeded, "content_base64 decodes to more than %d bytes", maxUploadBytes)
				}
				if data, err = base64.StdEncoding.DecodeString(a.ContentBase64); err != nil {
					return nil, brokererr.New(brokererr.InvalidInput, "content_base64 is not valid standard base64")
				}
			} else {
				if len(a.Content) > maxUploadBytes {
					return nil, brokererr.New(brokererr.FileSizeExceeded, "content is more than %d bytes", maxUploadBytes)
				}
				data = []byte(a.Content)
			}
			if len(data) > maxUploadBytes {
				return nil, brokererr.New(brokererr.FileSizeExceeded, "file is more than %d bytes", maxUploadBytes)
			}
			lease, err := e.Sessions.Acquire(ctx, p.ID, id, true)
			if err != nil {
				return nil, err
			}
			defer lease.Release()
			if err := lease.Session.WriteFile(ctx, rel, data, a.Overwrite); err != nil {
				return nil, err
			}
			// The file is written: from here on nothing may report failure.
			out := UploadFileResult{SessionID: lease.ID, Path: rel, Size: len(data)}
			extra := &mcp.CallToolResult{}
			if ref, ok := e.fileRef(lease, sandbox.FileInfo{Path: rel, Size: int64(len(data))}); ok {
				out.URI, out.URL = ref.URI, ref.URL
				extra.Content = ref.links()
			}
			return prependJSON(extra, out)
		})
}

// ListArtifactsArgs are list_artifacts's arguments.
type ListArtifactsArgs struct {
	SessionID string `json:"session_id" validate:"required,session_id" audit:"clear" desc:"Session whose files to list."`
	Path      string `json:"path,omitempty" validate:"omitempty,max=1024,clean" audit:"clear" desc:"Directory to list (default: the whole workspace)."`
}

// ListArtifacts lists a session's files with their URIs and signed links.
func ListArtifacts(e *Engine) ServerTool {
	return newTool("list_artifacts", "List the files in your session workspace, each with its sandbox:// resource URI (read it with resources/read) and, when the broker has a public URL, a signed download link.",
		0, readAnnotations("List artifacts"),
		func(ctx context.Context, p identity.Principal, a *ListArtifactsArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			dir := ""
			if a.Path != "" {
				var err error
				if dir, err = workspace.ValidatePath(a.Path); err != nil {
					return nil, err
				}
			}
			lease, err := e.Sessions.Acquire(ctx, p.ID, a.SessionID, false)
			if err != nil {
				return nil, err
			}
			defer lease.Release()
			list, err := lease.Session.ListFiles(ctx, dir)
			if err != nil {
				return nil, err
			}
			out := []FileRef{}
			for _, f := range list {
				if ref, ok := e.fileRef(lease, f); ok {
					out = append(out, ref)
				}
			}
			return jsonResult(map[string]any{"session_id": lease.ID, "files": out})
		})
}

// ReadArtifactArgs are read_artifact's arguments.
type ReadArtifactArgs struct {
	SessionID string `json:"session_id" validate:"required,session_id" audit:"clear" desc:"Session that holds the file."`
	Path      string `json:"path" validate:"required,max=1024,clean" audit:"clear" desc:"File path inside the workspace."`
	Offset    int64  `json:"offset,omitempty" validate:"omitempty,min=0" desc:"Byte offset to start at."`
	MaxBytes  int64  `json:"max_bytes,omitempty" validate:"omitempty,min=1,max=1048576" desc:"Bytes to read (default 262144)."`
}

// ReadArtifactResult is read_artifact's structured output.
type ReadArtifactResult struct {
	SessionID     string `json:"session_id"`
	Path          string `json:"path"`
	Size          int64  `json:"size"`
	MIME          string `json:"mime"`
	Offset        int64  `json:"offset"`
	Length        int    `json:"length"`
	EOF           bool   `json:"eof"`
	Encoding      string `json:"encoding"` // "text", "image" or "base64"
	Text          string `json:"text,omitempty"`
	ContentBase64 string `json:"content_base64,omitempty"`
	URI           string `json:"uri"`
	URL           string `json:"url,omitempty"`
}

// ReadArtifact returns a file's content: text as text, images as image
// content, other bytes as base64; with its resource URI and signed link.
func ReadArtifact(e *Engine) ServerTool {
	return newTool("read_artifact", "Read a file from your session workspace in parts: text as text, images inline, other files as base64, with its sandbox:// resource URI and, when the broker has a public URL, a signed download link.",
		0, readAnnotations("Read artifact"),
		func(ctx context.Context, p identity.Principal, a *ReadArtifactArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			rel, err := workspace.ValidatePath(a.Path)
			if err != nil {
				return nil, err
			}
			max := a.MaxBytes
			if max == 0 {
				max = defaultReadBytes
			}
			lease, err := e.Sessions.Acquire(ctx, p.ID, a.SessionID, false)
			if err != nil {
				return nil, err
			}
			defer lease.Release()
			f, err := lease.Session.ReadFile(ctx, rel, a.Offset, max)
			if err != nil {
				return nil, err
			}
			out := ReadArtifactResult{SessionID: lease.ID, Path: rel, Size: f.Size, MIME: workspace.DetectMIME(rel, f.Data),
				Offset: a.Offset, Length: len(f.Data), EOF: a.Offset+int64(len(f.Data)) >= f.Size}
			ref, _ := e.fileRef(lease, f.FileInfo) // rel is valid, so ok
			out.URI, out.URL = ref.URI, ref.URL
			extra := &mcp.CallToolResult{}
			switch {
			case isImage(out.MIME) && a.Offset == 0 && out.EOF && f.Size <= maxReadBytes:
				out.Encoding = "image"
				extra.Content = append(extra.Content, mcp.NewImageContent(base64.StdEncoding.EncodeToString(f.Data), out.MIME))
			case isText(out.MIME, f):
				out.Encoding = "text"
				out.Text, _ = cleanOutput(f.Data, int(max)+64)
			default:
				out.Encoding = "base64"
				out.ContentBase64 = base64.StdEncoding.EncodeToString(f.Data)
			}
			ref.MIME = out.MIME
			extra.Content = append(extra.Content, ref.links()...)
			return prependJSON(extra, out)
		})
}

func isText(mime string, f sandbox.File) bool {
	if !textual(mime) {
		return false
	}
	// A read that cut a rune in half is still text.
	d := f.Data
	for i := 0; i < 3 && len(d) > 0 && !utf8.Valid(d); i++ {
		d = d[:len(d)-1]
	}
	return utf8.Valid(d)
}
