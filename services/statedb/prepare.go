package statedb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// Query is one statement to prepare and where to keep it.
type Query struct {
	Dst **sql.Stmt
	SQL string
}

// Stmts are statements prepared once for the life of a handle: SQLite
// parses each only once, database/sql prepares it again on a new
// connection, and SQLite recompiles it by itself after a schema change (a
// migration by another opener of the file).
type Stmts []*sql.Stmt

// Prepare prepares every query on db. On error it closes those already
// prepared.
func Prepare(ctx context.Context, db *sql.DB, qs ...Query) (Stmts, error) {
	out := make(Stmts, 0, len(qs))
	for _, q := range qs {
		st, err := db.PrepareContext(ctx, q.SQL)
		if err != nil {
			return nil, errors.Join(fmt.Errorf("prepare: %w", err), out.Close())
		}
		*q.Dst = st
		out = append(out, st)
	}
	return out, nil
}

// Close closes every statement.
func (s Stmts) Close() error {
	var errs []error
	for _, st := range s {
		errs = append(errs, st.Close())
	}
	return errors.Join(errs...)
}
