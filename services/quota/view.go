package quota

import (
	"fmt"
)

// account is one principal's part of the view: its buckets from the
// earliest window each kind may need on, and its live reservations.
// Every write of this Store to the principal's rows updates it after the
// commit, so from those windows on it equals the file.
type account struct {
	from    map[Kind]int64 // earliest window_start held, per kind
	buckets map[bucket]int64
	held    map[string]hold // reservation id → hold
}

type bucket struct {
	kind  Kind
	start int64
}

type hold struct{ ms, expires int64 }

// windowsFor are, per kind, the earliest window a decision or Usage at
// nowMs reads: the previous minute or hour, the current UTC day.
func windowsFor(nowMs int64) map[Kind]int64 {
	return map[Kind]int64{
		KindCalls:     windowStart(nowMs, minuteMs) - minuteMs,
		KindSandboxes: windowStart(nowMs, hourMs) - hourMs,
		KindExecution: windowStart(nowMs, dayMs),
	}
}

// covers reports whether a holds every window a decision at nowMs reads
// (a clock stepped back can need earlier ones).
func (a *account) covers(nowMs int64) bool {
	for k, lo := range windowsFor(nowMs) {
		if a.from[k] > lo {
			return false
		}
	}
	return true
}

const (
	// The windows from windowsFor on, and any later ones (which mean the
	// clock was stepped back; see take).
	sqlLoadBuckets = `SELECT kind, window_start, count FROM quota_buckets
		WHERE principal = ?1 AND (
			(kind = ?2 AND window_start >= ?3) OR
			(kind = ?4 AND window_start >= ?5) OR
			(kind = ?6 AND window_start >= ?7))`
	sqlLoadHeld = `SELECT id, ms, expires_at FROM quota_reservations WHERE principal = ?1`
)

// account returns principal's account, read from the file inside w when
// the view does not have it or not far enough back. Call it before w
// changes anything, so what it reads is what is committed.
func (s *Store) account(w *write, principal string) (*account, error) {
	nowMs := w.now.UnixMilli()
	s.mu.Lock()
	a := s.view[principal]
	s.mu.Unlock()
	if a != nil && a.covers(nowMs) {
		return a, nil
	}
	from := windowsFor(nowMs)
	a = &account{from: from, buckets: map[bucket]int64{}, held: map[string]hold{}}
	rows, err := w.tx.StmtContext(w.ctx, s.st.loadBuckets).QueryContext(w.ctx, principal,
		string(KindCalls), from[KindCalls], string(KindSandboxes), from[KindSandboxes],
		string(KindExecution), from[KindExecution])
	if err != nil {
		return nil, fmt.Errorf("quota: read %s: %w", principal, err)
	}
	for rows.Next() {
		var kind string
		var start, n int64
		if err := rows.Scan(&kind, &start, &n); err != nil {
			rows.Close()
			return nil, fmt.Errorf("quota: read buckets: %w", err)
		}
		a.buckets[bucket{Kind(kind), start}] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("quota: read buckets: %w", err)
	}
	rows, err = w.tx.StmtContext(w.ctx, s.st.loadHeld).QueryContext(w.ctx, principal)
	if err != nil {
		return nil, fmt.Errorf("quota: read reservations: %w", err)
	}
	for rows.Next() {
		var id string
		var h hold
		if err := rows.Scan(&id, &h.ms, &h.expires); err != nil {
			rows.Close()
			return nil, fmt.Errorf("quota: read reservations: %w", err)
		}
		a.held[id] = h
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("quota: read reservations: %w", err)
	}
	s.mu.Lock()
	s.view[principal] = a
	s.mu.Unlock()
	return a, nil
}

// cached returns principal's account if the view holds it far enough
// back for nowMs.
func (s *Store) cached(principal string, nowMs int64) (*account, bool) {
	a := s.view[principal]
	return a, a != nil && a.covers(nowMs)
}

// add counts n more in a bucket (the view's side of sqlAdd).
func (a *account) add(kind Kind, start, n int64) { a.buckets[bucket{kind, start}] += n }
