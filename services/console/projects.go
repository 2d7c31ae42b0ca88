package console

import (
	"net/http"

	"github.com/mark3labs/mcp-go/mcp"
)

// project is a project tool's result (tools/projects.go).
type project struct {
	SandboxID          string `json:"sandbox_id"`
	ProjectName        string `json:"project_name"`
	Template           string `json:"template"`
	Provider           string `json:"provider"`
	ExpiresAt          string `json:"expires_at"`
	PreviewURL         string `json:"preview_url"`
	PreviewUnavailable string `json:"preview_unavailable"`
}

func (c *Console) listProjects(w http.ResponseWriter, r *http.Request) {
	var out struct {
		Sandboxes []project `json:"sandboxes"`
	}
	if err := c.tools.callJSON(r.Context(), principal(r), "list_sandboxes", nil, &out); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "projects", out.Sandboxes)
}

func (c *Console) createProject(w http.ResponseWriter, r *http.Request) {
	if !readForm(w, r) {
		c.errorPage(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	args := map[string]any{"project_name": r.PostForm.Get("project_name"), "template": r.PostForm.Get("template")}
	var out project
	if err := c.tools.callJSON(r.Context(), principal(r), "create_sandbox_for_project", args, &out); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "project", out)
}

// buildProject runs the project's build as a streamed run: its output
// arrives as the build's log notifications, then the result.
func (c *Console) buildProject(w http.ResponseWriter, r *http.Request) {
	args := map[string]any{"sandbox_id": r.PathValue("id"), "output_type": "build_output"}
	c.stream(w, r, "get_sandbox_output", args, func(res *mcp.CallToolResult) (string, error) {
		var out struct {
			Status      string `json:"status"`
			Success     bool   `json:"success"`
			ExitCode    *int   `json:"exit_code"`
			Output      string `json:"output"`
			ExecutionID string `json:"execution_id"`
			Hint        string `json:"hint"`
		}
		if err := decode(res, &out); err != nil {
			return "", err
		}
		return c.fragment("build_result", out)
	})
}
