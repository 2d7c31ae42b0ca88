package quota

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"
)

// ReservationGrace is how long past its reserved time a reservation lives
// before it is charged in full: a run ends (and settles) by its timeout
// plus the engine's hard-stop margin, so only a broker that died mid-run
// leaves one behind this long.
const ReservationGrace = 2 * time.Minute

// Reservation is execution time held for one run until it is settled.
type Reservation struct {
	ID        string
	Principal string
	ms        int64
}

const (
	sqlReserve       = `INSERT INTO quota_reservations (id, principal, ms, expires_at) VALUES (?1, ?2, ?3, ?4)`
	sqlRenew         = `UPDATE quota_reservations SET expires_at = ?1 WHERE id = ?2`
	sqlSettle        = `DELETE FROM quota_reservations WHERE id = ?1`
	sqlChargeExpired = `INSERT INTO quota_buckets (principal, kind, window_start, count)
		SELECT principal, ?1, ?2, sum(ms) FROM quota_reservations
		WHERE expires_at <= ?3 AND (?4 = '' OR principal = ?4) GROUP BY principal
		ON CONFLICT (principal, kind, window_start) DO UPDATE SET count = quota_buckets.count + excluded.count`
	sqlDeleteExpired = `DELETE FROM quota_reservations WHERE expires_at <= ?1 AND (?2 = '' OR principal = ?2)`
)

// ReserveExecution holds d of today's (UTC) execution budget for one run,
// if d fits beside what was spent and what other live runs hold: several
// runs started at once can never together reserve more than the budget.
// Settle the reservation with SettleExecution when the run ends. When it
// does not fit, RetryAfter is the time until the earliest live reservation
// expires (if d would fit once other runs settle) or until the next UTC
// midnight.
func (s *Store) ReserveExecution(ctx context.Context, principal string, l Limits, d time.Duration) (Decision, Reservation, error) {
	limit := l.ExecutionPerDay.Milliseconds()
	if limit <= 0 {
		return Decision{}, Reservation{}, fmt.Errorf("%w: %s", ErrInvalidLimit, KindExecution)
	}
	want := max(ceilMs(d), 1)
	dec := Decision{Kind: KindExecution, Limit: limit}
	var r Reservation
	err := s.writeTx(ctx, func(w *write) error {
		a, err := s.account(w, principal)
		if err != nil {
			return err
		}
		nowMs := w.now.UnixMilli()
		day := windowStart(nowMs, dayMs)
		// Reservations its broker never settled are charged in full.
		var expired, held, firstExpiry int64
		for _, h := range a.held {
			if h.expires <= nowMs {
				expired += h.ms
				continue
			}
			held += h.ms
			if firstExpiry == 0 || h.expires < firstExpiry {
				firstExpiry = h.expires
			}
		}
		if expired > 0 {
			if err := s.chargeExpired(w, principal); err != nil {
				return err
			}
			w.then(func() {
				for id, h := range a.held {
					if h.expires <= nowMs {
						delete(a.held, id)
					}
				}
				a.add(KindExecution, day, expired)
			})
		}
		used := a.buckets[bucket{KindExecution, day}] + expired
		dec.Allowed = used+held+want <= limit
		if !dec.Allowed {
			dec.Remaining = max(0, limit-used-held)
			if used+want <= limit && held > 0 {
				dec.RetryAfter = roundRetry(time.Duration(firstExpiry-nowMs) * time.Millisecond)
			} else {
				dec.RetryAfter = roundRetry(nextUTCMidnight(w.now).Sub(w.now))
			}
			return nil
		}
		dec.Remaining = limit - used - held - want
		r = Reservation{ID: newReservationID(), Principal: principal, ms: want}
		h := hold{ms: want, expires: nowMs + want + ReservationGrace.Milliseconds()}
		if _, err := w.exec(s.st.reserve, r.ID, principal, h.ms, h.expires); err != nil {
			return fmt.Errorf("quota: reserve execution: %w", err)
		}
		w.then(func() {
			a.held[r.ID] = h
			a.trim(KindExecution, day)
		})
		return nil
	})
	if err != nil {
		return Decision{}, Reservation{}, err
	}
	return dec, r, nil
}

// RenewExecution re-dates r's expiry from now, for a run that waited (for
// its session, say) before starting: only a broker that stopped leaves a
// reservation to expire. A reservation that already expired stays charged.
func (s *Store) RenewExecution(ctx context.Context, r Reservation) error {
	if r.ID == "" {
		return nil
	}
	return s.writeTx(ctx, func(w *write) error {
		expires := w.now.UnixMilli() + r.ms + ReservationGrace.Milliseconds()
		if _, err := w.exec(s.st.renew, expires, r.ID); err != nil {
			return fmt.Errorf("quota: renew execution: %w", err)
		}
		w.then(func() {
			if a := s.view[r.Principal]; a != nil {
				if h, ok := a.held[r.ID]; ok {
					h.expires = expires
					a.held[r.ID] = h
				}
			}
		})
		return nil
	})
}

// SettleExecution ends r, charging the run's real duration to today's (UTC)
// bucket, even past the limit: the time was spent. It is rounded up to whole
// ms; a run spanning midnight counts entirely on the day it settles. If r had
// already expired (and was charged in full), only time beyond that is added.
func (s *Store) SettleExecution(ctx context.Context, r Reservation, d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("quota: negative execution time %v", d)
	}
	if r.ID == "" {
		return nil
	}
	return s.writeTx(ctx, func(w *write) error {
		spent := ceilMs(d)
		res, err := w.exec(s.st.settle, r.ID)
		if err != nil {
			return fmt.Errorf("quota: settle execution: %w", err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return fmt.Errorf("quota: settle execution: %w", err)
		} else if n == 0 {
			spent = max(0, spent-r.ms)
		}
		s.mu.Lock()
		a := s.view[r.Principal]
		s.mu.Unlock()
		if a != nil {
			w.then(func() { delete(a.held, r.ID) })
		}
		if spent == 0 {
			return nil
		}
		return s.add(w, a, r.Principal, KindExecution, windowStart(w.now.UnixMilli(), dayMs), spent)
	})
}

// chargeExpired charges expired reservations in full and deletes them: the
// broker that held them stopped before settling, so their runs may have used
// all of it. An empty principal means every principal.
func (s *Store) chargeExpired(w *write, principal string) error {
	nowMs := w.now.UnixMilli()
	_, err := w.exec(s.st.chargeExpired, string(KindExecution), windowStart(nowMs, dayMs), nowMs, principal)
	if err == nil {
		_, err = w.exec(s.st.deleteExpired, nowMs, principal)
	}
	if err != nil {
		return fmt.Errorf("quota: expire reservations: %w", err)
	}
	return nil
}

func ceilMs(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

func newReservationID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
