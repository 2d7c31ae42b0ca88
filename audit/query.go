package audit

import (
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"golang.org/x/mod/sumdb/note"
)

// Filter selects rows for Query, Each and Follow. Zero fields match
// everything; strings match exactly.
type Filter struct {
	Principal string
	Tool      string
	Outcome   string // "" matches intent rows too
	ErrorCode string
	CallID    string
	// Since and Until bound the row time (Since inclusive, Until exclusive).
	Since, Until time.Time
	// AfterSeq keeps rows after this seq (an export resumed where it stopped).
	AfterSeq int64
}

// where is f's SQL condition on the columns alone (time bounds become seq
// bounds, see seqBounds) and its arguments.
func (f Filter) where() (string, []any) {
	conds, args := []string{"1 = 1"}, []any{}
	for _, c := range []struct{ col, v string }{
		{"principal", f.Principal}, {"tool", f.Tool}, {"outcome", f.Outcome},
		{"error_code", f.ErrorCode}, {"call_id", f.CallID},
	} {
		if c.v != "" {
			conds = append(conds, c.col+" = ?")
			args = append(args, c.v)
		}
	}
	return strings.Join(conds, " AND "), args
}

// reader is an open read-only view of the log for one query or a follow.
type reader struct {
	db  *sql.DB
	sel string // selectRow for the log's schema version (see selectRowFor)
}

func openQuery(ctx context.Context, path string) (*reader, error) {
	db, sel, err := openReader(ctx, path)
	if err != nil {
		return nil, err
	}
	return &reader{db: db, sel: sel}, nil
}

func (r *reader) close() { r.db.Close() }

// lastSeq is the newest row's seq (0 for an empty log).
func (r *reader) lastSeq(ctx context.Context) (int64, error) {
	var n int64
	err := r.db.QueryRowContext(ctx, "SELECT coalesce(max(seq), 0) FROM audit").Scan(&n)
	return n, err
}

// firstAtOrAfter is the smallest seq whose time is at or after t, or
// last+1. Row times never go backwards (Append and Verify see to it), so
// a binary search over seq finds it in O(log n) point reads instead of
// parsing every row's time.
func (r *reader) firstAtOrAfter(ctx context.Context, t time.Time, last int64) (int64, error) {
	lo, hi := int64(1), last+1
	for lo < hi {
		mid := lo + (hi-lo)/2
		var ts string
		if err := r.db.QueryRowContext(ctx, "SELECT ts FROM audit WHERE seq = ?", mid).Scan(&ts); err != nil {
			return 0, err
		}
		at, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil {
			return 0, fmt.Errorf("bad timestamp at seq %d", mid)
		}
		if at.Before(t) {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo, nil
}

// seqBounds turns f's time range into seqs: rows lo ≤ seq < hi.
func (r *reader) seqBounds(ctx context.Context, f Filter) (lo, hi int64, err error) {
	last, err := r.lastSeq(ctx)
	if err != nil {
		return 0, 0, err
	}
	lo, hi = max(1, f.AfterSeq+1), last+1
	if !f.Since.IsZero() {
		since, err := r.firstAtOrAfter(ctx, f.Since, last)
		if err != nil {
			return 0, 0, err
		}
		lo = max(lo, since)
	}
	if !f.Until.IsZero() {
		if hi, err = r.firstAtOrAfter(ctx, f.Until, last); err != nil {
			return 0, 0, err
		}
	}
	return lo, hi, nil
}

// scan runs the filtered query over seq range [lo, hi) in the given order
// and hands each entry to fn.
func (r *reader) scan(ctx context.Context, f Filter, lo, hi int64, desc bool, limit int, fn func(Entry) error) error {
	cond, args := f.where()
	q := r.sel + " WHERE seq >= ? AND seq < ? AND " + cond + " ORDER BY seq"
	if desc {
		q += " DESC"
	}
	args = append([]any{lo, hi}, args...)
	if limit > 0 {
		q += " LIMIT ?"
		args = append(args, limit)
	}
	rows, err := r.db.QueryContext(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return eachEntry(rows, fn)
}

// Page is one page of Query: entries newest first, and the cursor for the
// next (older) page, 0 when there is none.
type Page struct {
	Entries []Entry `json:"entries"`
	Before  int64   `json:"before,omitempty"`
}

// Query returns up to limit entries matching f with seq below before (0:
// from the newest), newest first. It opens the database read-only.
func Query(ctx context.Context, path string, f Filter, before int64, limit int) (Page, error) {
	if limit < 1 {
		return Page{}, errors.New("audit: query: limit must be at least 1")
	}
	r, err := openQuery(ctx, path)
	if err != nil {
		return Page{}, err
	}
	defer r.close()
	lo, hi, err := r.seqBounds(ctx, f)
	if err != nil {
		return Page{}, fmt.Errorf("audit: query: %w", err)
	}
	if before > 0 {
		hi = min(hi, before)
	}
	page := Page{Entries: []Entry{}}
	err = r.scan(ctx, f, lo, hi, true, limit+1, func(e Entry) error {
		page.Entries = append(page.Entries, e)
		return nil
	})
	if err != nil {
		return Page{}, fmt.Errorf("audit: query: %w", err)
	}
	if len(page.Entries) > limit {
		page.Entries = page.Entries[:limit]
		page.Before = page.Entries[limit-1].Seq
	}
	return page, nil
}

// Each hands every entry matching f to fn in seq order (an export).
func Each(ctx context.Context, path string, f Filter, fn func(Entry) error) error {
	r, err := openQuery(ctx, path)
	if err != nil {
		return err
	}
	defer r.close()
	lo, hi, err := r.seqBounds(ctx, f)
	if err != nil {
		return fmt.Errorf("audit: export: %w", err)
	}
	if err := r.scan(ctx, f, lo, hi, false, 0, fn); err != nil {
		return fmt.Errorf("audit: export: %w", err)
	}
	return nil
}

// followBatch bounds the rows one poll of Follow reads.
const followBatch = 1000

// Follow hands fn every entry after f.AfterSeq that matches f, in seq
// order, as rows are committed: it reads what is there, then polls every
// interval until ctx ends (returning nil) or fn fails. Restarting it with
// the last seq fn saw as AfterSeq resumes without a gap or a repeat. f's
// time range is ignored: a follow runs forward.
func Follow(ctx context.Context, path string, f Filter, interval time.Duration, fn func(Entry) error) error {
	if interval <= 0 {
		interval = 250 * time.Millisecond
	}
	after := f.AfterSeq
	f.Since, f.Until, f.AfterSeq = time.Time{}, time.Time{}, 0
	r, err := openQuery(ctx, path)
	if err != nil {
		return err
	}
	defer r.close()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		// Past the last row read, matching or not, so a poll never rescans.
		last, err := r.lastSeq(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("audit: follow: %w", err)
		}
		for after < last {
			hi := min(last+1, after+1+followBatch)
			if err := r.scan(ctx, f, after+1, hi, false, 0, fn); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			after = hi - 1
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Row is one stored row with its chain fields, for a reviewer.
type Row struct {
	Entry
	Leaf    string `json:"leaf"`     // hex: the RFC 6962 leaf hash of the row's body
	PrevMAC string `json:"prev_mac"` // hex: the MAC of the row before
}

// ErrNoRow is returned by ReadRow for a seq the log does not have.
var ErrNoRow = errors.New("audit: no such row")

// ReadRow returns the row with seq, and the other rows of its call (an
// intent and its outcome share a call ID).
func ReadRow(ctx context.Context, path string, seq int64) (Row, []Entry, error) {
	r, err := openQuery(ctx, path)
	if err != nil {
		return Row{}, nil, err
	}
	defer r.close()
	s, err := scanRow(r.db.QueryRowContext(ctx, r.sel+" WHERE seq = ?", seq))
	if errors.Is(err, sql.ErrNoRows) {
		return Row{}, nil, ErrNoRow
	}
	if err != nil {
		return Row{}, nil, fmt.Errorf("audit: read row: %w", err)
	}
	e, err := s.entry()
	if err != nil {
		return Row{}, nil, err
	}
	row := Row{Entry: e, Leaf: hex.EncodeToString(s.Leaf), PrevMAC: hex.EncodeToString(s.PrevMAC)}
	var call []Entry
	if e.CallID != "" {
		// Rows of one call are written close together; bound the search.
		err = r.scan(ctx, Filter{CallID: e.CallID}, max(1, seq-10000), seq+10000, false, 20, func(o Entry) error {
			if o.Seq != seq {
				call = append(call, o)
			}
			return nil
		})
		if err != nil {
			return Row{}, nil, fmt.Errorf("audit: read row: %w", err)
		}
	}
	return row, call, nil
}

// Head is the log's state at a glance: its newest row and its latest
// signed checkpoint.
type Head struct {
	LastSeq  int64     `json:"last_seq"`
	LastTime time.Time `json:"last_ts,omitzero"`
	// Checkpoints counts the valid signed checkpoints; Checkpoint is the
	// newest of them (nil when there is none).
	Checkpoints int             `json:"checkpoints"`
	Checkpoint  *CheckpointHead `json:"checkpoint,omitempty"`
	// CheckpointProblem is why the checkpoint file stops verifying, if it does.
	CheckpointProblem string `json:"checkpoint_problem,omitempty"`
}

// CheckpointHead is one signed checkpoint: the tree size it covers and
// the RFC 6962 root it signs.
type CheckpointHead struct {
	Size int64  `json:"size"`
	Root string `json:"root"` // base64, as in the signed note
	Note string `json:"note"` // the whole signed note
}

// ReadHead reads the newest row and checkpoint. The checkpoint signatures
// are checked with v; it does not verify the chain (Verify does).
func ReadHead(ctx context.Context, path, checkpointPath string, v note.Verifier) (Head, error) {
	var h Head
	cps, problem, err := readCheckpoints(checkpointPath, v)
	if err != nil {
		return h, err
	}
	h.Checkpoints, h.CheckpointProblem = len(cps), problem
	if len(cps) > 0 {
		cp := cps[len(cps)-1]
		h.Checkpoint = &CheckpointHead{Size: cp.Size, Root: base64.StdEncoding.EncodeToString(cp.Root[:]), Note: string(cp.Msg)}
	}
	r, err := openQuery(ctx, path)
	if errors.Is(err, ErrNoDatabase) {
		return h, nil
	}
	if err != nil {
		return h, err
	}
	defer r.close()
	var ts sql.NullString
	if err := r.db.QueryRowContext(ctx, "SELECT seq, ts FROM audit ORDER BY seq DESC LIMIT 1").Scan(&h.LastSeq, &ts); err != nil && !errors.Is(err, sql.ErrNoRows) {
		return h, fmt.Errorf("audit: head: %w", err)
	}
	if ts.Valid {
		h.LastTime, _ = time.Parse(time.RFC3339Nano, ts.String)
	}
	return h, nil
}
