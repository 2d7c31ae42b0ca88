package tools

import (
	"context"
	"database/sql"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"
	"github.com/rs/zerolog"
	_ "modernc.org/sqlite"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// consoleHarness runs the console's tools through the real chain, with a
// real audit log and quota store (no sandbox backend: sessions, jobs and
// projects are absent).
type consoleHarness struct {
	t        *testing.T
	root     string
	log      *audit.Log
	keys     audit.Keys
	handlers map[string]server.ToolHandlerFunc
}

var (
	consoleAdmin = identity.Principal{ID: "ops", Tier: quota.TierPro, Admin: true}
	consoleUser  = identity.Principal{ID: "alice", Tier: quota.TierPro}
)

func newConsoleHarness(t *testing.T) *consoleHarness {
	t.Helper()
	ctx := context.Background()
	root := t.TempDir()
	keys, err := audit.LoadKeys(audit.KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	paths := []string{filepath.Join(root, "audit.db"), filepath.Join(root, "audit.checkpoints")}
	alog, err := audit.Open(ctx, audit.Options{Path: paths[0], CheckpointPath: paths[1], Keys: keys, CheckpointInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { alog.Close() })
	store, err := quota.Open(ctx, filepath.Join(root, "state.db"), time.Now)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	limits := func(identity.Principal) quota.Limits { return quota.Limits{CallsPerMinute: 10000} }
	ts := ConsoleToolset(&Console{
		Audit: &AuditDesk{Path: paths[0], CheckpointPath: paths[1], Verifier: keys.Verifier,
			Verify: func(ctx context.Context) (audit.VerifyReport, error) {
				return audit.Verify(ctx, audit.VerifyOptions{Path: paths[0], CheckpointPath: paths[1], Keys: keys})
			}},
		Usage: store, Limits: limits,
		Principals: func() []identity.Principal { return []identity.Principal{consoleAdmin, consoleUser} },
		Decisions: func() []Decision {
			return []Decision{{Source: "egress", Action: "denied", Subject: "evil.example:443"}}
		},
	}).Tools(false)
	specs := map[string]middleware.ArgSpec{}
	for _, st := range ts {
		specs[st.Tool.Name] = st.Args
	}
	mws := middleware.Chain(middleware.Deps{
		Specs:    func(n string) (middleware.ArgSpec, bool) { s, ok := specs[n]; return s, ok },
		Limits:   limits,
		Limiter:  store,
		Audit:    alog,
		Metrics:  middleware.NewMetrics(),
		Redactor: redact.New(nil, []string{root}),
		Log:      zerolog.Nop(),
	})
	h := &consoleHarness{t: t, root: root, log: alog, keys: keys, handlers: map[string]server.ToolHandlerFunc{}}
	for _, st := range ts {
		fn := st.Handler
		for i := len(mws) - 1; i >= 0; i-- {
			fn = mws[i](fn)
		}
		h.handlers[st.Tool.Name] = fn
	}
	return h
}

func (h *consoleHarness) call(ctx context.Context, p identity.Principal, tool string, args any) *mcp.CallToolResult {
	h.t.Helper()
	raw, _ := json.Marshal(args)
	var req mcp.CallToolRequest
	req.Params.Name = tool
	req.Params.RawArguments = raw
	res, err := h.handlers[tool](identity.WithPrincipal(ctx, p), req)
	if err != nil || res == nil {
		h.t.Fatalf("%s: chain returned %v, %v", tool, res, err)
	}
	return res
}

func (h *consoleHarness) decode(res *mcp.CallToolResult, v any) {
	h.t.Helper()
	if res.IsError {
		h.t.Fatalf("tool error: %v", structured(h.t, res))
	}
	b, _ := json.Marshal(res.StructuredContent)
	if err := json.Unmarshal(b, v); err != nil {
		h.t.Fatal(err)
	}
}

// fill writes n calls' rows (intent and outcome) for principal.
func (h *consoleHarness) fill(principal, tool string, n int) {
	h.t.Helper()
	for i := range n {
		id := principal + "-" + tool + "-" + string(rune('a'+i))
		for _, r := range []audit.Record{
			{CallID: id, Phase: audit.PhaseIntent, Principal: principal, Tool: tool},
			{CallID: id, Phase: audit.PhaseOutcome, Principal: principal, Tool: tool, Outcome: audit.OutcomeSuccess},
		} {
			if _, err := h.log.Append(context.Background(), r); err != nil {
				h.t.Fatal(err)
			}
		}
	}
}

// TestConsoleToolsRefuseNonAdmins: every admin tool refuses a principal
// not marked admin with PERMISSION_DENIED, and each refusal is an audit
// row (outcome denied) naming the principal and the tool.
func TestConsoleToolsRefuseNonAdmins(t *testing.T) {
	h := newConsoleHarness(t)
	ctx := WithRowSink(context.Background(), func(audit.Entry) error { return nil })
	args := map[string]any{
		"console.audit_record":     map[string]any{"seq": 1},
		"console.close_session":    map[string]any{"principal": "ops", "session_id": "sess_1"},
		"console.cancel_execution": map[string]any{"principal": "ops", "execution_id": "exec_1"},
	}
	admin := 0
	for name := range h.handlers {
		if name == "console.my_sessions" {
			continue
		}
		admin++
		wantToolError(t, h.call(ctx, consoleUser, name, args[name]), brokererr.PermissionDenied, "for admins")
		rows, err := audit.Query(ctx, filepath.Join(h.root, "audit.db"), audit.Filter{Principal: "alice", Tool: name}, 0, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(rows.Entries) != 2 || rows.Entries[0].Outcome != audit.OutcomeDenied || rows.Entries[0].ErrorCode != string(brokererr.PermissionDenied) {
			t.Errorf("%s: rows %+v", name, rows.Entries)
		}
	}
	if admin != 9 {
		t.Fatalf("%d admin tools", admin)
	}
}

// TestConsoleAuditQueryRecordAndState: the desk's queries through the
// chain, what the admin searched for recorded in clear in its own row.
func TestConsoleAuditQueryRecordAndState(t *testing.T) {
	h := newConsoleHarness(t)
	ctx := context.Background()
	h.fill("alice", "run_code", 3)
	h.fill("bob", "run_code", 2)
	var page audit.Page
	h.decode(h.call(ctx, consoleAdmin, "console.audit_query", map[string]any{"principal": "alice", "tool": "run_code", "limit": 4}), &page)
	if len(page.Entries) != 4 || page.Before == 0 {
		t.Fatalf("page %+v", page)
	}
	for _, e := range page.Entries {
		if e.Principal != "alice" || e.Tool != "run_code" {
			t.Fatalf("row %+v", e)
		}
	}
	var next audit.Page
	h.decode(h.call(ctx, consoleAdmin, "console.audit_query", map[string]any{"principal": "alice", "before": page.Before}), &next)
	if len(next.Entries) != 2 || next.Entries[0].Seq >= page.Entries[3].Seq {
		t.Fatalf("next page %+v", next)
	}
	// The query's own row records the filter.
	own, _ := audit.Query(ctx, filepath.Join(h.root, "audit.db"), audit.Filter{Principal: "ops", Tool: "console.audit_query"}, 0, 1)
	if p := string(own.Entries[0].Params); own.Entries[0].Phase != audit.PhaseOutcome {
		t.Fatalf("own row %+v", own.Entries[0])
	} else if intent, _ := audit.Query(ctx, filepath.Join(h.root, "audit.db"), audit.Filter{CallID: own.Entries[0].CallID, Tool: "console.audit_query"}, 0, 2); !strings.Contains(string(intent.Entries[1].Params), `"principal":"alice"`) {
		t.Fatalf("the query's intent row does not record its filter: %s %s", p, intent.Entries[1].Params)
	}

	var rec AuditRecord
	h.decode(h.call(ctx, consoleAdmin, "console.audit_record", map[string]any{"seq": 1}), &rec)
	if rec.Row.Seq != 1 || len(rec.Row.Leaf) != 64 || len(rec.Call) != 1 || rec.Call[0].Seq != 2 {
		t.Fatalf("record %+v", rec)
	}
	wantToolError(t, h.call(ctx, consoleAdmin, "console.audit_record", map[string]any{"seq": 9999}), brokererr.InvalidInput, "no row 9999")
	wantToolError(t, h.call(ctx, consoleAdmin, "console.audit_query", map[string]any{"since": "yesterday"}), brokererr.InvalidInput, "since")

	var st AuditState
	h.decode(h.call(ctx, consoleAdmin, "console.audit_state", nil), &st)
	if st.LastSeq < 10 || st.LastVerification != nil {
		t.Fatalf("state %+v", st)
	}
}

// TestConsoleVerifyFindsABreak: "verify now" runs the CLI's verifier; a
// row edited behind the log's back is reported with its seq, and the
// state remembers the result.
func TestConsoleVerifyFindsABreak(t *testing.T) {
	h := newConsoleHarness(t)
	ctx := context.Background()
	h.fill("alice", "run_code", 4)
	var v Verification
	h.decode(h.call(ctx, consoleAdmin, "console.audit_verify", nil), &v)
	if !v.Report.OK || v.Report.Rows < 8 {
		t.Fatalf("sound log: %+v", v.Report)
	}
	db, err := sql.Open("sqlite", filepath.Join(h.root, "audit.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for _, q := range []string{"DROP TRIGGER audit_no_update", "UPDATE audit SET principal = 'mallory' WHERE seq = 5"} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	h.decode(h.call(ctx, consoleAdmin, "console.audit_verify", nil), &v)
	if v.Report.OK || v.Report.FirstBadSeq != 5 || !strings.Contains(v.Report.Problem, "mac mismatch") {
		t.Fatalf("tampered log: %+v", v.Report)
	}
	var st AuditState
	h.decode(h.call(ctx, consoleAdmin, "console.audit_state", nil), &st)
	if st.LastVerification == nil || st.LastVerification.Report.FirstBadSeq != 5 {
		t.Fatalf("state after verify %+v", st)
	}
}

// TestConsoleExportAndTailStream: export streams every matching row to
// the sink (and refuses without one); tail streams rows committed after
// it started, until its context ends.
func TestConsoleExportAndTailStream(t *testing.T) {
	h := newConsoleHarness(t)
	h.fill("alice", "run_code", 2)
	h.fill("bob", "get_usage", 1)
	wantToolError(t, h.call(context.Background(), consoleAdmin, "console.audit_export", nil), brokererr.InvalidInput, "web console")

	var got []audit.Entry
	ctx := WithRowSink(context.Background(), func(e audit.Entry) error { got = append(got, e); return nil })
	var res StreamResult
	h.decode(h.call(ctx, consoleAdmin, "console.audit_export", map[string]any{"principal": "alice"}), &res)
	if res.Rows != 4 || len(got) != 4 || got[0].Seq != 1 || got[3].Seq != 4 {
		t.Fatalf("export %+v, rows %d", res, len(got))
	}

	tctx, cancel := context.WithCancel(context.Background())
	rows := make(chan audit.Entry, 10)
	tctx = WithRowSink(tctx, func(e audit.Entry) error { rows <- e; return nil })
	done := make(chan *mcp.CallToolResult, 1)
	go func() {
		done <- h.call(tctx, consoleAdmin, "console.audit_tail", map[string]any{"principal": "bob", "after_seq": 6})
	}()
	h.fill("alice", "run_code", 1)
	h.fill("bob", "get_usage", 1) // the rows the tail should see
	for range 2 {
		select {
		case e := <-rows:
			if e.Principal != "bob" || e.Seq <= 6 {
				t.Fatalf("tail row %+v", e)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("tail delivered nothing")
		}
	}
	cancel()
	if r := <-done; r.IsError {
		t.Fatalf("tail ended with %v", structured(t, r))
	}
}

// TestConsoleToolsAreNotOnTransports: no console tool is in the group
// the MCP transports serve, so no model can call one.
func TestConsoleToolsAreNotOnTransports(t *testing.T) {
	all, err := DefaultGroup(Deps{}).Enable([]string{"all"}, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range all {
		if strings.HasPrefix(st.Tool.Name, ToolsetConsole+".") {
			t.Errorf("%s is served to MCP clients", st.Tool.Name)
		}
	}
	for _, st := range ConsoleToolset(&Console{}).Tools(false) {
		if !strings.HasPrefix(st.Tool.Name, ToolsetConsole+".") {
			t.Errorf("console tool %s is not named console.*", st.Tool.Name)
		}
	}
}
