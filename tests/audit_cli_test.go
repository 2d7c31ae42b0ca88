package tests

import (
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	_ "modernc.org/sqlite"
)

// auditFixture makes a real audit log of n calls (2n rows) by driving a
// broker, then stops it so the files can be tampered with.
func auditFixture(t *testing.T, calls int) string {
	t.Helper()
	b := StartHTTP(t, BrokerOpts{Token: testToken})
	c := b.Client(t, testToken)
	for i := 0; i < calls; i++ {
		callTool(t, c, "get_usage", nil)
	}
	b.Stop(t)
	return b.Root
}

// tamper runs SQL against the audit DB the way an attacker with file access
// would: triggers dropped first.
func tamper(t *testing.T, root string, stmts ...string) {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(root, "audit.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	rows, err := db.Query(`SELECT name, sql FROM sqlite_master WHERE type = 'trigger'`)
	if err != nil {
		t.Fatal(err)
	}
	var names, defs []string
	for rows.Next() {
		var n, d string
		_ = rows.Scan(&n, &d)
		names, defs = append(names, n), append(defs, d)
	}
	rows.Close()
	var all []string
	for _, n := range names {
		all = append(all, "DROP TRIGGER "+n)
	}
	all = append(all, stmts...)
	// Put the triggers back, as a careful attacker would, so only the
	// data change is under test.
	all = append(all, defs...)
	for _, s := range all {
		if _, err := db.Exec(s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
}

func verifyCLI(t *testing.T, root string) (int, string) {
	t.Helper()
	cmd := exec.Command(brokerBin, "audit", "verify")
	cmd.Env = brokerEnv(root, "", nil)
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), string(out)
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, string(out)
}

func TestAuditVerifyCatchesTampering(t *testing.T) {
	cases := []struct {
		name    string
		tamper  func(t *testing.T, root string)
		wantSeq int
	}{
		{"edit principal", func(t *testing.T, root string) {
			tamper(t, root, `UPDATE audit SET principal = 'someone-else' WHERE seq = 3`)
		}, 3},
		{"edit outcome", func(t *testing.T, root string) {
			tamper(t, root, `UPDATE audit SET outcome = 'denied' WHERE seq = 4`)
		}, 4},
		{"delete middle row", func(t *testing.T, root string) {
			tamper(t, root, `DELETE FROM audit WHERE seq = 5`)
		}, 5},
		{"insert forged row", func(t *testing.T, root string) {
			tamper(t, root,
				`UPDATE audit SET seq = -seq WHERE seq >= 3`,
				`UPDATE audit SET seq = 1 - seq WHERE seq < 0`,
				`INSERT INTO audit(seq, ts, call_id, phase, principal, tool, params, outcome, error_code, duration_ms, leaf, prev_mac, mac, kid)
				 SELECT 3, ts, 'call_forged', phase, principal, tool, params, outcome, error_code, duration_ms, leaf, prev_mac, mac, kid FROM audit WHERE seq = 2`,
			)
		}, 3},
		{"truncate tail", func(t *testing.T, root string) {
			tamper(t, root, `DELETE FROM audit WHERE seq > 4`)
		}, 5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := auditFixture(t, 4) // 8 rows, checkpoint at shutdown covers all 8
			if code, out := verifyCLI(t, root); code != 0 || !strings.HasPrefix(out, "OK") {
				t.Fatalf("clean log: exit %d: %s", code, out)
			}
			c.tamper(t, root)
			code, out := verifyCLI(t, root)
			if code == 0 {
				t.Fatalf("tampered log verified OK: %s", out)
			}
			if want := fmt.Sprintf("first bad sequence %d", c.wantSeq); !strings.Contains(out, want) {
				t.Fatalf("output %q does not name %q", out, want)
			}
		})
	}
}

func TestAuditVerifyCatchesDeletedDatabase(t *testing.T) {
	root := auditFixture(t, 2)
	for _, f := range []string{"audit.db", "audit.db-wal", "audit.db-shm"} {
		_ = os.Remove(filepath.Join(root, f))
	}
	code, out := verifyCLI(t, root)
	if code == 0 || !strings.Contains(out, "truncated") {
		t.Fatalf("deleted DB: exit %d: %s", code, out)
	}
}
