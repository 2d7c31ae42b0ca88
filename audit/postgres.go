package audit

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/sandbox-broker/sandbox-broker/services/migrate"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// On PostgreSQL (Options.Path a DATABASE_URL) the log lives beside the
// shared state and broker replicas append to it in turn: every append's
// transaction takes the audit advisory lock first (statedb.OpenPostgres),
// then chains onto whatever row is last. The schema is the SQLite one's
// latest version; the triggers are the same rules in PL/pgSQL, under the
// same names. Checkpoints stay in each replica's own file.

// pgMigrations is the PostgreSQL schema history, versioned in
// schema_versions under "audit". Append; never edit a released step.
var pgMigrations = migrate.Steps{`
CREATE TABLE audit(
	seq BIGINT PRIMARY KEY,
	ts TEXT NOT NULL,
	call_id TEXT NOT NULL,
	phase TEXT NOT NULL,
	principal TEXT NOT NULL,
	tool TEXT NOT NULL,
	params TEXT NOT NULL,
	outcome TEXT NOT NULL,
	error_code TEXT NOT NULL,
	duration_ms BIGINT NOT NULL,
	leaf BYTEA NOT NULL,
	prev_mac BYTEA NOT NULL,
	mac BYTEA NOT NULL,
	kid TEXT NOT NULL,
	body_version BIGINT NOT NULL DEFAULT 1,
	transport TEXT NOT NULL DEFAULT '',
	client_addr TEXT NOT NULL DEFAULT '',
	user_agent TEXT NOT NULL DEFAULT '',
	mcp_session TEXT NOT NULL DEFAULT '',
	toolset TEXT NOT NULL DEFAULT '');
CREATE TABLE audit_tree(idx BIGINT PRIMARY KEY, hash BYTEA NOT NULL);
CREATE FUNCTION audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION '% is append-only', TG_TABLE_NAME; END $$;
CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit
	FOR EACH STATEMENT EXECUTE FUNCTION audit_append_only();
CREATE TRIGGER audit_no_delete BEFORE DELETE OR TRUNCATE ON audit
	FOR EACH STATEMENT EXECUTE FUNCTION audit_append_only();
CREATE TRIGGER audit_tree_no_update BEFORE UPDATE ON audit_tree
	FOR EACH STATEMENT EXECUTE FUNCTION audit_append_only();
CREATE TRIGGER audit_tree_no_delete BEFORE DELETE OR TRUNCATE ON audit_tree
	FOR EACH STATEMENT EXECUTE FUNCTION audit_append_only();
CREATE FUNCTION audit_chain() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.seq IS DISTINCT FROM (SELECT coalesce(max(seq), 0) + 1 FROM audit)
	   OR NEW.prev_mac IS DISTINCT FROM coalesce((SELECT mac FROM audit ORDER BY seq DESC LIMIT 1), decode(repeat('00', 32), 'hex'))
	THEN RAISE EXCEPTION 'audit chain violation'; END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER audit_chain BEFORE INSERT ON audit FOR EACH ROW EXECUTE FUNCTION audit_chain();
CREATE FUNCTION audit_tree_dense() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.idx IS DISTINCT FROM (SELECT coalesce(max(idx), -1) + 1 FROM audit_tree)
	THEN RAISE EXCEPTION 'audit_tree order violation'; END IF;
	RETURN NEW;
END $$;
CREATE TRIGGER audit_tree_dense BEFORE INSERT ON audit_tree FOR EACH ROW EXECUTE FUNCTION audit_tree_dense()`,
}

// pgStore is the audit log's entry in schema_versions.
const pgStore = migrate.Component("audit")

// openPostgresWriter opens the log's pool on url and migrates it in one
// locked transaction, checking the triggers first as on SQLite.
func openPostgresWriter(ctx context.Context, url string) (*sql.DB, error) {
	db, err := statedb.OpenPostgres(url, statedb.AuditLockKey)
	if err != nil {
		return nil, err
	}
	err = func() error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		v, err := pgVersion(ctx, tx)
		if err != nil {
			return err
		}
		if v != 0 {
			missing, err := missingTriggers(ctx, tx, true)
			if err != nil {
				return err
			}
			if len(missing) > 0 {
				return fmt.Errorf("%w: triggers missing: %v", ErrIntegrity, missing)
			}
		}
		if _, err := migrate.Apply(ctx, tx, pgStore, pgMigrations); err != nil {
			return err
		}
		return tx.Commit()
	}()
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("audit: %w", statedb.Classify(err))
	}
	return db, nil
}

// openPostgresReader opens url without migrating it; a database the log
// was never created in is ErrNoDatabase.
func openPostgresReader(ctx context.Context, url string) (*sql.DB, string, error) {
	db, err := statedb.OpenPostgres(url, statedb.AuditLockKey)
	if err != nil {
		return nil, "", err
	}
	v, err := pgVersion(ctx, db)
	if err == nil && v == 0 {
		err = ErrNoDatabase
	}
	if err == nil && v != len(pgMigrations) {
		err = fmt.Errorf("audit: unsupported schema version %d", v)
	}
	if err != nil {
		db.Close()
		return nil, "", err
	}
	return db, selectRow, nil
}

// pgVersion is the log's schema version, 0 when it has none yet (not
// even the schema_versions table). The table is looked up first: a failed
// statement would abort the caller's transaction.
func pgVersion(ctx context.Context, q querier) (int, error) {
	var exists bool
	if err := q.QueryRowContext(ctx, `SELECT to_regclass('schema_versions') IS NOT NULL`).Scan(&exists); err != nil || !exists {
		return 0, err
	}
	var v int
	err := q.QueryRowContext(ctx, `SELECT version FROM schema_versions WHERE component = ?`, string(pgStore)).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return v, err
}
