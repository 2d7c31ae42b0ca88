package modelgw

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// Limits are one principal's daily model budgets (UTC days). Zero or less
// means none may be spent.
type Limits struct {
	RequestsPerDay int64 `json:"requests_per_day"`
	TokensPerDay   int64 `json:"tokens_per_day"`
}

// Spent is a principal's use of today's budgets.
type Spent struct {
	Requests int64 `json:"requests"`
	Tokens   int64 `json:"tokens"`
	// Exhausted names the budget that is used up ("requests" or
	// "tokens"), "" while both have room.
	Exhausted  string        `json:"exhausted,omitempty"`
	RetryAfter time.Duration `json:"-"` // until the next UTC midnight
}

// exhausted says which budget of l s has used up.
func (s Spent) exhausted(l Limits) string {
	switch {
	case s.Requests >= l.RequestsPerDay:
		return "requests"
	case s.Tokens >= l.TokensPerDay:
		return "tokens"
	}
	return ""
}

// Budget counts model requests and tokens per principal and UTC day in
// state.db, so a restart does not reset them. A request takes its slot
// before it is forwarded; its tokens, known only from the answer, are added
// after. Calls in flight may therefore overshoot the token budget by what
// they consume; the next request is refused.
type Budget struct {
	db  *sql.DB
	now func() time.Time
}

// schema is the budget's table in state.db.
var schema = statedb.Schema{Component: "modelgw", Steps: []string{`CREATE TABLE IF NOT EXISTS model_budget(
	principal TEXT NOT NULL,
	day INTEGER NOT NULL,
	requests INTEGER NOT NULL,
	tokens INTEGER NOT NULL,
	PRIMARY KEY(principal, day))`}}

// keepDays is how long past days' counts are kept.
const keepDays = 7

// OpenBudget opens the counters in the state database at path.
func OpenBudget(ctx context.Context, path string, now func() time.Time) (*Budget, error) {
	if now == nil {
		now = time.Now
	}
	db, err := statedb.Open(ctx, path, schema)
	if err != nil {
		return nil, fmt.Errorf("model budget: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	b := &Budget{db: db, now: now}
	if _, err := db.ExecContext(ctx, `DELETE FROM model_budget WHERE day < ?`, b.day()-keepDays); err != nil {
		db.Close()
		return nil, err
	}
	return b, nil
}

// Close closes the database handle.
func (b *Budget) Close() error { return b.db.Close() }

// Ping checks the store.
func (b *Budget) Ping(ctx context.Context) error { return b.db.PingContext(ctx) }

func (b *Budget) day() int64 { return b.now().UTC().Unix() / 86400 }

func (b *Budget) retryAfter() time.Duration {
	now := b.now().UTC()
	next := time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)
	return next.Sub(now)
}

func (b *Budget) spent(ctx context.Context, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}, principal string, day int64) (Spent, error) {
	var s Spent
	err := q.QueryRowContext(ctx, `SELECT requests, tokens FROM model_budget WHERE principal = ? AND day = ?`, principal, day).
		Scan(&s.Requests, &s.Tokens)
	if err == sql.ErrNoRows {
		err = nil
	}
	return s, err
}

// Check reports today's use without taking anything.
func (b *Budget) Check(ctx context.Context, principal string, l Limits) (Spent, error) {
	s, err := b.spent(ctx, b.db, principal, b.day())
	if err != nil {
		return Spent{}, err
	}
	if s.Exhausted = s.exhausted(l); s.Exhausted != "" {
		s.RetryAfter = b.retryAfter()
	}
	return s, nil
}

// Take counts one request when neither budget is used up, in one
// transaction (concurrent requests cannot both take the last one). With a
// budget used up, nothing is counted and Exhausted says which.
func (b *Budget) Take(ctx context.Context, principal string, l Limits) (Spent, error) {
	tx, err := b.db.BeginTx(ctx, nil)
	if err != nil {
		return Spent{}, err
	}
	defer func() { _ = tx.Rollback() }()
	day := b.day()
	s, err := b.spent(ctx, tx, principal, day)
	if err != nil {
		return Spent{}, err
	}
	if s.Exhausted = s.exhausted(l); s.Exhausted != "" {
		s.RetryAfter = b.retryAfter()
		return s, nil
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO model_budget(principal, day, requests, tokens) VALUES(?, ?, 1, 0)
		ON CONFLICT(principal, day) DO UPDATE SET requests = model_budget.requests + 1`, principal, day); err != nil {
		return Spent{}, err
	}
	s.Requests++
	return s, tx.Commit()
}

// AddTokens charges n tokens to today's budget.
func (b *Budget) AddTokens(ctx context.Context, principal string, n int64) error {
	if n <= 0 {
		return nil
	}
	_, err := b.db.ExecContext(ctx, `INSERT INTO model_budget(principal, day, requests, tokens) VALUES(?, ?, 0, ?)
		ON CONFLICT(principal, day) DO UPDATE SET tokens = model_budget.tokens + excluded.tokens`, principal, b.day(), n)
	return err
}
