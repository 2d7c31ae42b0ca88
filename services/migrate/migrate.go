// Package migrate brings a schema up to date from numbered steps, inside
// the caller's write transaction: two processes opening the same store at
// once apply each step exactly once, and a step that fails leaves the
// database as it was. The SQLite audit log keeps its version in PRAGMA
// user_version; a store whose tables belong to several packages (state.db,
// or the PostgreSQL database replicas share, audit log included) keeps one
// version per package in the schema_versions table.
package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// Steps is a schema's history: Steps[i] takes it from version i to i+1.
// A released step is never edited or reordered; a change is a new step.
// Step 1 may use IF NOT EXISTS to adopt tables made before versioning.
type Steps []string

// ErrTooNew means the database was written by a newer broker: its schema
// is at a version these steps do not reach, and downgrading is not done.
var ErrTooNew = errors.New("schema is newer than this broker")

// Store reads and records a schema's version.
type Store interface {
	version(ctx context.Context, tx *sql.Tx) (int, error)
	setVersion(ctx context.Context, tx *sql.Tx, v int) error
	name() string
}

// Apply runs the steps after the recorded version and records the last.
// tx must hold the write lock from its start (BEGIN IMMEDIATE), so the
// version it reads cannot change before it commits. It returns the version
// the database had.
func Apply(ctx context.Context, tx *sql.Tx, st Store, steps Steps) (int, error) {
	from, err := st.version(ctx, tx)
	if err != nil {
		return 0, fmt.Errorf("%s schema version: %w", st.name(), err)
	}
	if from > len(steps) {
		return from, fmt.Errorf("%s %w (version %d; this broker knows up to %d)", st.name(), ErrTooNew, from, len(steps))
	}
	for v := from; v < len(steps); v++ {
		if _, err := tx.ExecContext(ctx, steps[v]); err != nil {
			return from, fmt.Errorf("%s schema step %d: %w", st.name(), v+1, err)
		}
	}
	if from < len(steps) {
		if err := st.setVersion(ctx, tx, len(steps)); err != nil {
			return from, fmt.Errorf("%s schema version: %w", st.name(), err)
		}
	}
	return from, nil
}

// UserVersion keeps the version in PRAGMA user_version, for a database
// that holds one schema. Name is used in errors.
type UserVersion string

func (u UserVersion) name() string { return string(u) }

func (UserVersion) version(ctx context.Context, tx *sql.Tx) (int, error) {
	var v int
	err := tx.QueryRowContext(ctx, "PRAGMA user_version").Scan(&v)
	return v, err
}

func (UserVersion) setVersion(ctx context.Context, tx *sql.Tx, v int) error {
	// PRAGMA takes no bound parameters; v is an int.
	_, err := tx.ExecContext(ctx, fmt.Sprintf("PRAGMA user_version = %d", v))
	return err
}

// Component keeps the version in its own row of schema_versions, for a
// database whose tables several packages own, each with its own steps.
type Component string

func (c Component) name() string { return string(c) }

// versionsTable is created by the first component to open the database,
// in SQL that SQLite and PostgreSQL both take.
const versionsTable = `CREATE TABLE IF NOT EXISTS schema_versions (
	component TEXT    PRIMARY KEY,
	version   INTEGER NOT NULL
)`

func (c Component) version(ctx context.Context, tx *sql.Tx) (int, error) {
	if _, err := tx.ExecContext(ctx, versionsTable); err != nil {
		return 0, err
	}
	var v int
	err := tx.QueryRowContext(ctx, `SELECT version FROM schema_versions WHERE component = ?1`, string(c)).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return v, err
}

func (c Component) setVersion(ctx context.Context, tx *sql.Tx, v int) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO schema_versions (component, version) VALUES (?1, ?2)
		ON CONFLICT (component) DO UPDATE SET version = excluded.version`, string(c), v)
	return err
}
