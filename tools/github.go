package tools

import (
	"bytes"
	"context"
	"encoding/base64"
	"time"
	"unicode/utf8"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	ghsvc "github.com/sandbox-broker/sandbox-broker/services/github"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// ToolsetGitHub names the GitHub toolset.
const ToolsetGitHub = "github"

// GitHubCommitter is the GitHub manager as the tools need it
// (*github.Manager). Pass a nil interface, not a nil *Manager, when GitHub
// is not configured.
type GitHubCommitter interface {
	Commit(ctx context.Context, req ghsvc.CommitRequest) (ghsvc.CommitResult, error)
	ReadFile(ctx context.Context, repoID, path, branch string) (content []byte, size int, sha string, err error)
}

// SessionFiles reads files a sandbox session produced, on the host side:
// the GitHub token never enters a sandbox and no git runs in a workspace.
// The implementation checks that principal owns sessionID and reads path
// (already validated, workspace-relative) without following links out of
// the workspace. It returns the whole file or at most max bytes of it; the
// caller treats a result of max bytes as too large.
type SessionFiles interface {
	ReadSessionFile(ctx context.Context, principal, sessionID, path string, max int64) ([]byte, error)
}

// gitHubMaxArgBytes fits ten 500 KB files with JSON escaping.
const gitHubMaxArgBytes = 8 << 20

// GitHubToolset groups the GitHub tools. m may be nil (the tools then
// answer NOT_CONFIGURED, and the broker does not list them), and so may sf
// (only commit_session_files needs it).
func GitHubToolset(m GitHubCommitter, sf SessionFiles) *Toolset {
	return NewToolset(ToolsetGitHub, "Commit to and read from the operator's allow-listed GitHub repositories").Needs(ServiceGitHub).
		AddReadTools(ReadGitHubFile(m)).
		AddWriteTools(CommitAndPushToGitHub(m), CommitSessionFiles(m, sf))
}

// gitHubAnnotations are write or read annotations with openWorldHint set:
// these tools reach an outside service.
func gitHubAnnotations(title string, readOnly bool) mcp.ToolAnnotation {
	ann := writeAnnotations(title, true, false)
	if readOnly {
		ann = readAnnotations(title)
	}
	ann.OpenWorldHint = boolPtr(true)
	return ann
}

func gitHubReady(m GitHubCommitter) error {
	if m == nil {
		return brokererr.New(brokererr.NotConfigured, "GitHub is not configured on this broker")
	}
	return nil
}

// GitHubCommitResult is the commit tools' structured output. PRError says
// why a pull request that was asked for is missing; the commit stands.
type GitHubCommitResult struct {
	Success   bool         `json:"success"`
	CommitSHA string       `json:"commit_sha"`
	Branch    string       `json:"branch"`
	PRURL     string       `json:"pr_url,omitempty"`
	PRError   *ErrorDetail `json:"pr_error,omitempty"`
}

// ErrorDetail is a structured error inside a successful result: the same
// fields as a failed call's body.
type ErrorDetail struct {
	Error       string `json:"error"`
	Message     string `json:"message"`
	Retryable   bool   `json:"retryable"`
	RetryAfterS int64  `json:"retry_after_s,omitempty"`
}

func errorDetail(e *brokererr.Error) *ErrorDetail {
	if e == nil {
		return nil
	}
	return &ErrorDetail{Error: string(e.Code), Message: e.Message, Retryable: e.Retryable,
		RetryAfterS: int64((e.RetryAfter + time.Second - 1) / time.Second)}
}

func commitResult(res ghsvc.CommitResult) (*mcp.CallToolResult, error) {
	return jsonResult(GitHubCommitResult{Success: true, CommitSHA: res.CommitSHA, Branch: res.Branch, PRURL: res.PRURL,
		PRError: errorDetail(res.PRError)})
}

// CommitAndPushArgs are commit_and_push_to_github's arguments.
type CommitAndPushArgs struct {
	RepoID        string            `json:"repo_id" validate:"required,session_id" audit:"clear" desc:"Allow-listed repository ID (the operator's repo_id, not owner/name)."`
	Branch        string            `json:"branch" validate:"required,max=200,clean" audit:"clear" desc:"Work branch to commit to. It must match the repository's allowed branch patterns (such as sandbox/*) and is never the base branch; it is created from the base branch if missing."`
	Files         map[string]string `json:"files" validate:"required,min=1,max=10,dive,max=512000,clean" audit:"keys" desc:"Files to write: repository-relative path to UTF-8 text content. At most 10 files of 500 KB each; .git, .env, node_modules, .codesandbox and .github/workflows paths are refused."`
	CommitMessage string            `json:"commit_message" validate:"required,max=200,clean" audit:"digest" desc:"Commit message, at most 200 characters."`
	CreatePR      bool              `json:"create_pr,omitempty" desc:"Open a pull request into the base branch, or return the one already open for this branch."`
	PRTitle       string            `json:"pr_title,omitempty" validate:"omitempty,max=200,clean" audit:"digest" desc:"Pull request title (default: the commit message's first line); only with create_pr."`
}

// CommitAndPushToGitHub commits files given inline as one commit.
func CommitAndPushToGitHub(m GitHubCommitter) ServerTool {
	return newTool("commit_and_push_to_github",
		"Commit text files to a work branch of an allow-listed GitHub repository as one atomic commit, optionally opening a pull request into the base branch.",
		gitHubMaxArgBytes, gitHubAnnotations("Commit and push to GitHub", false),
		func(ctx context.Context, _ identity.Principal, a *CommitAndPushArgs) (*mcp.CallToolResult, error) {
			if err := gitHubReady(m); err != nil {
				return nil, err
			}
			files := make(map[string][]byte, len(a.Files))
			for p, c := range a.Files {
				files[p] = []byte(c)
			}
			res, err := m.Commit(ctx, ghsvc.CommitRequest{RepoID: a.RepoID, Branch: a.Branch, Files: files,
				Message: a.CommitMessage, CreatePR: a.CreatePR, PRTitle: a.PRTitle})
			if err != nil {
				return nil, err
			}
			return commitResult(res)
		})
}

// CommitSessionFilesArgs are commit_session_files's arguments.
type CommitSessionFilesArgs struct {
	RepoID        string   `json:"repo_id" validate:"required,session_id" audit:"clear" desc:"Allow-listed repository ID (the operator's repo_id, not owner/name)."`
	Branch        string   `json:"branch" validate:"required,max=200,clean" audit:"clear" desc:"Work branch to commit to. It must match the repository's allowed branch patterns (such as sandbox/*) and is never the base branch; it is created from the base branch if missing."`
	SessionID     string   `json:"session_id" validate:"required,session_id" audit:"clear" desc:"Your sandbox session whose workspace files to commit."`
	Paths         []string `json:"paths" validate:"required,min=1,max=10,dive,required,max=1024,clean" audit:"clear" desc:"Workspace-relative paths of up to 10 files (500 KB each); each is committed at the same path in the repository."`
	CommitMessage string   `json:"commit_message" validate:"required,max=200,clean" audit:"digest" desc:"Commit message, at most 200 characters."`
	CreatePR      bool     `json:"create_pr,omitempty" desc:"Open a pull request into the base branch, or return the one already open for this branch."`
	PRTitle       string   `json:"pr_title,omitempty" validate:"omitempty,max=200,clean" audit:"digest" desc:"Pull request title (default: the commit message's first line); only with create_pr."`
}

// CommitSessionFiles commits files a sandbox session produced. The broker
// reads them itself; nothing in the sandbox sees the token. Without a
// sandbox backend there are no sessions, and the tool is not listed.
func CommitSessionFiles(m GitHubCommitter, sf SessionFiles) ServerTool {
	t := newTool("commit_session_files",
		"Commit files from your sandbox session's workspace to a work branch of an allow-listed GitHub repository as one atomic commit, optionally opening a pull request.",
		0, gitHubAnnotations("Commit session files to GitHub", false),
		func(ctx context.Context, p identity.Principal, a *CommitSessionFilesArgs) (*mcp.CallToolResult, error) {
			if err := gitHubReady(m); err != nil {
				return nil, err
			}
			if sf == nil {
				return nil, brokererr.New(brokererr.NotConfigured, "session files are not available on this broker (it has no sandbox backend)")
			}
			// Everything is checked before the first read, so a refused
			// path never touches the workspace.
			for _, path := range a.Paths {
				if _, err := ghsvc.ValidateRepoPath(path); err != nil {
					return nil, err
				}
			}
			files := make(map[string][]byte, len(a.Paths))
			for _, path := range a.Paths {
				if _, dup := files[path]; dup {
					return nil, brokererr.New(brokererr.InvalidInput, "%s is listed twice", path)
				}
				files[path] = nil
			}
			for _, path := range a.Paths {
				data, err := sf.ReadSessionFile(ctx, p.ID, a.SessionID, path, ghsvc.MaxFileBytes+1)
				if err != nil {
					return nil, err
				}
				if len(data) > ghsvc.MaxFileBytes {
					return nil, brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", path, ghsvc.MaxFileBytes)
				}
				files[path] = data
			}
			res, err := m.Commit(ctx, ghsvc.CommitRequest{RepoID: a.RepoID, Branch: a.Branch, Files: files,
				Message: a.CommitMessage, CreatePR: a.CreatePR, PRTitle: a.PRTitle})
			if err != nil {
				return nil, err
			}
			return commitResult(res)
		})
	t.Needs = []Service{ServiceSandbox}
	return t
}

// ReadGitHubFileArgs are read_github_file's arguments.
type ReadGitHubFileArgs struct {
	RepoID   string `json:"repo_id" validate:"required,session_id" audit:"clear" desc:"Allow-listed repository ID (the operator's repo_id, not owner/name)."`
	FilePath string `json:"file_path" validate:"required,max=1024,clean" audit:"clear" desc:"Repository-relative path of the file."`
	Branch   string `json:"branch,omitempty" validate:"omitempty,max=200,clean" audit:"clear" desc:"Branch to read: the base branch (default) or an allowed work branch."`
}

// ReadGitHubFileResult is read_github_file's structured output.
type ReadGitHubFileResult struct {
	RepoID   string `json:"repo_id"`
	Path     string `json:"path"`
	Branch   string `json:"branch,omitempty"`
	Content  string `json:"content"`
	Encoding string `json:"encoding"` // "text" or "base64"
	Size     int    `json:"size"`
	SHA      string `json:"sha"`
}

// ReadGitHubFile reads one file (at most 1 MB) from an allow-listed repo.
func ReadGitHubFile(m GitHubCommitter) ServerTool {
	return newTool("read_github_file",
		"Read a file (at most 1 MB) from the base branch or an allowed work branch of an allow-listed GitHub repository. Text comes back as text, other files as base64.",
		0, gitHubAnnotations("Read GitHub file", true),
		func(ctx context.Context, _ identity.Principal, a *ReadGitHubFileArgs) (*mcp.CallToolResult, error) {
			if err := gitHubReady(m); err != nil {
				return nil, err
			}
			data, size, sha, err := m.ReadFile(ctx, a.RepoID, a.FilePath, a.Branch)
			if err != nil {
				return nil, err
			}
			out := ReadGitHubFileResult{RepoID: a.RepoID, Path: a.FilePath, Branch: a.Branch, Size: size, SHA: sha}
			if utf8.Valid(data) && bytes.IndexByte(data, 0) < 0 {
				// Escapes and bidi controls are stripped: the file is data
				// for the model, and must not restyle a reviewer's terminal.
				out.Encoding = "text"
				out.Content, _ = cleanOutput(data, ghsvc.MaxReadBytes+64)
			} else {
				out.Encoding = "base64"
				out.Content = base64.StdEncoding.EncodeToString(data)
			}
			return jsonResult(out)
		})
}
