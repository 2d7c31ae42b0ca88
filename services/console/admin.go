package console

import (
	"encoding/json"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// The audit desk and the operator view call the console's own tools; a
// non-admin's call is refused by the tool (PERMISSION_DENIED, so 403
// here) and, like every call, leaves an audit row.

// auditFilter reads the desk's filter form. Times come from
// datetime-local inputs and are taken as UTC.
func auditFilter(q url.Values) (map[string]any, url.Values) {
	args := map[string]any{}
	keep := url.Values{}
	for _, k := range []string{"principal", "tool", "outcome", "error_code", "call_id"} {
		if v := strings.TrimSpace(q.Get(k)); v != "" {
			args[k] = v
			keep.Set(k, v)
		}
	}
	for _, k := range []string{"since", "until"} {
		v := strings.TrimSpace(q.Get(k))
		if v == "" {
			continue
		}
		keep.Set(k, v)
		for _, layout := range []string{time.RFC3339, "2006-01-02T15:04:05", "2006-01-02T15:04"} {
			if t, err := time.Parse(layout, v); err == nil {
				v = t.UTC().Format(time.RFC3339)
				break
			}
		}
		args[k] = v // the tool refuses what did not parse
	}
	return args, keep
}

// auditPage is the desk: its filter, the chain state and the first page.
func (c *Console) auditDesk(w http.ResponseWriter, r *http.Request) {
	p := principal(r)
	var st tools.AuditState
	if err := c.admin.callJSON(r.Context(), p, "console.audit_state", nil, &st); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	args, keep := auditFilter(r.URL.Query())
	var pg audit.Page
	if err := c.admin.callJSON(r.Context(), p, "console.audit_query", args, &pg); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	q := keep.Encode()
	// Built from a constant path and an encoded query, so safe as URLs.
	export := template.URL("/console/audit/export?" + q)
	tail := template.URL("/console/audit/tail?" + q + "&after_seq=" + strconv.FormatInt(st.LastSeq, 10))
	c.render(w, r, http.StatusOK, "audit", map[string]any{"State": st, "Page": pg, "Filter": keep, "Query": q, "ExportURL": export, "TailURL": tail})
}

func (c *Console) auditRows(w http.ResponseWriter, r *http.Request) {
	args, keep := auditFilter(r.URL.Query())
	if b, err := strconv.ParseInt(r.URL.Query().Get("before"), 10, 64); err == nil && b > 0 {
		args["before"] = b
	}
	var pg audit.Page
	if err := c.admin.callJSON(r.Context(), principal(r), "console.audit_query", args, &pg); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "audit_rows", map[string]any{"Page": pg, "Query": keep.Encode(), "More": r.URL.Query().Get("before") != ""})
}

func (c *Console) auditRecord(w http.ResponseWriter, r *http.Request) {
	seq, err := strconv.ParseInt(r.PathValue("seq"), 10, 64)
	if err != nil || seq < 1 {
		c.errorPage(w, r, http.StatusBadRequest, "Not a sequence number.")
		return
	}
	var rec tools.AuditRecord
	if err := c.admin.callJSON(r.Context(), principal(r), "console.audit_record", map[string]any{"seq": seq}, &rec); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "audit_record", rec)
}

func (c *Console) auditState(w http.ResponseWriter, r *http.Request) {
	var st tools.AuditState
	if err := c.admin.callJSON(r.Context(), principal(r), "console.audit_state", nil, &st); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "audit_state", st)
}

func (c *Console) auditVerify(w http.ResponseWriter, r *http.Request) {
	var v tools.Verification
	if err := c.admin.callJSON(r.Context(), principal(r), "console.audit_verify", nil, &v); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	var st tools.AuditState
	if err := c.admin.callJSON(r.Context(), principal(r), "console.audit_state", nil, &st); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "audit_state", st)
}

// auditExport downloads the filtered rows as NDJSON, streamed by
// console.audit_export as it reads them.
func (c *Console) auditExport(w http.ResponseWriter, r *http.Request) {
	args, _ := auditFilter(r.URL.Query())
	enc := json.NewEncoder(w)
	started := false
	sink := func(e audit.Entry) error {
		if !started {
			started = true
			h := w.Header()
			h.Set("Content-Type", "application/x-ndjson")
			h.Set("Content-Disposition", fmt.Sprintf(`attachment; filename="audit-%s.ndjson"`, c.d.Now().UTC().Format("20060102T150405Z")))
			w.WriteHeader(http.StatusOK)
		}
		return enc.Encode(e)
	}
	_, err := c.admin.call(tools.WithRowSink(r.Context(), sink), principal(r), "console.audit_export", args, callOpts{})
	switch {
	case err != nil && !started:
		c.toolFailed(w, r, err)
	case err != nil:
		c.d.Log.Warn().Msg("console_export_cut")
	case !started: // no rows: an empty file
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.WriteHeader(http.StatusOK)
	}
}

// auditTail streams rows as they are committed over SSE: one
// console.audit_tail call, open as long as the browser reads.
func (c *Console) auditTail(w http.ResponseWriter, r *http.Request) {
	args, _ := auditFilter(r.URL.Query())
	after, _ := strconv.ParseInt(r.URL.Query().Get("after_seq"), 10, 64)
	if id := lastEventID(r); id > 0 {
		after = id
	}
	if after > 0 {
		args["after_seq"] = after
	}
	s := startSSE(w)
	ctx := r.Context()
	sink := func(e audit.Entry) error {
		body, err := c.fragment("audit_row", e)
		if err != nil {
			return err
		}
		return s.send(sseEvent{ID: e.Seq, Name: "row", Data: body})
	}
	// Pings while no row comes, so a dead browser ends the call.
	stop, stopped := make(chan struct{}), make(chan struct{})
	defer func() { close(stop); <-stopped }() // no write after the handler returns
	go func() {
		defer close(stopped)
		t := time.NewTicker(keepAlive)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			_ = s.ping()
		}
	}()
	_, err := c.admin.call(tools.WithRowSink(ctx, sink), principal(r), "console.audit_tail", args, callOpts{})
	if err != nil && ctx.Err() == nil {
		if body, ferr := c.fragment("error", map[string]any{"Message": callMessage(err)}); ferr == nil {
			_ = s.send(sseEvent{Name: "tail_error", Data: body})
		}
		_ = s.send(sseEvent{Name: "done"})
	}
}

func (c *Console) operator(w http.ResponseWriter, r *http.Request) {
	var o tools.Overview
	if err := c.admin.callJSON(r.Context(), principal(r), "console.operator_overview", nil, &o); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.render(w, r, http.StatusOK, "operator", o)
}

func (c *Console) operatorCloseSession(w http.ResponseWriter, r *http.Request) {
	if !readForm(w, r) {
		c.errorPage(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	args := map[string]any{"principal": r.PostForm.Get("principal"), "session_id": r.PostForm.Get("session_id")}
	if _, err := c.admin.call(r.Context(), principal(r), "console.close_session", args, callOpts{}); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "notice", "Closed session "+r.PostForm.Get("session_id")+" of "+r.PostForm.Get("principal")+".")
}

func (c *Console) operatorCancel(w http.ResponseWriter, r *http.Request) {
	if !readForm(w, r) {
		c.errorPage(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	args := map[string]any{"principal": r.PostForm.Get("principal"), "execution_id": r.PostForm.Get("execution_id"), "force": r.PostForm.Get("force") == "on"}
	var out struct {
		Status string `json:"status"`
	}
	if err := c.admin.callJSON(r.Context(), principal(r), "console.cancel_execution", args, &out); err != nil {
		c.toolFailed(w, r, err)
		return
	}
	c.writeFragment(w, http.StatusOK, "notice", "Execution "+r.PostForm.Get("execution_id")+": "+out.Status+".")
}
