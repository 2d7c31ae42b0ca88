// Package statedb opens the broker's shared state database (state.db):
// quotas, sessions, jobs and projects each keep their tables in it.
package statedb

import (
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"path/filepath"

	_ "modernc.org/sqlite" // registers the "sqlite" driver
)

// busyTimeoutMs bounds how long a writer waits for another connection (e.g.
// a second broker process) to release the write lock.
const busyTimeoutMs = 5000

// Open opens (creating 0600 if needed) the database at path with the shared
// pragmas. The parent directory must exist. One connection per handle:
// in-process callers queue on the pool (cheap, honours ctx) instead of
// spinning in SQLite's busy handler; other handles and processes are
// serialised by the file lock plus busy_timeout.
func Open(path string) (*sql.DB, error) {
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
	return db, nil
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
