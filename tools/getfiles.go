package tools

import (
	"context"
	"encoding/base64"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// GetFilesArgs are get_files' arguments.
type GetFilesArgs struct {
	SessionID string   `json:"session_id" validate:"required,session_id" audit:"clear" desc:"The task's session."`
	Paths     []string `json:"paths" validate:"required,min=1,max=50,dive,required,max=1024,clean" audit:"clear" desc:"Workspace-relative paths of the files to return (at most 50, 10 MiB of content in all)."`
}

// TaskFileContent is one file get_files returns.
type TaskFileContent struct {
	Path      string `json:"path"`
	Content   string `json:"content,omitempty"` // base64
	SizeBytes int64  `json:"size_bytes"`
	MIMEType  string `json:"mime_type,omitempty"`
	URI       string `json:"uri,omitempty"`
	URL       string `json:"url,omitempty"`
	Error     string `json:"error,omitempty"`
}

// GetFiles returns workspace files whole, base64-encoded, with their links.
func (t *Tasks) GetFiles() ServerTool {
	return newTool("get_files",
		"Return files from a task's workspace: each with its base64 content, size_bytes and mime_type, its sandbox:// resource URI and, when the broker has a public URL, a signed download link. Files beyond 10 MiB in all come back with their links only.",
		0, readAnnotations("Get files"),
		func(ctx context.Context, p identity.Principal, a *GetFilesArgs) (*mcp.CallToolResult, error) {
			e := t.Jobs.Engine
			if err := e.ready(); err != nil {
				return nil, err
			}
			rels := make([]string, len(a.Paths))
			for i, path := range a.Paths {
				rel, err := workspace.ValidatePath(path)
				if err != nil {
					return nil, err
				}
				rels[i] = rel
			}
			lease, err := e.Sessions.Acquire(ctx, p.ID, a.SessionID, false)
			if err != nil {
				return nil, err
			}
			defer lease.Release()
			res := &mcp.CallToolResult{}
			out := make([]TaskFileContent, 0, len(rels))
			left := int64(maxGetFilesBytes)
			for _, rel := range rels {
				fc := TaskFileContent{Path: rel}
				f, err := lease.Session.ReadFile(ctx, rel, 0, left)
				switch {
				case err != nil:
					fc.Error = string(brokererr.CodeOf(err))
					if be := brokererr.As(err); be != nil {
						fc.Error += ": " + be.Message
					}
					out = append(out, fc)
					continue
				case int64(len(f.Data)) < f.Size:
					fc.Error = "the files asked for hold more than 10 MiB in all: read this one with read_artifact or its links"
				default:
					fc.Content = base64.StdEncoding.EncodeToString(f.Data)
					left -= f.Size
				}
				fc.SizeBytes = f.Size
				fc.MIMEType = workspace.DetectMIME(rel, f.Data)
				if ref, ok := e.fileRef(lease, f.FileInfo); ok {
					fc.URI, fc.URL = ref.URI, ref.URL
					ref.MIME = fc.MIMEType
					res.Content = append(res.Content, ref.links()...)
				}
				out = append(out, fc)
			}
			return prependJSON(res, map[string]any{"session_id": lease.ID, "files": out})
		})
}
