package statedb_test

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/jobs"
	"github.com/sandbox-broker/sandbox-broker/services/oauth"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
	"github.com/sandbox-broker/sandbox-broker/services/sessions"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/uids"
)

// unversionedSchema is state.db as brokers made it before schema versions:
// every package's bare CREATE TABLE IF NOT EXISTS, copied verbatim.
const unversionedSchema = `
CREATE TABLE IF NOT EXISTS quota_buckets (
	principal    TEXT    NOT NULL,
	kind         TEXT    NOT NULL,
	window_start INTEGER NOT NULL, -- unix ms of the fixed window (UTC day for execution)
	count        INTEGER NOT NULL, -- requests, or ms for execution_ms
	PRIMARY KEY (principal, kind, window_start)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS quota_buckets_window_start ON quota_buckets (window_start);
CREATE TABLE IF NOT EXISTS quota_reservations (
	id         TEXT    PRIMARY KEY,
	principal  TEXT    NOT NULL,
	ms         INTEGER NOT NULL, -- execution time held
	expires_at INTEGER NOT NULL  -- unix ms; charged in full if still held then
);
CREATE INDEX IF NOT EXISTS quota_reservations_principal ON quota_reservations (principal);
CREATE TABLE IF NOT EXISTS sandbox_uids (
	uid   INTEGER PRIMARY KEY,
	owner TEXT    NOT NULL UNIQUE -- a workspace ID, or a warm-pool container's key
);
CREATE TABLE IF NOT EXISTS sandbox_uid_cursor (
	one  INTEGER PRIMARY KEY CHECK (one = 1),
	next INTEGER NOT NULL -- where the next search for a free uid starts
);
CREATE TABLE IF NOT EXISTS sessions(
		principal TEXT NOT NULL,
		session_id TEXT NOT NULL,
		workspace_id TEXT NOT NULL UNIQUE,
		created_at INTEGER NOT NULL,
		last_used_at INTEGER NOT NULL,
		PRIMARY KEY (principal, session_id));
CREATE TABLE IF NOT EXISTS jobs(
	id TEXT PRIMARY KEY,
	principal TEXT NOT NULL,
	session_id TEXT NOT NULL,
	command TEXT NOT NULL,
	status TEXT NOT NULL,
	exit_code INTEGER,
	signal TEXT NOT NULL DEFAULT '',
	error TEXT NOT NULL DEFAULT '',
	interactive INTEGER NOT NULL,
	network TEXT NOT NULL,
	started_at INTEGER NOT NULL,
	ended_at INTEGER);
CREATE INDEX IF NOT EXISTS jobs_by_principal ON jobs(principal, started_at);
CREATE TABLE IF NOT EXISTS projects(
		id TEXT PRIMARY KEY,
		principal TEXT NOT NULL,
		provider TEXT NOT NULL,
		project_name TEXT NOT NULL,
		template TEXT NOT NULL,
		created_at INTEGER NOT NULL,
		expires_at INTEGER NOT NULL);
		CREATE INDEX IF NOT EXISTS projects_by_principal ON projects(principal);
CREATE TABLE IF NOT EXISTS oauth_clients (
	client_id   TEXT    PRIMARY KEY,
	secret_hash BLOB,              -- NULL for public clients
	metadata    TEXT    NOT NULL,  -- the registered metadata, as echoed
	created_at  INTEGER NOT NULL,  -- unix ms
	used_at     INTEGER NOT NULL DEFAULT 0 -- last token issued; 0 = never
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS oauth_grants (
	grant_id      TEXT    PRIMARY KEY,
	client_id     TEXT    NOT NULL,
	principal     TEXT    NOT NULL,
	scopes        TEXT    NOT NULL,
	audience      TEXT    NOT NULL,
	created_at    INTEGER NOT NULL,
	used_at       INTEGER NOT NULL, -- last token issued
	revoked_at    INTEGER NOT NULL DEFAULT 0,
	revoke_reason TEXT    NOT NULL DEFAULT ''
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS oauth_refresh_tokens (
	token_hash BLOB    PRIMARY KEY,
	grant_id   TEXT    NOT NULL,
	expires_at INTEGER NOT NULL,
	used_at    INTEGER NOT NULL DEFAULT 0 -- rotated; presenting it again is reuse
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS oauth_refresh_tokens_grant ON oauth_refresh_tokens (grant_id);
`

// unversionedRows are live rows of every table, as a running broker leaves
// them (times near now, so no package prunes them on open).
func unversionedRows(now time.Time) string {
	ms := now.UnixMilli()
	return fmt.Sprintf(`
INSERT INTO quota_buckets VALUES ('alice', 'calls', %[1]d, 7), ('alice', 'execution_ms', %[1]d, 1234);
INSERT INTO quota_reservations VALUES ('r1', 'alice', 60000, %[2]d);
INSERT INTO sandbox_uids VALUES (1900000000, '0123456789abcdef0123456789abcdef'), (1900000001, 'pool-abc-1');
INSERT INTO sandbox_uid_cursor VALUES (1, 1900000002);
INSERT INTO sessions VALUES ('alice', 'sess_0123456789ab', '0123456789abcdef0123456789abcdef', %[1]d, %[1]d);
INSERT INTO jobs VALUES ('exec_0123456789abcdef0123456789abcdef', 'alice', 'sess_0123456789ab', 'echo hi', 'exited', 0, '', '', 0, 'none', %[1]d, %[1]d);
INSERT INTO projects VALUES ('prj_1', 'alice', 'local', 'site', 'react', %[1]d, %[2]d);
INSERT INTO oauth_clients VALUES ('client-1', NULL, '{"client_name":"x"}', %[1]d, 0);
INSERT INTO oauth_grants VALUES ('grant-1', 'client-1', 'alice', 'mcp', 'http://127.0.0.1/mcp', %[1]d, %[1]d, 0, '');
INSERT INTO oauth_refresh_tokens VALUES (x'00112233', 'grant-1', %[2]d, 0);
`, ms, ms+3600_000)
}

var tables = []string{"quota_buckets", "quota_reservations", "sandbox_uids", "sandbox_uid_cursor", "sessions",
	"jobs", "projects", "oauth_clients", "oauth_grants", "oauth_refresh_tokens"}

// dump returns every row of every table, as text.
func dump(t *testing.T, db *sql.DB) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, table := range tables {
		rows, err := db.Query(`SELECT * FROM ` + table + ` ORDER BY 1`)
		if err != nil {
			t.Fatalf("%s: %v", table, err)
		}
		cols, _ := rows.Columns()
		for rows.Next() {
			vals := make([]any, len(cols))
			ptrs := make([]any, len(cols))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			if err := rows.Scan(ptrs...); err != nil {
				t.Fatal(err)
			}
			out[table] = append(out[table], fmt.Sprintf("%v", vals))
		}
		rows.Close()
		if len(out[table]) == 0 {
			t.Fatalf("%s is empty", table)
		}
	}
	return out
}

// TestUnversionedStateDBUpgrades: a state.db made before schema versions,
// holding rows in every table, is opened by every package that keeps
// tables in it; each records its schema version, and no row is lost or
// changed.
func TestUnversionedStateDBUpgrades(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	path := filepath.Join(root, "state.db")
	old, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(unversionedSchema + unversionedRows(time.Now())); err != nil {
		t.Fatal(err)
	}
	before := dump(t, old)
	old.Close()
	// jobs step 2 adds the replica column, '' for rows that predate it.
	for i, r := range before["jobs"] {
		before["jobs"][i] = strings.TrimSuffix(r, "]") + " ]"
	}

	var closers []func() error
	q, err := quota.Open(ctx, path, nil)
	if err != nil {
		t.Fatal(err)
	}
	closers = append(closers, q.Close)
	u, err := uids.Open(ctx, path, 1900000000, 1000)
	if err != nil {
		t.Fatal(err)
	}
	closers = append(closers, u.Close)
	s, err := sessions.Open(ctx, sessions.Options{DBPath: path, Root: root})
	if err != nil {
		t.Fatal(err)
	}
	closers = append(closers, func() error { return s.Close(ctx) })
	j, err := jobs.Open(ctx, jobs.Options{DBPath: path, Dir: filepath.Join(root, "jobs")})
	if err != nil {
		t.Fatal(err)
	}
	closers = append(closers, func() error { return j.Close(ctx) })
	p, err := projects.Open(ctx, projects.Options{DBPath: path})
	if err != nil {
		t.Fatal(err)
	}
	closers = append(closers, p.Close)
	o, err := oauth.OpenStore(ctx, path, nil)
	if err != nil {
		t.Fatal(err)
	}
	closers = append(closers, o.Close)
	for _, c := range closers {
		if err := c(); err != nil {
			t.Fatal(err)
		}
	}

	// Read back through statedb itself, as a package opening it would.
	db, err := statedb.Open(ctx, path, statedb.Schema{Component: "upgrade_test", Steps: []string{`SELECT 1`}})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if after := dump(t, db); !reflect.DeepEqual(after, before) {
		t.Fatalf("rows changed by the upgrade:\nbefore %v\nafter  %v", before, after)
	}
	var versions []string
	rows, err := db.Query(`SELECT component || '=' || version FROM schema_versions ORDER BY component`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var v string
		_ = rows.Scan(&v)
		versions = append(versions, v)
	}
	want := "jobs=2 oauth=1 projects=1 quota=2 sessions=1 uids=1 upgrade_test=1"
	if got := strings.Join(versions, " "); got != want {
		t.Fatalf("schema versions %q, want %q", got, want)
	}
}
