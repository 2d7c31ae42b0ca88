package console

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// Shapes of the tool results the playground shows (see tools/).
type (
	fileRef struct {
		Name string `json:"name"`
		Size int64  `json:"size"`
		MIME string `json:"mime"`
		URI  string `json:"uri"`
		URL  string `json:"url"`
	}
	runResult struct {
		SessionID  string    `json:"session_id"`
		Success    bool      `json:"success"`
		ExitCode   int       `json:"exit_code"`
		Signal     string    `json:"signal"`
		Stdout     string    `json:"stdout"`
		Stderr     string    `json:"stderr"`
		DurationMS int64     `json:"duration_ms"`
		TimedOut   bool      `json:"timed_out"`
		OOMKilled  bool      `json:"oom_killed"`
		Truncated  bool      `json:"truncated"`
		Files      []fileRef `json:"files"`
	}
	image struct {
		MIME, Data string
	}
	sessionRow struct {
		SessionID  string    `json:"session_id"`
		CreatedAt  time.Time `json:"created_at"`
		LastUsedAt time.Time `json:"last_used_at"`
		Live       bool      `json:"live"`
		Jobs       int       `json:"jobs"`
	}
)

// Form bounds; the tools check their own limits too.
const (
	maxCodeBytes = 256 << 10
	maxFormBytes = 1 << 20          // 256 KiB of code, URL-encoded
	runTimeout   = 11 * time.Minute // above the largest timeout_s
)

func principal(r *http.Request) identity.Principal { return sessionFrom(r.Context()).principal }

func (c *Console) home(w http.ResponseWriter, r *http.Request) {
	http.Redirect(w, r, "/console/playground", http.StatusSeeOther)
}

// playground renders the page: runners and the person's sessions (two
// audited calls); jobs and projects load when asked.
func (c *Console) playground(w http.ResponseWriter, r *http.Request) {
	p := principal(r)
	data := map[string]any{"Session": r.URL.Query().Get("session_id")}
	var runners struct {
		Backend string `json:"backend"`
		Runners []struct {
			Language string `json:"language"`
		} `json:"runners"`
	}
	if err := c.tools.callJSON(r.Context(), p, "list_runners", nil, &runners); err != nil {
		data["RunnersError"] = err.Error()
	} else {
		data["Backend"], data["Runners"] = runners.Backend, runners.Runners
	}
	var mine struct {
		Sessions []sessionRow `json:"sessions"`
	}
	if err := c.admin.callJSON(r.Context(), p, "console.my_sessions", nil, &mine); err == nil {
		data["Sessions"] = mine.Sessions
	}
	c.render(w, r, http.StatusOK, "playground", data)
}

func (c *Console) mySessions(w http.ResponseWriter, r *http.Request) {
	var mine struct {
		Sessions []sessionRow `json:"sessions"`
	}
	if err := c.admin.callJSON(r.Context(), principal(r), "console.my_sessions", nil, &mine); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "sessions", mine.Sessions)
}

// readForm parses a small urlencoded form.
func readForm(w http.ResponseWriter, r *http.Request) bool {
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	return r.ParseForm() == nil
}

// runCode starts run_code as a streamed run and answers with the
// fragment whose EventSource reads it.
func (c *Console) runCode(w http.ResponseWriter, r *http.Request) {
	if !readForm(w, r) {
		c.errorPage(w, r, http.StatusBadRequest, "The form could not be read (code is limited to 256 KiB).")
		return
	}
	code := r.PostForm.Get("code")
	if code == "" || len(code) > maxCodeBytes {
		c.errorPage(w, r, http.StatusBadRequest, "Write some code first (at most 256 KiB).")
		return
	}
	args := map[string]any{"language": r.PostForm.Get("language"), "code": code}
	if s := strings.TrimSpace(r.PostForm.Get("session_id")); s != "" {
		args["session_id"] = s
	}
	if t, err := strconv.Atoi(r.PostForm.Get("timeout_s")); err == nil && t > 0 {
		args["timeout_s"] = t
	}
	c.stream(w, r, "run_code", args, func(res *mcp.CallToolResult) (string, error) {
		var out runResult
		if err := decode(res, &out); err != nil {
			return "", err
		}
		var imgs []image
		for _, ct := range res.Content {
			if im, ok := mcp.AsImageContent(ct); ok {
				imgs = append(imgs, image{MIME: im.MIMEType, Data: im.Data})
			}
		}
		return c.fragment("run_result", map[string]any{"R": out, "Images": imgs})
	})
}

// stream runs a tool call in the background as a run: progress and
// output notifications become SSE events as they come, then the result
// (rendered by done) and a final "done" event.
func (c *Console) stream(w http.ResponseWriter, r *http.Request, tool string, args map[string]any, done func(*mcp.CallToolResult) (string, error)) {
	sess := sessionFrom(r.Context())
	run, err := c.runs.start(sess.key)
	if err != nil {
		c.errorPage(w, r, http.StatusTooManyRequests, "Too many runs are under way from this console session; wait for one to end.")
		return
	}
	p := sess.principal
	go func() {
		ctx, cancel := context.WithTimeout(c.base(), runTimeout)
		defer cancel()
		notify := func(n mcp.JSONRPCNotification) {
			switch n.Method {
			case "notifications/progress":
				msg, _ := n.Params.AdditionalFields["message"].(string)
				if f, err := c.fragment("progress", msg); err == nil {
					run.emit("progress", f, false)
				}
			case "notifications/message":
				text, _ := n.Params.AdditionalFields["data"].(string)
				logger, _ := n.Params.AdditionalFields["logger"].(string)
				if f, err := c.fragment("chunk", map[string]any{"Stream": strings.TrimPrefix(logger, "sandbox."), "Text": text}); err == nil {
					run.emit("output", f, false)
				}
			}
		}
		res, err := c.tools.call(ctx, p, tool, args, callOpts{onNotify: notify, progress: "console-" + run.id})
		var body string
		if err == nil {
			body, err = done(res)
		}
		if err != nil {
			body, _ = c.fragment("error", map[string]any{"Message": callMessage(err)})
		}
		run.emit("result", body, true)
		run.emit("done", "", true)
		run.finish(c.d.Now())
	}()
	c.writeFragment(w, http.StatusOK, "run_started", map[string]any{"ID": run.id, "Tool": tool})
}

// callMessage is what a failed call shows: the tool's own error, or a
// generic line (details stay in the log).
func callMessage(err error) string {
	if te, ok := err.(*toolError); ok {
		return te.Code + ": " + te.Message
	}
	return "The call could not be made."
}

func (c *Console) runEvents(w http.ResponseWriter, r *http.Request) {
	run, ok := c.runs.get(r.PathValue("id"), sessionFrom(r.Context()).key)
	if !ok {
		c.errorPage(w, r, http.StatusNotFound, "No such run (runs are kept for five minutes after they end).")
		return
	}
	run.stream(r.Context(), w, lastEventID(r))
}

func (c *Console) closeSession(w http.ResponseWriter, r *http.Request) {
	if !readForm(w, r) {
		c.errorPage(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	id := r.PostForm.Get("session_id")
	if _, err := c.tools.call(r.Context(), principal(r), "close_session", map[string]any{"session_id": id}, callOpts{}); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.mySessions(w, r)
}

func (c *Console) listFiles(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("session_id")
	if id == "" {
		c.writeFragment(w, http.StatusOK, "files", map[string]any{})
		return
	}
	var out struct {
		SessionID string    `json:"session_id"`
		Files     []fileRef `json:"files"`
	}
	if err := c.tools.callJSON(r.Context(), principal(r), "list_artifacts", map[string]any{"session_id": id}, &out); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "files", map[string]any{"SessionID": out.SessionID, "Files": out.Files})
}

// upload stores a dropped or chosen file with upload_file. The file's
// own name is only a suggestion: the tool validates the path.
func (c *Console) upload(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, c.d.MaxUploadBytes)
	if err := r.ParseMultipartForm(1 << 20); err != nil {
		c.errorPage(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("The upload could not be read (at most %s).", humanSize(c.d.MaxUploadBytes)))
		return
	}
	defer r.MultipartForm.RemoveAll()
	f, hdr, err := r.FormFile("file")
	if err != nil {
		c.errorPage(w, r, http.StatusBadRequest, "Choose or drop a file.")
		return
	}
	defer f.Close()
	data, err := io.ReadAll(f)
	if err != nil {
		c.errorPage(w, r, http.StatusBadRequest, "The file could not be read.")
		return
	}
	name := path.Base(strings.ReplaceAll(hdr.Filename, "\\", "/"))
	args := map[string]any{"path": name, "content_base64": base64.StdEncoding.EncodeToString(data), "overwrite": r.FormValue("overwrite") == "on"}
	if s := strings.TrimSpace(r.FormValue("session_id")); s != "" {
		args["session_id"] = s
	}
	var out struct {
		SessionID string `json:"session_id"`
	}
	if err := c.tools.callJSON(r.Context(), principal(r), "upload_file", args, &out); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	q := r.URL.Query()
	q.Set("session_id", out.SessionID)
	r.URL.RawQuery = q.Encode()
	c.listFiles(w, r)
}

// base is the context background work runs under: it ends when the
// broker shuts down.
func (c *Console) base() context.Context {
	if c.d.Context != nil {
		return c.d.Context
	}
	return context.Background()
}
