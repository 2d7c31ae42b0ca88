package audit

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	_ "modernc.org/sqlite" // registers driver "sqlite"

	"github.com/sandbox-broker/sandbox-broker/services/migrate"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// migrations take audit.db from one schema version, stored in PRAGMA
// user_version, to the next. Append; never edit a released step.
var migrations = migrate.Steps{
	strings.Join(schemaV1, ";\n"),
	// 2: where each call came from. Older rows keep body version 1 and
	// empty sources, and verify as they were written.
	`ALTER TABLE audit ADD COLUMN body_version INTEGER NOT NULL DEFAULT 1;
	ALTER TABLE audit ADD COLUMN transport TEXT NOT NULL DEFAULT '';
	ALTER TABLE audit ADD COLUMN client_addr TEXT NOT NULL DEFAULT '';
	ALTER TABLE audit ADD COLUMN user_agent TEXT NOT NULL DEFAULT '';
	ALTER TABLE audit ADD COLUMN mcp_session TEXT NOT NULL DEFAULT '';
	ALTER TABLE audit ADD COLUMN toolset TEXT NOT NULL DEFAULT ''`,
}

// schemaVersion is the version migrations reach.
var schemaVersion = len(migrations)

// schemaV1 is the first schema. The chain trigger also blocks INSERT OR
// REPLACE (its seq is never max+1), and recursive_triggers=ON on every
// connection makes REPLACE's implicit delete hit audit_no_delete as well.
var schemaV1 = []string{
	`CREATE TABLE IF NOT EXISTS audit(
		seq INTEGER PRIMARY KEY,
		ts TEXT NOT NULL,
		call_id TEXT NOT NULL,
		phase TEXT NOT NULL,
		principal TEXT NOT NULL,
		tool TEXT NOT NULL,
		params TEXT NOT NULL,
		outcome TEXT NOT NULL,
		error_code TEXT NOT NULL,
		duration_ms INTEGER NOT NULL,
		leaf BLOB NOT NULL,
		prev_mac BLOB NOT NULL,
		mac BLOB NOT NULL,
		kid TEXT NOT NULL
	) STRICT`,
	`CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
		BEGIN SELECT RAISE(ABORT, 'audit is append-only'); END`,
	`CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
		BEGIN SELECT RAISE(ABORT, 'audit is append-only'); END`,
	`CREATE TRIGGER IF NOT EXISTS audit_chain BEFORE INSERT ON audit
		WHEN NEW.seq IS NOT (SELECT coalesce(max(seq), 0) + 1 FROM audit)
		  OR NEW.prev_mac IS NOT coalesce((SELECT mac FROM audit ORDER BY seq DESC LIMIT 1), zeroblob(32))
		BEGIN SELECT RAISE(ABORT, 'audit chain violation'); END`,
	// Stored Merkle hashes (tlog.StoredHashes layout) keep appends and
	// checkpoints O(log n). Derived data: Verify never trusts it.
	`CREATE TABLE IF NOT EXISTS audit_tree(
		idx INTEGER PRIMARY KEY,
		hash BLOB NOT NULL
	) STRICT`,
	`CREATE TRIGGER IF NOT EXISTS audit_tree_no_update BEFORE UPDATE ON audit_tree
		BEGIN SELECT RAISE(ABORT, 'audit_tree is append-only'); END`,
	`CREATE TRIGGER IF NOT EXISTS audit_tree_no_delete BEFORE DELETE ON audit_tree
		BEGIN SELECT RAISE(ABORT, 'audit_tree is append-only'); END`,
	`CREATE TRIGGER IF NOT EXISTS audit_tree_dense BEFORE INSERT ON audit_tree
		WHEN NEW.idx IS NOT (SELECT coalesce(max(idx), -1) + 1 FROM audit_tree)
		BEGIN SELECT RAISE(ABORT, 'audit_tree order violation'); END`,
}

// fileURI turns a path into an escaped SQLite file: URI so that characters
// such as '?' or '#' in the path cannot inject URI parameters.
func fileURI(path string, params url.Values) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("audit: %s: %w", path, err)
	}
	u := url.URL{Scheme: "file", Path: filepath.ToSlash(abs), OmitHost: true}
	// url.Values.Encode escapes '(' and ')'; SQLite and the driver both
	// decode the query, so that is harmless.
	return u.String() + "?" + params.Encode(), nil
}

// openDB opens path on one connection, with q and the settings every
// connection gets: recursive triggers, untrusted schema, a busy timeout.
func openDB(path string, q url.Values) (*sql.DB, error) {
	q.Add("_pragma", "recursive_triggers(1)")
	q.Add("_pragma", "trusted_schema(0)")
	q.Set("_busy_timeout", "5000")
	dsn, err := fileURI(path, q)
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("audit: open %s: %w", path, err)
	}
	db.SetMaxOpenConns(1)
	return db, nil
}

// openWriter opens the writer: a PostgreSQL pool when path is a
// DATABASE_URL, else the single SQLite writer connection.
func openWriter(ctx context.Context, path string) (*sql.DB, error) {
	if statedb.IsPostgresURL(path) {
		return openPostgresWriter(ctx, path)
	}
	// Create the file ourselves so it starts at 0600; SQLite gives the -wal
	// and -shm files the database file's permissions.
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("audit: open %s: %w", path, err)
	}
	err = f.Chmod(0o600)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("audit: chmod %s: %w", path, err)
	}
	q := url.Values{}
	q.Set("_journal_mode", "WAL")
	// Commits do not fsync; the writer fsyncs the WAL itself once per
	// batch that must be durable (see writeBatch). NORMAL still syncs
	// around WAL checkpoints, so a crash never corrupts the file.
	q.Set("_synchronous", "NORMAL")
	q.Set("_txlock", "immediate")
	q.Set("_defensive", "1")
	q.Set("mode", "rw")
	db, err := openDB(path, q)
	if err != nil {
		return nil, err
	}
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	if err := createSchema(ctx, db); err != nil {
		db.Close()
		return nil, fmt.Errorf("audit: %s: %w", path, err)
	}
	return db, nil
}

// createSchema creates or migrates the schema in one write transaction.
func createSchema(ctx context.Context, db *sql.DB) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	var v int
	if err := tx.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v); err != nil {
		return err
	}
	if v != 0 {
		// A dropped trigger means someone else wrote to the file; the
		// check comes before any migration could hide it.
		missing, err := missingTriggers(ctx, tx, false)
		if err != nil {
			return err
		}
		if len(missing) > 0 {
			return fmt.Errorf("%w: triggers missing: %v", ErrIntegrity, missing)
		}
	}
	if _, err := migrate.Apply(ctx, tx, migrate.UserVersion("audit"), migrations); err != nil {
		return err
	}
	return tx.Commit()
}

// triggers are the names created by schemaV1.
var triggers = []string{"audit_no_update", "audit_no_delete", "audit_chain",
	"audit_tree_no_update", "audit_tree_no_delete", "audit_tree_dense"}

func missingTriggers(ctx context.Context, q querier, postgres bool) ([]string, error) {
	query := "SELECT count(*) FROM sqlite_schema WHERE type = 'trigger' AND name = ?"
	if postgres {
		query = "SELECT count(*) FROM pg_trigger WHERE tgname = ? AND tgenabled != 'D' AND NOT tgisinternal"
	}
	var missing []string
	for _, name := range triggers {
		var n int
		err := q.QueryRowContext(ctx, query, name).Scan(&n)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			missing = append(missing, name)
		}
	}
	return missing, nil
}

// ErrNoDatabase is returned by Verify, Tail and Export when the database
// file does not exist (they never create it).
var ErrNoDatabase = errors.New("audit: database does not exist")

// openReader opens path read-only (mode=ro plus query_only), never creating
// or modifying it, and returns the query that selects its rows. A
// DATABASE_URL is opened as it is; readers use read-only transactions.
func openReader(ctx context.Context, path string) (*sql.DB, string, error) {
	if statedb.IsPostgresURL(path) {
		return openPostgresReader(ctx, path)
	}
	if _, err := os.Stat(path); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, "", fmt.Errorf("%w: %s", ErrNoDatabase, path)
		}
		return nil, "", fmt.Errorf("audit: %w", err)
	}
	q := url.Values{}
	q.Set("mode", "ro")
	q.Set("_query_only", "1")
	db, err := openDB(path, q)
	if err != nil {
		return nil, "", err
	}
	var v int
	if err := db.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v); err != nil {
		db.Close()
		return nil, "", fmt.Errorf("audit: open %s: %w", path, err)
	}
	sel, err := selectRowFor(v)
	if err != nil {
		db.Close()
		return nil, "", err
	}
	return db, sel, nil
}
