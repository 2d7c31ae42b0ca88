// Package statedb opens the broker's shared state database: state.db, a
// SQLite file beside the broker (the default), or the PostgreSQL database
// named by DATABASE_URL, which broker replicas share. Quotas, sessions,
// jobs, projects, sandbox uids and OAuth each keep their tables in it, and
// each brings them up to date through its own numbered migration steps
// (services/migrate) when it opens the store. The steps and queries are
// written once; dialect.go and postgres.go adapt them to PostgreSQL.
package statedb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" driver

	"github.com/sandbox-broker/sandbox-broker/services/migrate"
)

// busyTimeoutMs bounds how long a writer waits for another connection (e.g.
// a second broker process) to release the write lock.
const busyTimeoutMs = 5000

// Schema is one package's tables in state.db.
type Schema struct {
	// Component names the package's row in schema_versions ("quota").
	Component string
	// Steps create and change its tables (see migrate.Steps); step 1
	// uses IF NOT EXISTS, adopting tables made before versioning.
	Steps []string
}

// migrateTimeout bounds waiting for another opener's migration as well.
const migrateTimeout = 30 * time.Second

// Open opens loc, a PostgreSQL URL or a SQLite file path, and brings s's
// tables up to date. A file is created 0600 if needed, with the shared
// pragmas; its parent directory must exist.
// One connection per handle: in-process callers queue on the pool (cheap,
// honours ctx) instead of spinning in SQLite's busy handler; other handles
// and processes are serialised by the file lock plus busy_timeout.
func Open(ctx context.Context, loc string, s Schema) (*sql.DB, error) {
	if s.Component == "" || len(s.Steps) == 0 {
		return nil, errors.New("state db: a schema needs a component name and steps")
	}
	if IsPostgresURL(loc) {
		return openPostgres(ctx, loc, s)
	}
	return openSQLite(ctx, loc, s)
}

func openPostgres(ctx context.Context, url string, s Schema) (*sql.DB, error) {
	db, err := OpenPostgres(url, StateLockKey)
	if err != nil {
		return nil, err
	}
	steps := make([]string, len(s.Steps))
	for i, st := range s.Steps {
		steps[i] = PostgresDDL(st)
	}
	if err := apply(ctx, db, Schema{Component: s.Component, Steps: steps}); err != nil {
		db.Close()
		return nil, fmt.Errorf("state db: %w", Classify(err))
	}
	return db, nil
}

func openSQLite(ctx context.Context, path string, s Schema) (*sql.DB, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("state db: resolve path: %w", err)
	}
	if err := ensurePrivateFile(abs); err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite", dsn(abs))
	if err != nil {
		return nil, fmt.Errorf("state db: open: %w", err)
	}
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	if err := apply(ctx, db, s); err != nil {
		db.Close()
		return nil, fmt.Errorf("state db: %w", err)
	}
	return db, nil
}

// apply migrates s in one write transaction (_txlock=immediate; on
// Postgres the store's advisory lock), so concurrent openers, in this
// process or another replica, take turns.
func apply(ctx context.Context, db *sql.DB, s Schema) error {
	ctx, cancel := context.WithTimeout(ctx, migrateTimeout)
	defer cancel()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := migrate.Apply(ctx, tx, migrate.Component(s.Component), s.Steps); err != nil {
		return err
	}
	return tx.Commit()
}

// dsn builds a file: URI so any character in the path is escaped rather
// than being mistaken for URI syntax.
//   - WAL lets readers run alongside the single writer.
//   - synchronous=NORMAL survives process crashes (the restart case); only
//     an OS crash/power loss can drop the last few writes.
//   - _txlock=immediate makes every read-write BeginTx take the write lock
//     up front, so read-then-write cannot race or deadlock.
func dsn(abs string) string {
	q := url.Values{}
	q.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", busyTimeoutMs))
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous(NORMAL)")
	q.Set("_txlock", "immediate")
	u := url.URL{Scheme: "file", Path: filepath.ToSlash(abs), RawQuery: q.Encode()}
	return u.String()
}

// ensurePrivateFile creates the database file 0600 before SQLite does
// (SQLite would use 0644 minus umask); its -wal/-shm files copy this mode.
// An existing file is tightened to 0600 as well.
func ensurePrivateFile(abs string) error {
	f, err := os.OpenFile(abs, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("state db: create: %w", err)
	}
	fi, err := f.Stat()
	if err == nil && fi.Mode().Perm() != 0o600 {
		err = f.Chmod(0o600)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("state db: secure: %w", err)
	}
	return nil
}
