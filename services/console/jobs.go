package console

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Shapes of the execution tools' results (tools/jobs.go).
type (
	jobEvent struct {
		Seq        int64  `json:"seq"`
		TS         string `json:"ts"`
		Type       string `json:"type"`
		Data       string `json:"data"`
		Code       *int   `json:"code"`
		Signal     string `json:"signal"`
		DurationMS *int64 `json:"duration_ms"`
		Message    string `json:"message"`
	}
	jobOutput struct {
		ExecutionID string     `json:"execution_id"`
		SessionID   string     `json:"session_id"`
		Status      string     `json:"status"`
		ExitCode    *int       `json:"exit_code"`
		Output      []jobEvent `json:"output"`
		Dropped     int64      `json:"dropped"`
		NextSince   int64      `json:"next_since"`
		More        bool       `json:"more"`
	}
	jobInfo struct {
		ID          string `json:"execution_id"`
		SessionID   string `json:"session_id"`
		Command     string `json:"command"`
		Status      string `json:"status"`
		ExitCode    *int   `json:"exit_code"`
		Interactive bool   `json:"interactive"`
		StartedAt   string `json:"started_at"`
	}
)

const (
	jobPollWait     = 25 // seconds a get_execution_output call may wait
	jobPollInterval = time.Second
)

func (c *Console) listJobs(w http.ResponseWriter, r *http.Request) {
	args := map[string]any{}
	if s := r.URL.Query().Get("session_id"); s != "" {
		args["session_id"] = s
	}
	var out struct {
		Executions []jobInfo `json:"executions"`
	}
	if err := c.tools.callJSON(r.Context(), principal(r), "list_executions", args, &out); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "jobs", out.Executions)
}

// startJob starts execute_code_async and answers with the job's panel,
// whose EventSource follows its events.
func (c *Console) startJob(w http.ResponseWriter, r *http.Request) {
	if !readForm(w, r) {
		c.errorPage(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	args := map[string]any{"command": r.PostForm.Get("command"), "interactive": r.PostForm.Get("interactive") == "on"}
	if s := strings.TrimSpace(r.PostForm.Get("session_id")); s != "" {
		args["session_id"] = s
	}
	if t, err := strconv.Atoi(r.PostForm.Get("timeout_seconds")); err == nil && t > 0 {
		args["timeout_seconds"] = t
	}
	var out jobOutput
	if err := c.tools.callJSON(r.Context(), principal(r), "execute_code_async", args, &out); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "job", map[string]any{"ID": out.ExecutionID, "SessionID": out.SessionID, "Interactive": args["interactive"]})
}

// jobEvents streams an execution's events over SSE, read with
// get_execution_output like any client does: long-polls (each one an
// audited call against the principal's rate limit), at most one a second
// while output flows, and from the browser's Last-Event-ID (the event
// seq) when it reconnects.
func (c *Console) jobEvents(w http.ResponseWriter, r *http.Request) {
	p := principal(r)
	id := r.PathValue("id")
	since := lastEventID(r)
	ctx := r.Context()
	s := startSSE(w)
	pause := func(d time.Duration) bool {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		}
	}
	send := func(name, frag string, data any, id int64) bool {
		body, err := c.fragment(frag, data)
		return err == nil && s.send(sseEvent{ID: id, Name: name, Data: body}) == nil
	}
	for {
		var out jobOutput
		err := c.tools.callJSON(ctx, p, "get_execution_output",
			map[string]any{"execution_id": id, "since": since, "wait": true, "max_wait_s": jobPollWait}, &out)
		if ctx.Err() != nil {
			return
		}
		if te, ok := err.(*toolError); ok && te.Retryable {
			wait := time.Duration(max(te.RetryAfterS, 1)) * time.Second
			if !send("status", "job_status", map[string]any{"Status": "waiting", "Note": te.Code + ": " + te.Message}, 0) || !pause(wait) {
				return
			}
			continue
		}
		if err != nil {
			send("status", "job_status", map[string]any{"Status": "error", "Note": callMessage(err)}, 0)
			send("done", "empty", nil, 0)
			return
		}
		for _, e := range out.Output {
			if !send("line", "job_event", e, e.Seq) {
				return
			}
			since = e.Seq
		}
		since = max(since, out.NextSince)
		note := ""
		if out.Dropped > 0 {
			note = fmt.Sprintf("%d older events were dropped (the log is bounded)", out.Dropped)
		}
		if !send("status", "job_status", map[string]any{"Status": out.Status, "ExitCode": out.ExitCode, "Note": note}, 0) {
			return
		}
		if out.Status != "running" && !out.More {
			send("done", "empty", nil, 0)
			return
		}
		if len(out.Output) > 0 && !out.More && !pause(jobPollInterval) {
			return
		}
	}
}

func (c *Console) jobStdin(w http.ResponseWriter, r *http.Request) {
	if !readForm(w, r) {
		c.errorPage(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	input := r.PostForm.Get("input")
	if r.PostForm.Get("newline") != "off" {
		input += "\n"
	}
	args := map[string]any{"execution_id": r.PathValue("id"), "input_data": input, "close": r.PostForm.Get("close") == "on"}
	if _, err := c.tools.call(r.Context(), principal(r), "send_stdin", args, callOpts{}); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "notice", "Sent.")
}

func (c *Console) jobCancel(w http.ResponseWriter, r *http.Request) {
	args := map[string]any{"execution_id": r.PathValue("id"), "force": r.FormValue("force") == "on"}
	var info jobInfo
	if err := c.tools.callJSON(r.Context(), principal(r), "cancel_execution", args, &info); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "notice", "Execution "+info.ID+": "+info.Status+".")
}
