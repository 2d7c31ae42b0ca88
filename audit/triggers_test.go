package audit

import (
	"context"
	"fmt"
	"strings"
	"testing"
)

// Case 46: through the app's own connection every rewrite is aborted.
func TestTriggersBlockRewrites(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	fill(t, l, 3)
	ctx := context.Background()

	// synchronous=NORMAL: the writer fsyncs the WAL itself (see
	// TestAppendReturnsOnceDurable).
	for pragma, want := range map[string]int{"recursive_triggers": 1, "synchronous": 1, "trusted_schema": 0} {
		var got int
		if err := l.db.QueryRowContext(ctx, "PRAGMA "+pragma).Scan(&got); err != nil || got != want {
			t.Errorf("PRAGMA %s = %d (%v), want %d", pragma, got, err, want)
		}
	}
	var mode string
	if err := l.db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil || mode != "wal" {
		t.Errorf("journal_mode = %q (%v)", mode, err)
	}

	before := snapshot(t, l)
	var mac2 []byte
	if err := l.db.QueryRowContext(ctx, "SELECT mac FROM audit WHERE seq = 2").Scan(&mac2); err != nil {
		t.Fatal(err)
	}
	cols := `(seq, ts, call_id, phase, principal, tool, params, outcome, error_code, duration_ms, leaf, prev_mac, mac, kid)`
	attacks := []struct {
		name, sql, wantErr string
		args               []any
	}{
		{"update", "UPDATE audit SET principal = 'mallory' WHERE seq = 2", "append-only", nil},
		{"delete", "DELETE FROM audit WHERE seq = 3", "append-only", nil},
		{"delete all", "DELETE FROM audit", "append-only", nil},
		{"insert or replace", "INSERT OR REPLACE INTO audit" + cols + " SELECT seq, ts, call_id, phase, 'mallory', tool, params, outcome, error_code, duration_ms, leaf, prev_mac, mac, kid FROM audit WHERE seq = 2", "", nil},
		{"replace", "REPLACE INTO audit" + cols + " SELECT seq, ts, call_id, phase, 'mallory', tool, params, outcome, error_code, duration_ms, leaf, prev_mac, mac, kid FROM audit WHERE seq = 2", "", nil},
		{"upsert", "INSERT INTO audit" + cols + " SELECT seq, ts, call_id, phase, principal, tool, params, outcome, error_code, duration_ms, leaf, prev_mac, mac, kid FROM audit WHERE seq = 2 ON CONFLICT(seq) DO UPDATE SET principal = 'mallory'", "", nil},
		{"wrong seq", "INSERT INTO audit" + cols + " SELECT 7, ts, call_id, phase, principal, tool, params, outcome, error_code, duration_ms, leaf, mac, mac, kid FROM audit WHERE seq = 3", "chain violation", nil},
		{"wrong prev_mac", "INSERT INTO audit" + cols + " SELECT 4, ts, call_id, phase, principal, tool, params, outcome, error_code, duration_ms, leaf, ?, mac, kid FROM audit WHERE seq = 3", "chain violation", []any{mac2}},
		{"null prev_mac", "INSERT INTO audit" + cols + " SELECT 4, ts, call_id, phase, principal, tool, params, outcome, error_code, duration_ms, leaf, NULL, mac, kid FROM audit WHERE seq = 3", "", nil},
		{"tree update", "UPDATE audit_tree SET hash = zeroblob(32) WHERE idx = 0", "append-only", nil},
		{"tree delete", "DELETE FROM audit_tree", "append-only", nil},
		{"writable_schema", "PRAGMA writable_schema = ON", "", nil},
	}
	for _, a := range attacks {
		_, err := l.db.ExecContext(ctx, a.sql, a.args...)
		if a.name == "writable_schema" {
			// Defensive mode turns the pragma into a no-op rather than an error.
			var on int
			if err := l.db.QueryRowContext(ctx, "PRAGMA writable_schema").Scan(&on); err != nil || on != 0 {
				t.Errorf("writable_schema = %d (%v), want 0", on, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("%s: succeeded", a.name)
			continue
		}
		if a.wantErr != "" && !strings.Contains(err.Error(), a.wantErr) {
			t.Errorf("%s: error %v, want %q", a.name, err, a.wantErr)
		}
	}
	if after := snapshot(t, l); after != before {
		t.Fatalf("table changed:\n%s\n--\n%s", before, after)
	}
	// The chain is still writable by the app.
	if _, err := l.Append(ctx, testRecord(3)); err != nil {
		t.Fatalf("Append after attacks: %v", err)
	}
}

// The implicit delete of REPLACE fires DELETE triggers only with
// recursive_triggers; prove the pragma, not just the chain trigger, blocks it.
func TestReplaceBlockedByRecursiveTriggers(t *testing.T) {
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	fill(t, l, 2)
	ctx := context.Background()
	if _, err := l.db.ExecContext(ctx, "DROP TRIGGER audit_chain"); err != nil {
		t.Fatal(err)
	}
	_, err := l.db.ExecContext(ctx, `REPLACE INTO audit SELECT seq, ts, call_id, phase, 'mallory', tool, params,
		outcome, error_code, duration_ms, leaf, prev_mac, mac, kid,
		body_version, transport, client_addr, user_agent, mcp_session, toolset FROM audit WHERE seq = 1`)
	if err == nil || !strings.Contains(err.Error(), "append-only") {
		t.Fatalf("REPLACE without chain trigger: %v", err)
	}
}

func snapshot(t *testing.T, l *Log) string {
	t.Helper()
	rows, err := l.db.Query("SELECT seq, principal, hex(mac), hex(prev_mac) FROM audit ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var seq int64
		var p, m, pm string
		if err := rows.Scan(&seq, &p, &m, &pm); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "%d,%s,%s,%s\n", seq, p, m, pm)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return b.String()
}
