package tools

import (
	"context"
	"net/http"
	"time"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// CreateUploadURLArgs are create_upload_url's arguments.
type CreateUploadURLArgs struct {
	SessionID      string `json:"session_id,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Session to use; omit to start a new one."`
	ConversationID string `json:"conversationId,omitempty" validate:"omitempty,session_id" audit:"clear" desc:"Alias of session_id."`
	Path           string `json:"path" validate:"required,max=1024,clean" audit:"clear" desc:"Relative path inside the session workspace (/mnt/data) the uploaded file is stored at."`
	MaxBytes       int64  `json:"max_bytes,omitempty" validate:"omitempty,min=1" desc:"Largest body the link accepts; default and upper bound: the broker's cap for signed links."`
	Overwrite      bool   `json:"overwrite,omitempty" desc:"Let the upload replace an existing file (default false)."`
}

// CreateUploadURLResult is create_upload_url's structured output.
type CreateUploadURLResult struct {
	SessionID string `json:"session_id"`
	Path      string `json:"path"`
	Method    string `json:"method"`
	URL       string `json:"url"`
	MaxBytes  int64  `json:"max_bytes"`
	Overwrite bool   `json:"overwrite"`
	ExpiresAt string `json:"expires_at"`
	URI       string `json:"uri"`
	Usage     string `json:"usage"`
}

// CreateUploadURL returns a short-lived signed PUT link for one file in
// the caller's session workspace, for files too large for upload_file.
func CreateUploadURL(e *Engine) ServerTool {
	return newTool("create_upload_url", "Get a short-lived signed URL that uploads one file into your session workspace with an HTTP PUT of its bytes (e.g. curl -T file URL), for files too large for upload_file. The link is bound to the path, a maximum size and whether it may overwrite; the workspace quota applies while the bytes arrive, and the file appears only once complete.",
		0, writeAnnotations("Create upload URL", true, false),
		func(ctx context.Context, p identity.Principal, a *CreateUploadURLArgs) (*mcp.CallToolResult, error) {
			if err := e.ready(); err != nil {
				return nil, err
			}
			if e.URLs == nil || e.MaxLinkBytes <= 0 {
				return nil, brokererr.New(brokererr.Unavailable, "this broker issues no signed upload links")
			}
			id, err := sessionID(a.SessionID, a.ConversationID)
			if err != nil {
				return nil, err
			}
			rel, err := workspace.ValidatePath(a.Path)
			if err != nil {
				return nil, err
			}
			max := e.MaxLinkBytes
			if a.MaxBytes > max {
				return nil, brokererr.New(brokererr.FileSizeExceeded, "max_bytes is over this broker's cap of %d bytes for signed links", max)
			}
			if a.MaxBytes > 0 {
				max = a.MaxBytes
			}
			lease, err := e.Sessions.Acquire(ctx, p.ID, id, true)
			if err != nil {
				return nil, err
			}
			defer lease.Release()
			// The upload bypasses the session: its workspace must exist,
			// owned by the session's user, before the link is any use.
			if err := lease.Session.PrepareWorkspace(ctx); err != nil {
				return nil, err
			}
			u, exp, err := e.URLs.UploadURL(lease.WorkspaceID, rel, max, a.Overwrite)
			if err != nil {
				return nil, err
			}
			uri, _ := FileURI(lease.ID, rel) // rel is valid
			return jsonResult(CreateUploadURLResult{SessionID: lease.ID, Path: rel, Method: http.MethodPut, URL: u,
				MaxBytes: max, Overwrite: a.Overwrite, ExpiresAt: exp.UTC().Format(time.RFC3339), URI: uri,
				Usage: "PUT the file's bytes as the request body before expires_at, e.g. curl -T FILE 'URL'; 201 or 200 with the stored size and sha256 means it is in place."})
		})
}
