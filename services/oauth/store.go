package oauth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// schema is the OAuth tables in state.db, prefixed because the file is
// shared with other packages. Append steps; never edit released ones.
// Refresh tokens and client secrets are stored as SHA-256 hashes only: both
// are 256-bit random values, so a plain hash is enough.
var schema = statedb.Schema{Component: "oauth", Steps: []string{`
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
`}}

// Store errors. ErrReused means the family was revoked as a result.
var (
	ErrNotFound = errors.New("oauth: not found")
	ErrExpired  = errors.New("oauth: expired")
	ErrRevoked  = errors.New("oauth: grant revoked")
	ErrReused   = errors.New("oauth: refresh token reused; grant revoked")
)

// Store keeps clients, grants and refresh tokens in state.db.
type Store struct {
	db  *sql.DB
	now func() time.Time
}

// OpenStore opens state.db at path and brings the OAuth tables up to date.
func OpenStore(ctx context.Context, path string, now func() time.Time) (*Store, error) {
	if now == nil {
		now = time.Now
	}
	db, err := statedb.Open(ctx, path, schema)
	if err != nil {
		return nil, fmt.Errorf("oauth: %w", err)
	}
	return &Store{db: db, now: now}, nil
}

// Close releases the database.
func (s *Store) Close() error { return s.db.Close() }

// Ping reports whether the tables are readable.
func (s *Store) Ping(ctx context.Context) error {
	var n int
	return s.db.QueryRowContext(ctx, `SELECT count(*) FROM (SELECT 1 FROM oauth_grants LIMIT 1) AS one`).Scan(&n)
}

// Client is a registered client.
type Client struct {
	ID         string
	SecretHash []byte // nil for public clients
	Metadata   Registration
	CreatedAt  time.Time
	UsedAt     time.Time // zero until a token is issued
}

// CheckSecret compares secret with the stored hash in constant time.
func (c Client) CheckSecret(secret string) bool {
	if c.SecretHash == nil || secret == "" {
		return false
	}
	h := sha256.Sum256([]byte(secret))
	return subtle.ConstantTimeCompare(h[:], c.SecretHash) == 1
}

func hashToken(t string) []byte {
	h := sha256.Sum256([]byte(t))
	return h[:]
}

// CreateClient stores a new registration unless maxUnused registrations
// that never got a token already exist.
func (s *Store) CreateClient(ctx context.Context, c Client, maxUnused int) error {
	meta, err := json.Marshal(c.Metadata)
	if err != nil {
		return err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	var unused int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM oauth_clients WHERE used_at = 0`).Scan(&unused); err != nil {
		return err
	}
	if unused >= maxUnused {
		return errTooManyClients
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO oauth_clients (client_id, secret_hash, metadata, created_at) VALUES (?, ?, ?, ?)`,
		c.ID, c.SecretHash, string(meta), c.CreatedAt.UnixMilli()); err != nil {
		return err
	}
	return tx.Commit()
}

var errTooManyClients = errors.New("oauth: too many unused registrations")

// Client loads a registration.
func (s *Store) Client(ctx context.Context, id string) (Client, error) {
	var c Client
	var meta string
	var created, used int64
	err := s.db.QueryRowContext(ctx, `SELECT client_id, secret_hash, metadata, created_at, used_at FROM oauth_clients WHERE client_id = ?`, id).
		Scan(&c.ID, &c.SecretHash, &meta, &created, &used)
	if errors.Is(err, sql.ErrNoRows) {
		return Client{}, ErrNotFound
	}
	if err != nil {
		return Client{}, err
	}
	if err := json.Unmarshal([]byte(meta), &c.Metadata); err != nil {
		return Client{}, fmt.Errorf("oauth: client %s metadata: %w", id, err)
	}
	c.CreatedAt = time.UnixMilli(created)
	if used != 0 {
		c.UsedAt = time.UnixMilli(used)
	}
	return c, nil
}

// Grant is one authorisation: a client acting for a principal. Every token
// issued from one authorisation code belongs to the same grant (the refresh
// token family), and revoking it ends them all.
type Grant struct {
	ID        string
	ClientID  string
	Principal string
	Scopes    []string
	Audience  string
	RevokedAt time.Time
}

// CreateGrant stores g and, when refresh is not empty, its first refresh
// token, and marks the client used.
func (s *Store) CreateGrant(ctx context.Context, g Grant, refresh string, refreshTTL time.Duration) error {
	now := s.now()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT INTO oauth_grants (grant_id, client_id, principal, scopes, audience, created_at, used_at)
		VALUES (?, ?, ?, ?, ?, ?, ?)`, g.ID, g.ClientID, g.Principal, strings.Join(g.Scopes, " "), g.Audience, now.UnixMilli(), now.UnixMilli()); err != nil {
		return err
	}
	if refresh != "" {
		if _, err := tx.ExecContext(ctx, `INSERT INTO oauth_refresh_tokens (token_hash, grant_id, expires_at) VALUES (?, ?, ?)`,
			hashToken(refresh), g.ID, now.Add(refreshTTL).UnixMilli()); err != nil {
			return err
		}
	}
	if _, err := tx.ExecContext(ctx, `UPDATE oauth_clients SET used_at = ? WHERE client_id = ?`, now.UnixMilli(), g.ClientID); err != nil {
		return err
	}
	return tx.Commit()
}

// Grant loads a grant, revoked or not.
func (s *Store) Grant(ctx context.Context, id string) (Grant, error) {
	return s.grant(ctx, s.db, id)
}

type queryer interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func (s *Store) grant(ctx context.Context, q queryer, id string) (Grant, error) {
	var g Grant
	var scopes string
	var revoked int64
	err := q.QueryRowContext(ctx, `SELECT grant_id, client_id, principal, scopes, audience, revoked_at FROM oauth_grants WHERE grant_id = ?`, id).
		Scan(&g.ID, &g.ClientID, &g.Principal, &scopes, &g.Audience, &revoked)
	if errors.Is(err, sql.ErrNoRows) {
		return Grant{}, ErrNotFound
	}
	if err != nil {
		return Grant{}, err
	}
	g.Scopes = strings.Fields(scopes)
	if revoked != 0 {
		g.RevokedAt = time.UnixMilli(revoked)
	}
	return g, nil
}

// ActiveGrant returns the grant if it exists and is not revoked.
func (s *Store) ActiveGrant(ctx context.Context, id string) (Grant, error) {
	g, err := s.Grant(ctx, id)
	if err != nil {
		return Grant{}, err
	}
	if !g.RevokedAt.IsZero() {
		return Grant{}, ErrRevoked
	}
	return g, nil
}

// RefreshGrant finds the grant of a live refresh token without changing
// it. A token that was already rotated is reuse: the grant is revoked and
// ErrReused returned.
func (s *Store) RefreshGrant(ctx context.Context, refresh string) (Grant, error) {
	return s.refresh(ctx, refresh, "", 0)
}

// RefreshTokenGrant finds the grant of any stored refresh token, live or
// rotated, without changing anything (for revocation).
func (s *Store) RefreshTokenGrant(ctx context.Context, refresh string) (Grant, error) {
	var grantID string
	err := s.db.QueryRowContext(ctx, `SELECT grant_id FROM oauth_refresh_tokens WHERE token_hash = ?`, hashToken(refresh)).Scan(&grantID)
	if errors.Is(err, sql.ErrNoRows) {
		return Grant{}, ErrNotFound
	}
	if err != nil {
		return Grant{}, err
	}
	return s.Grant(ctx, grantID)
}

// RotateRefresh replaces refresh by next atomically, with the same checks
// as RefreshGrant, so two racing uses of one token cannot both succeed.
func (s *Store) RotateRefresh(ctx context.Context, refresh, next string, ttl time.Duration) (Grant, error) {
	if next == "" {
		return Grant{}, errors.New("oauth: empty next refresh token")
	}
	return s.refresh(ctx, refresh, next, ttl)
}

func (s *Store) refresh(ctx context.Context, refresh, next string, ttl time.Duration) (Grant, error) {
	now := s.now()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return Grant{}, err
	}
	defer tx.Rollback()
	var grantID string
	var expires, used int64
	err = tx.QueryRowContext(ctx, `SELECT grant_id, expires_at, used_at FROM oauth_refresh_tokens WHERE token_hash = ?`, hashToken(refresh)).
		Scan(&grantID, &expires, &used)
	if errors.Is(err, sql.ErrNoRows) {
		return Grant{}, ErrNotFound
	}
	if err != nil {
		return Grant{}, err
	}
	g, err := s.grant(ctx, tx, grantID)
	if err != nil {
		return Grant{}, err
	}
	switch {
	case !g.RevokedAt.IsZero():
		return Grant{}, ErrRevoked
	case used != 0:
		if err := revokeTx(ctx, tx, grantID, "refresh_token_reuse", now); err != nil {
			return Grant{}, err
		}
		if err := tx.Commit(); err != nil {
			return Grant{}, err
		}
		return g, ErrReused
	case now.UnixMilli() >= expires:
		return Grant{}, ErrExpired
	}
	if next == "" {
		return g, nil
	}
	if _, err := tx.ExecContext(ctx, `UPDATE oauth_refresh_tokens SET used_at = ? WHERE token_hash = ?`, now.UnixMilli(), hashToken(refresh)); err != nil {
		return Grant{}, err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO oauth_refresh_tokens (token_hash, grant_id, expires_at) VALUES (?, ?, ?)`,
		hashToken(next), grantID, now.Add(ttl).UnixMilli()); err != nil {
		return Grant{}, err
	}
	if _, err := tx.ExecContext(ctx, `UPDATE oauth_grants SET used_at = ? WHERE grant_id = ?`, now.UnixMilli(), grantID); err != nil {
		return Grant{}, err
	}
	if _, err := tx.ExecContext(ctx, `UPDATE oauth_clients SET used_at = ? WHERE client_id = ?`, now.UnixMilli(), g.ClientID); err != nil {
		return Grant{}, err
	}
	return g, tx.Commit()
}

// RevokeGrant ends a grant and every token issued under it. Revoking a
// revoked or unknown grant is not an error.
func (s *Store) RevokeGrant(ctx context.Context, id, reason string) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if err := revokeTx(ctx, tx, id, reason, s.now()); err != nil {
		return err
	}
	return tx.Commit()
}

func revokeTx(ctx context.Context, tx *sql.Tx, id, reason string, now time.Time) error {
	if _, err := tx.ExecContext(ctx, `UPDATE oauth_grants SET revoked_at = ?, revoke_reason = ? WHERE grant_id = ? AND revoked_at = 0`,
		now.UnixMilli(), reason, id); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, `DELETE FROM oauth_refresh_tokens WHERE grant_id = ? AND used_at = 0`, id)
	return err
}

// Prune deletes what can no longer be used: expired refresh tokens, grants
// with no live refresh token whose last access token has expired, and
// registrations that never got a token within unusedTTL or whose grants
// are all gone. Lookups fail closed, so pruning never widens access.
func (s *Store) Prune(ctx context.Context, accessTTL, unusedTTL time.Duration) error {
	now := s.now()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	stmts := []struct {
		q    string
		args []any
	}{
		{`DELETE FROM oauth_refresh_tokens WHERE expires_at <= ?`, []any{now.UnixMilli()}},
		{`DELETE FROM oauth_grants WHERE used_at < ? AND NOT EXISTS (SELECT 1 FROM oauth_refresh_tokens r WHERE r.grant_id = oauth_grants.grant_id)`,
			[]any{now.Add(-accessTTL).UnixMilli()}},
		{`DELETE FROM oauth_clients WHERE used_at = 0 AND created_at < ?`, []any{now.Add(-unusedTTL).UnixMilli()}},
		{`DELETE FROM oauth_clients WHERE used_at != 0 AND used_at < ? AND NOT EXISTS (SELECT 1 FROM oauth_grants g WHERE g.client_id = oauth_clients.client_id)`,
			[]any{now.Add(-unusedTTL).UnixMilli()}},
	}
	for _, st := range stmts {
		if _, err := tx.ExecContext(ctx, st.q, st.args...); err != nil {
			return fmt.Errorf("oauth: prune: %w", err)
		}
	}
	return tx.Commit()
}
