package audit

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// v1Log copies testdata/v1, a log the broker wrote before schema version 2
// (six rows, checkpoints at 4 and 6, and its keys), to a temp root. The
// keys were made for this fixture alone and protect nothing; they are kept
// as .fixture files, so that they are not taken for live key files, and
// copied under the names LoadKeys reads.
func v1Log(t *testing.T) *fixture {
	t.Helper()
	root := t.TempDir()
	for src, name := range map[string]string{
		"audit.db":                      "audit.db",
		"audit.checkpoints":             "audit.checkpoints",
		"keys/audit_hmac.fixture":       "keys/audit_hmac.key",
		"keys/audit_checkpoint.fixture": "keys/audit_checkpoint.key",
		"keys/audit_checkpoint.pub":     "keys/audit_checkpoint.pub",
	} {
		b, err := os.ReadFile(filepath.Join("testdata", "v1", src))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(filepath.Join(root, name)), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	k, err := LoadKeys(KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	ts := time.Date(2026, 11, 25, 9, 0, 0, 0, time.UTC)
	return &fixture{dir: root, keys: k, opts: Options{
		Path: filepath.Join(root, "audit.db"), CheckpointPath: filepath.Join(root, "audit.checkpoints"), Keys: k,
		CheckpointInterval: -1, Now: func() time.Time { ts = ts.Add(time.Millisecond); return ts },
	}}
}

func userVersion(t *testing.T, path string) int {
	t.Helper()
	var v int
	if err := rawDB(t, path).QueryRow("PRAGMA user_version").Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

func export(t *testing.T, path string) []map[string]any {
	t.Helper()
	var buf bytes.Buffer
	if err := Export(context.Background(), path, "jsonl", &buf); err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// TestV1LogVerifiesAndUpgrades: a log written before the call's source was
// recorded verifies as it is (readers never migrate), upgrades on Open,
// takes rows with a source, and then verifies old and new rows together;
// the MAC covers the new fields and the body version.
func TestV1LogVerifiesAndUpgrades(t *testing.T) {
	f := v1Log(t)
	before, err := os.ReadFile(f.opts.Path)
	if err != nil {
		t.Fatal(err)
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != 6 || rep.Checkpoints != 2 {
		t.Fatalf("v1 log, unmigrated: %+v", rep)
	}
	if after, _ := os.ReadFile(f.opts.Path); !bytes.Equal(before, after) {
		t.Fatal("verify changed a v1 log")
	}
	old := export(t, f.opts.Path)
	if len(old) != 6 || old[2]["params"].(map[string]any)["path"] != "naïve/日本.txt" {
		t.Fatalf("v1 export: %v", old)
	}
	if _, ok := old[0]["transport"]; ok {
		t.Fatalf("a v1 row exports a transport: %v", old[0])
	}

	l := f.open(t)
	if v := userVersion(t, f.opts.Path); v != schemaVersion {
		t.Fatalf("user_version %d after Open, want %d", v, schemaVersion)
	}
	ua := "curl/8.5\x1b[2J\u202eevil" + strings.Repeat("x", 400)
	src := Source{Transport: "http", ClientAddr: "127.0.0.1:51234", UserAgent: ua, MCPSession: "mcp-session-7f", Toolset: "sandbox"}
	if _, err := l.Append(context.Background(), Record{CallID: "call_7", Phase: PhaseIntent, Principal: "alice",
		Tool: "run_code", Params: json.RawMessage(`{"language":"bash"}`), Source: src}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != 7 || rep.Checkpoints != 3 {
		t.Fatalf("after the upgrade: %+v", rep)
	}
	all := export(t, f.opts.Path)
	last := all[6]
	wantUA := "curl/8.5\uFFFD[2J\uFFFDevil" + strings.Repeat("x", MaxUserAgent-len("curl/8.5\uFFFD[2J\uFFFDevil"))
	if last["transport"] != "http" || last["client_addr"] != "127.0.0.1:51234" || last["mcp_session"] != "mcp-session-7f" ||
		last["toolset"] != "sandbox" || last["user_agent"] != wantUA {
		t.Fatalf("new row exports %v", last)
	}
	if _, ok := all[5]["user_agent"]; ok {
		t.Fatalf("an old row gained a source: %v", all[5])
	}

	// The new columns are covered: editing one, or relabelling an old
	// row as version 2, breaks that row's MAC.
	for _, c := range []struct {
		edit string
		seq  int64
	}{
		{"UPDATE audit SET user_agent = 'innocent' WHERE seq = 7", 7},
		{"UPDATE audit SET toolset = 'files' WHERE seq = 7", 7},
		{"UPDATE audit SET body_version = 2 WHERE seq = 2", 2},
		{"UPDATE audit SET body_version = 1, transport = '', client_addr = '', user_agent = '', mcp_session = '', toolset = '' WHERE seq = 7", 7},
	} {
		g := v1Log(t)
		l := g.open(t)
		if _, err := l.Append(context.Background(), Record{CallID: "call_7", Phase: PhaseIntent, Principal: "alice", Tool: "run_code", Source: src}); err != nil {
			t.Fatal(err)
		}
		l.Close()
		db := rawDB(t, g.opts.Path)
		dropTriggers(t, db)
		mustExec(t, db, c.edit)
		wantBad(t, g.verify(t), c.seq, "mac mismatch")
	}
}

// A log from a newer broker is refused by writer and readers alike.
func TestNewerSchemaRefused(t *testing.T) {
	f := newFixture(t)
	f.open(t).Close()
	mustExec(t, rawDB(t, f.opts.Path), "PRAGMA user_version = 99")
	if l, err := Open(context.Background(), f.opts); err == nil {
		l.Close()
		t.Fatal("Open accepted schema version 99")
	}
	if _, err := Verify(context.Background(), VerifyOptions{Path: f.opts.Path, CheckpointPath: f.opts.CheckpointPath, Keys: f.keys}); err == nil {
		t.Fatal("Verify accepted schema version 99")
	}
}

func TestSourceIsValidated(t *testing.T) {
	if _, err := normalise(Record{Phase: PhaseIntent, Source: Source{Transport: "carrier-pigeon"}}); err == nil {
		t.Fatal("unknown transport accepted")
	}
	r, err := normalise(Record{Phase: PhaseIntent, Source: Source{Transport: "stdio",
		ClientAddr: strings.Repeat("9", 500), MCPSession: "a\u200bb", Toolset: "x\ny", UserAgent: "ok\xff"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(r.ClientAddr) != maxSourceText || r.MCPSession != "a\uFFFDb" || r.Toolset != "x\uFFFDy" || r.UserAgent != "ok\uFFFD" {
		t.Fatalf("normalised source: %+v", r.Source)
	}
}
