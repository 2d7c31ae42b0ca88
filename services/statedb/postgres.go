package statedb

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// Advisory lock keys (pg_advisory_xact_lock): one per store, standing in
// for the single-writer lock each SQLite file has.
const (
	StateLockKey int64 = 0x73627374617465 // "sbstate"
	AuditLockKey int64 = 0x73626175646974 // "sbaudit"
)

// pgMaxConns bounds each handle's pool; a broker opens one handle per
// component, and replicas share the server's max_connections.
const pgMaxConns = 8

// OpenPostgres opens a pool on url through pgx's database/sql driver,
// wrapped so the store's SQL runs unchanged: placeholders are renumbered,
// Go bools are stored as 0/1 as SQLite stores them, every read-write
// transaction first takes the advisory lock lockKey (SQLite's BEGIN
// IMMEDIATE across replicas), read-only ones see one snapshot, and
// commits are synchronous.
func OpenPostgres(url string, lockKey int64) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		// pgx's message may quote the URL, password included.
		return nil, fmt.Errorf("state db: DATABASE_URL is not a valid PostgreSQL URL")
	}
	// A commit is durable when it returns, whatever the server's default
	// (the audit log tells an intent row's caller so at once).
	cfg.RuntimeParams["synchronous_commit"] = "on"
	db := sql.OpenDB(pgConnector{stdlib.GetConnector(*cfg), lockKey})
	db.SetMaxOpenConns(pgMaxConns)
	db.SetMaxIdleConns(pgMaxConns)
	return db, nil
}

type pgConnector struct {
	driver.Connector
	lockKey int64
}

func (c pgConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &pgConn{Conn: conn.(*stdlib.Conn), lockKey: c.lockKey}, nil
}

type pgConn struct {
	*stdlib.Conn
	lockKey int64
}

func (c *pgConn) Prepare(q string) (driver.Stmt, error) { return c.Conn.Prepare(rebind(q)) }

func (c *pgConn) PrepareContext(ctx context.Context, q string) (driver.Stmt, error) {
	return c.Conn.PrepareContext(ctx, rebind(q))
}

func (c *pgConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	return c.Conn.ExecContext(ctx, rebind(q), args)
}

func (c *pgConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	return c.Conn.QueryContext(ctx, rebind(q), args)
}

// CheckNamedValue stores bools as integers, as the SQLite driver does, so
// the shared schema can keep INTEGER flag columns.
func (c *pgConn) CheckNamedValue(nv *driver.NamedValue) error {
	if b, ok := nv.Value.(bool); ok {
		nv.Value = int64(0)
		if b {
			nv.Value = int64(1)
		}
	}
	return nil
}

func (c *pgConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

func (c *pgConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if opts.ReadOnly && sql.IsolationLevel(opts.Isolation) == sql.LevelDefault {
		opts.Isolation = driver.IsolationLevel(sql.LevelRepeatableRead)
	}
	tx, err := c.Conn.BeginTx(ctx, opts)
	if err != nil || opts.ReadOnly {
		return tx, err
	}
	if _, err := c.Conn.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", []driver.NamedValue{{Ordinal: 1, Value: c.lockKey}}); err != nil {
		tx.Rollback()
		return nil, err
	}
	return tx, nil
}
