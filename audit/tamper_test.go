package audit

import (
	"context"
	"crypto/rand"
	"database/sql"
	"errors"
	"os"
	"strings"
	"testing"

	"golang.org/x/mod/sumdb/note"
)

// tampered builds a closed log of n rows with a checkpoint every cpEvery rows
// (and at n), then hands the attacker a raw connection without triggers.
func tampered(t *testing.T, n, cpEvery int) (*fixture, *sql.DB) {
	t.Helper()
	return tamperedOn(t, newFixture, n, cpEvery)
}

// tamperedOn is tampered on the store newFixture makes.
func tamperedOn(t *testing.T, newFixture func(testing.TB) *fixture, n, cpEvery int) (*fixture, *sql.DB) {
	t.Helper()
	f := newFixture(t)
	f.opts.CheckpointEvery = cpEvery
	l := f.open(t)
	fill(t, l, n)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if rep := f.verify(t); !rep.OK {
		t.Fatalf("clean log does not verify: %+v", rep)
	}
	db := rawDB(t, f.opts.Path)
	dropTriggers(t, db)
	return f, db
}

func wantBad(t *testing.T, rep VerifyReport, seq int64, problem string) {
	t.Helper()
	if rep.OK || rep.FirstBadSeq != seq || !strings.Contains(rep.Problem, problem) {
		t.Fatalf("report %+v, want FirstBadSeq %d and problem %q", rep, seq, problem)
	}
}

// wantOpenRefused checks the writer refuses to continue a tampered log.
func wantOpenRefused(t *testing.T, f *fixture) {
	t.Helper()
	l, err := Open(context.Background(), f.opts)
	if err == nil {
		l.Close()
		t.Fatal("Open accepted a tampered log")
	}
	if !errors.Is(err, ErrIntegrity) {
		t.Fatalf("Open: %v, want ErrIntegrity", err)
	}
}

// Case 47: edit a row's logical column.
func TestTamperEditRow(t *testing.T) { eachStore(t, testTamperEditRow) }

func testTamperEditRow(t *testing.T, newFixture func(testing.TB) *fixture) {
	for _, col := range []string{"principal", "tool", "call_id", "phase", "outcome", "error_code", "ts"} {
		t.Run(col, func(t *testing.T) {
			f, db := tamperedOn(t, newFixture, 20, 8)
			mustExec(t, db, "UPDATE audit SET "+col+" = 'x' || "+col+" WHERE seq = 11")
			wantBad(t, f.verify(t), 11, "mac mismatch")
		})
	}
	t.Run("params", func(t *testing.T) {
		f, db := tamperedOn(t, newFixture, 20, 8)
		mustExec(t, db, `UPDATE audit SET params = '{"cmd":"rm -rf /"}' WHERE seq = 4`)
		wantBad(t, f.verify(t), 4, "mac mismatch")
	})
	t.Run("params whitespace", func(t *testing.T) {
		f, db := tamperedOn(t, newFixture, 20, 8)
		mustExec(t, db, `UPDATE audit SET params = ' ' || params WHERE seq = 4`)
		wantBad(t, f.verify(t), 4, "mac mismatch")
	})
	t.Run("duration", func(t *testing.T) {
		f, db := tamperedOn(t, newFixture, 20, 8)
		mustExec(t, db, "UPDATE audit SET duration_ms = duration_ms + 1 WHERE seq = 20")
		wantBad(t, f.verify(t), 20, "mac mismatch")
		wantOpenRefused(t, f)
	})
	t.Run("mac", func(t *testing.T) {
		f, db := tamperedOn(t, newFixture, 20, 8)
		mustExec(t, db, "UPDATE audit SET mac = ? WHERE seq = 1", make([]byte, 32))
		wantBad(t, f.verify(t), 1, "mac mismatch")
	})
	t.Run("leaf column only", func(t *testing.T) {
		f, db := tamperedOn(t, newFixture, 20, 8)
		mustExec(t, db, "UPDATE audit SET leaf = ? WHERE seq = 9", make([]byte, 32))
		wantBad(t, f.verify(t), 9, "leaf mismatch")
	})
	t.Run("prev_mac column only", func(t *testing.T) {
		f, db := tamperedOn(t, newFixture, 20, 8)
		mustExec(t, db, "UPDATE audit SET prev_mac = ? WHERE seq = 9", make([]byte, 32))
		wantBad(t, f.verify(t), 9, "prev_mac mismatch")
	})
	t.Run("kid", func(t *testing.T) {
		f, db := tamperedOn(t, newFixture, 20, 8)
		mustExec(t, db, "UPDATE audit SET kid = 'deadbeef' WHERE seq = 13")
		wantBad(t, f.verify(t), 13, "unknown kid")
	})
}

func TestTamperDeleteMiddleRow(t *testing.T) { eachStore(t, testTamperDeleteMiddleRow) }

func testTamperDeleteMiddleRow(t *testing.T, newFixture func(testing.TB) *fixture) {
	f, db := tamperedOn(t, newFixture, 20, 8)
	mustExec(t, db, "DELETE FROM audit WHERE seq = 12")
	rep := f.verify(t)
	wantBad(t, rep, 12, "missing row (gap)")
	if rep.Rows != 19 {
		t.Errorf("Rows = %d", rep.Rows)
	}
}

func TestTamperDeleteFirstRow(t *testing.T) {
	f, db := tampered(t, 5, 8)
	mustExec(t, db, "DELETE FROM audit WHERE seq = 1")
	wantBad(t, f.verify(t), 1, "missing row (gap)")
}

// A forged row in the middle, later rows renumbered to make room.
func TestTamperInsertRenumber(t *testing.T) {
	f, db := tampered(t, 20, 8)
	mustExec(t, db, "UPDATE audit SET seq = -seq WHERE seq >= 7")
	mustExec(t, db, "UPDATE audit SET seq = -seq + 1 WHERE seq < 0")
	mustExec(t, db, `INSERT INTO audit SELECT 7, ts, 'forged', phase, 'admin', tool, params, outcome,
		error_code, duration_ms, leaf, prev_mac, mac, kid,
		body_version, transport, client_addr, user_agent, mcp_session, toolset FROM audit WHERE seq = 8`)
	wantBad(t, f.verify(t), 7, "mac mismatch")
}

// A forged row at the end is caught at its own seq, and Open refuses it.
func TestTamperAppendForged(t *testing.T) { eachStore(t, testTamperAppendForged) }

func testTamperAppendForged(t *testing.T, newFixture func(testing.TB) *fixture) {
	f, db := tamperedOn(t, newFixture, 10, 8)
	mustExec(t, db, `INSERT INTO audit SELECT 11, ts, call_id, phase, principal, tool, params, outcome,
		error_code, duration_ms, leaf, mac, mac, kid,
		body_version, transport, client_addr, user_agent, mcp_session, toolset FROM audit WHERE seq = 10`)
	wantBad(t, f.verify(t), 11, "mac mismatch")
	wantOpenRefused(t, f)
}

func TestTamperSequenceOutOfOrder(t *testing.T) {
	f, db := tampered(t, 5, 8)
	mustExec(t, db, "UPDATE audit SET seq = 0 WHERE seq = 1")
	wantBad(t, f.verify(t), 1, "sequence out of order")
}

// Case 48: drop the last rows below the last checkpoint.
func TestTamperTruncate(t *testing.T) { eachStore(t, testTamperTruncate) }

func testTamperTruncate(t *testing.T, newFixture func(testing.TB) *fixture) {
	f, db := tamperedOn(t, newFixture, 20, 8) // checkpoints at 8, 16, 20
	mustExec(t, db, "DELETE FROM audit WHERE seq > 17")
	rep := f.verify(t)
	wantBad(t, rep, 18, "truncated below checkpoint (size 20, rows 17)")
	if rep.Rows != 17 || rep.Checkpoints != 3 {
		t.Errorf("report %+v", rep)
	}
	wantOpenRefused(t, f)
}

// Truncating back exactly to an older checkpoint is still caught by the
// newer one.
func TestTamperTruncateToOldCheckpoint(t *testing.T) {
	f, db := tampered(t, 20, 8)
	mustExec(t, db, "DELETE FROM audit WHERE seq > 16")
	wantBad(t, f.verify(t), 17, "truncated below checkpoint (size 20, rows 16)")
}

// Case 48: the whole database is gone but the checkpoint file is not.
func TestTamperDeleteDatabase(t *testing.T) {
	f, db := tampered(t, 10, 4)
	db.Close()
	for _, suffix := range []string{"", "-wal", "-shm"} {
		if err := os.Remove(f.opts.Path + suffix); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	rep := f.verify(t)
	wantBad(t, rep, 1, "truncated below checkpoint (size 10, rows 0)")
	if _, err := os.Stat(f.opts.Path); !os.IsNotExist(err) {
		t.Fatalf("Verify created the database: %v", err)
	}
	// Recreating an empty log over the old checkpoints is refused too.
	wantOpenRefused(t, f)
}

// Without a database and without checkpoints there is nothing to compare:
// that is an I/O error, not a report.
func TestVerifyMissingEverything(t *testing.T) {
	f := newFixture(t)
	_, err := Verify(context.Background(), VerifyOptions{Path: f.opts.Path, CheckpointPath: f.opts.CheckpointPath, Keys: f.keys})
	if !errors.Is(err, ErrNoDatabase) {
		t.Fatalf("Verify: %v", err)
	}
}

// Case 49: the attacker has the HMAC key and rewrites the chain from row 6
// on, but cannot sign checkpoints.
func TestTamperRewriteChainWithHMACKey(t *testing.T) { eachStore(t, testTamperRewriteChainWithHMACKey) }

func testTamperRewriteChainWithHMACKey(t *testing.T, newFixture func(testing.TB) *fixture) {
	f, db := tamperedOn(t, newFixture, 20, 8) // checkpoints at 8, 16, 20
	rewriteChain(t, db, f.keys, func(seq int64, r *storedRow) {
		if seq == 6 {
			r.Rec.Principal = "someone-else"
		}
	})
	rep := f.verify(t)
	wantBad(t, rep, 8, "checkpoint root mismatch (size 8; rows 1..8")

	// Changing a row after the first checkpoint is pinned to the next one.
	f, db = tamperedOn(t, newFixture, 20, 8)
	rewriteChain(t, db, f.keys, func(seq int64, r *storedRow) {
		if seq == 19 {
			r.Rec.Tool = "delete_everything"
		}
	})
	wantBad(t, f.verify(t), 20, "checkpoint root mismatch (size 20; rows 17..20")
}

// Open only checks the tail, but that includes the stored tree: a re-MACed
// last row whose leaf no longer matches the tree is refused.
func TestTamperRewriteLastRowWithHMACKey(t *testing.T) {
	f, db := tampered(t, 20, 8)
	rewriteChain(t, db, f.keys, func(seq int64, r *storedRow) {
		if seq == 20 {
			r.Rec.Principal = "someone-else"
		}
	})
	wantBad(t, f.verify(t), 20, "checkpoint root mismatch (size 20; rows 17..20")
	wantOpenRefused(t, f)
}

// Case 49 continued: the attacker also replaces the checkpoint file, signed
// with a key of their own under the same name.
func TestTamperForgedCheckpoints(t *testing.T) {
	f, db := tampered(t, 20, 8)
	rewriteChain(t, db, f.keys, func(seq int64, r *storedRow) {
		if seq == 3 {
			r.Rec.Principal = "someone-else"
		}
	})
	skey, _, err := note.GenerateKey(rand.Reader, KeyName)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := note.NewSigner(skey)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(f.opts.CheckpointPath); err != nil {
		t.Fatal(err)
	}
	for _, stmt := range schemaV1 { // cover tracks
		mustExec(t, db, stmt)
	}
	l, err := Open(context.Background(), Options{Path: f.opts.Path, CheckpointPath: f.opts.CheckpointPath + ".new",
		Keys: Keys{HMACKey: f.keys.HMACKey, Signer: signer, Verifier: verifierFor(t, skey)}, CheckpointInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(f.opts.CheckpointPath+".new", f.opts.CheckpointPath); err != nil {
		t.Fatal(err)
	}
	rep := f.verify(t)
	if rep.OK || !strings.Contains(rep.Problem, "checkpoint signature invalid") || rep.FirstBadSeq != 0 {
		t.Fatalf("report %+v", rep)
	}
	wantOpenRefused(t, f)
}

// An attacker with the HMAC key can backdate, but Verify still sees time
// running backwards.
func TestTamperBackdate(t *testing.T) {
	f, db := tampered(t, 10, 100)
	rewriteChain(t, db, f.keys, func(seq int64, r *storedRow) {
		if seq == 4 {
			r.TS = "2001-01-01T00:00:00Z"
		}
	})
	wantBad(t, f.verify(t), 4, "timestamp went backwards")
}

func TestTamperCheckpointFile(t *testing.T) {
	f, _ := tampered(t, 20, 8)
	data, err := os.ReadFile(f.opts.CheckpointPath)
	if err != nil {
		t.Fatal(err)
	}
	// Lower the size in the second checkpoint without re-signing.
	edited := strings.Replace(string(data), "\n16\n", "\n15\n", 1)
	if edited == string(data) {
		t.Fatal("checkpoint 16 not found")
	}
	if err := os.WriteFile(f.opts.CheckpointPath, []byte(edited), 0o600); err != nil {
		t.Fatal(err)
	}
	rep := f.verify(t)
	if rep.OK || rep.Problem != "checkpoint signature invalid (checkpoint 2)" || rep.Checkpoints != 1 {
		t.Fatalf("report %+v", rep)
	}
	wantOpenRefused(t, f)
}

// rewriteChain recomputes every leaf and MAC with the real HMAC key after
// edit, as an attacker holding K would.
func rewriteChain(t *testing.T, db *sql.DB, k Keys, edit func(int64, *storedRow)) {
	t.Helper()
	rows, err := db.Query(selectRow + " ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	var all []storedRow
	for rows.Next() {
		r, err := scanRow(rows)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, r)
	}
	rows.Close()
	prev := zeroMAC
	for i := range all {
		r := &all[i]
		edit(r.Seq, r)
		leaf, mac, err := r.recompute(k.HMACKey, prev)
		if err != nil {
			t.Fatal(err)
		}
		mustExec(t, db, `UPDATE audit SET ts = ?, principal = ?, tool = ?, leaf = ?, prev_mac = ?, mac = ? WHERE seq = ?`,
			r.TS, r.Rec.Principal, r.Rec.Tool, leaf[:], prev, mac, r.Seq)
		prev = mac
	}
}

func verifierFor(t *testing.T, skey string) note.Verifier {
	t.Helper()
	vk, err := deriveVerifierKey(writeTemp(t, skey))
	if err != nil {
		t.Fatal(err)
	}
	v, err := note.NewVerifier(strings.TrimSpace(string(vk)))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func writeTemp(t *testing.T, s string) string {
	t.Helper()
	p := t.TempDir() + "/key"
	if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Dropping the triggers alone changes no row, but is reported and refused.
func TestTamperDropTriggersOnly(t *testing.T) { eachStore(t, testTamperDropTriggersOnly) }

func testTamperDropTriggersOnly(t *testing.T, newFixture func(testing.TB) *fixture) {
	f, _ := tamperedOn(t, newFixture, 5, 8)
	rep := f.verify(t)
	if rep.OK || rep.FirstBadSeq != 0 || !strings.Contains(rep.Problem, "triggers missing") || rep.Rows != 5 {
		t.Fatalf("report %+v", rep)
	}
	wantOpenRefused(t, f)
}
