package quota

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// Kind names a budget; it is also the bucket key stored in the database.
type Kind string

// Budget kinds.
const (
	KindCalls     Kind = "calls"
	KindSandboxes Kind = "sandboxes"
	KindExecution Kind = "execution_ms" // Limit and Remaining are in milliseconds
)

// Decision is the outcome of one quota check.
type Decision struct {
	Allowed   bool
	Kind      Kind
	Limit     int64
	Remaining int64 // after this decision
	// RetryAfter is set only when !Allowed: the wait, rounded up to whole
	// seconds (min 1s), after which the same request would succeed if
	// nothing else consumes the budget meanwhile.
	RetryAfter time.Duration
}

// AllowCall consumes one tool call from the per-minute budget if it fits.
func (s *Store) AllowCall(ctx context.Context, principal string, l Limits) (Decision, error) {
	return s.take(ctx, principal, KindCalls, minuteMs, int64(l.CallsPerMinute))
}

// ReserveSandbox consumes one sandbox creation from the per-hour budget if
// it fits. The reservation is not refunded if creation later fails: a
// failed attempt still cost the backend work.
func (s *Store) ReserveSandbox(ctx context.Context, principal string, l Limits) (Decision, error) {
	return s.take(ctx, principal, KindSandboxes, hourMs, int64(l.SandboxesPerHour))
}

// take is the atomic sliding-window check-and-increment.
func (s *Store) take(ctx context.Context, principal string, kind Kind, size, limit int64) (Decision, error) {
	if limit <= 0 {
		return Decision{}, fmt.Errorf("%w: %s", ErrInvalidLimit, kind)
	}
	d := Decision{Kind: kind, Limit: limit}
	err := s.writeTx(ctx, func(tx *sql.Tx, now time.Time) error {
		nowMs := now.UnixMilli()
		cur := windowStart(nowMs, size)
		prevN, curN, stepped, err := s.pair(ctx, tx, principal, kind, cur-size, cur)
		if err != nil {
			return err
		}
		if stepped {
			// A bucket after the current window: the wall clock was
			// stepped back, and the windows it re-enters hold counts from
			// before the step. They are forgotten, so the budget starts
			// afresh once instead of refusing for as long as the step.
			if _, err := tx.ExecContext(ctx, sqlForget, principal, string(kind), cur-size); err != nil {
				return fmt.Errorf("quota: forget %s after a clock step: %w", kind, err)
			}
			prevN, curN = 0, 0
		}
		d.Allowed, d.Remaining, d.RetryAfter = slide(nowMs-cur, size, limit, prevN, curN)
		if !d.Allowed {
			return nil // rejected requests are not counted
		}
		return s.add(ctx, tx, principal, kind, cur, 1)
	})
	if err != nil {
		return Decision{}, err
	}
	return d, nil
}

// pair reads the counts of the previous and current windows (0 if absent)
// and whether a later window has a bucket (the clock was stepped back).
func (s *Store) pair(ctx context.Context, tx *sql.Tx, principal string, kind Kind, prevStart, curStart int64) (prev, cur int64, stepped bool, err error) {
	rows, err := tx.StmtContext(ctx, s.selectPair).QueryContext(ctx, principal, string(kind), prevStart)
	if err != nil {
		return 0, 0, false, fmt.Errorf("quota: read %s: %w", kind, err)
	}
	defer rows.Close()
	for rows.Next() {
		var start, n int64
		if err := rows.Scan(&start, &n); err != nil {
			return 0, 0, false, fmt.Errorf("quota: read %s: %w", kind, err)
		}
		switch {
		case start == curStart:
			cur = n
		case start == prevStart:
			prev = n
		default:
			stepped = true
		}
	}
	if err := rows.Err(); err != nil {
		return 0, 0, false, fmt.Errorf("quota: read %s: %w", kind, err)
	}
	return prev, cur, stepped, nil
}

func (s *Store) add(ctx context.Context, tx *sql.Tx, principal string, kind Kind, start, n int64) error {
	if _, err := tx.StmtContext(ctx, s.upsert).ExecContext(ctx, principal, string(kind), start, n); err != nil {
		return fmt.Errorf("quota: record %s: %w", kind, err)
	}
	return nil
}
