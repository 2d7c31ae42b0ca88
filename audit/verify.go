package audit

import (
	"bytes"
	"context"
	"crypto/hmac"
	"errors"
	"fmt"
	"time"
)

// VerifyOptions says what to verify and with which keys (HMACKey and
// Verifier are required; Signer is unused).
type VerifyOptions struct {
	Path           string
	CheckpointPath string
	Keys           Keys
}

// VerifyReport is Verify's finding. Only the first problem is reported.
type VerifyReport struct {
	OK          bool
	Rows        int64
	Checkpoints int   // valid checkpoints read
	FirstBadSeq int64 // 0 when OK, and for problems not tied to a row
	Problem     string
}

// Verify recomputes every leaf and MAC from the stored columns, checks that
// seqs are dense, timestamps never go backwards, and the RFC 6962 root at
// every checkpoint size equals the signed one, and that the log is at least
// as long as its newest checkpoint. Tamper findings go in the report; err is
// only for I/O and configuration problems. It never modifies the files.
//
// The checkpoint file is read before the database, so a log being appended
// to concurrently never looks truncated.
func Verify(ctx context.Context, opts VerifyOptions) (VerifyReport, error) {
	var rep VerifyReport
	if len(opts.Keys.HMACKey) < minHMACKey {
		return rep, fmt.Errorf("audit: HMAC key must be at least %d bytes", minHMACKey)
	}
	if opts.Keys.Verifier == nil {
		return rep, errors.New("audit: checkpoint Verifier is required")
	}
	kid := opts.Keys.KeyID
	if kid == "" {
		kid = keyID(opts.Keys.HMACKey)
	}
	cps, _, cpProblem, err := readCheckpoints(opts.CheckpointPath, opts.Keys.Verifier)
	if err != nil {
		return rep, err
	}
	rep.Checkpoints = len(cps)

	db, err := openReader(ctx, opts.Path)
	if errors.Is(err, errNoDB) && len(cps) > 0 {
		last := cps[len(cps)-1].Size
		rep.FirstBadSeq = 1
		rep.Problem = fmt.Sprintf("database missing: truncated below checkpoint (size %d, rows 0)", last)
		return rep, nil
	}
	if err != nil {
		return rep, err
	}
	defer db.Close()
	// One transaction: the count and the scan see the same snapshot.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return rep, fmt.Errorf("audit: verify: %w", err)
	}
	defer tx.Rollback()
	if err := tx.QueryRowContext(ctx, "SELECT count(*) FROM audit").Scan(&rep.Rows); err != nil {
		return rep, fmt.Errorf("audit: verify: %w", err)
	}
	rows, err := tx.QueryContext(ctx, selectRow+" ORDER BY seq")
	if err != nil {
		return rep, fmt.Errorf("audit: verify: %w", err)
	}
	defer rows.Close()

	fail := func(seq int64, problem string) (VerifyReport, error) {
		rep.FirstBadSeq, rep.Problem = seq, problem
		return rep, nil
	}
	var (
		cr       compactRange
		prevSeq  int64
		prevMAC  = zeroMAC
		prevTS   time.Time
		cpIdx    int
		cpPrev   int64 // size of the last checkpoint that matched
		key      = opts.Keys.HMACKey
		tsFormat = time.RFC3339Nano
	)
	for cpIdx < len(cps) && cps[cpIdx].Size == 0 {
		cpIdx++
	}
	for rows.Next() {
		r, err := scanRow(rows)
		if err != nil {
			return rep, fmt.Errorf("audit: verify: row after seq %d: %w", prevSeq, err)
		}
		want := prevSeq + 1
		switch {
		case r.Seq < want:
			return fail(want, fmt.Sprintf("sequence out of order (found seq %d)", r.Seq))
		case r.Seq > want:
			return fail(want, "missing row (gap)")
		case r.KeyID != kid:
			return fail(r.Seq, "unknown kid")
		}
		leaf, mac, err := r.recompute(key, prevMAC)
		switch {
		case err != nil:
			return fail(r.Seq, "mac mismatch (unreadable row: "+err.Error()+")")
		case !hmac.Equal(mac, r.MAC):
			return fail(r.Seq, "mac mismatch")
		case !bytes.Equal(leaf[:], r.Leaf):
			return fail(r.Seq, "leaf mismatch")
		case !bytes.Equal(r.PrevMAC, prevMAC):
			return fail(r.Seq, "prev_mac mismatch")
		}
		ts, err := time.Parse(tsFormat, r.TS)
		switch {
		case err != nil || ts.Format(tsFormat) != r.TS:
			return fail(r.Seq, "bad timestamp")
		case ts.Before(prevTS):
			return fail(r.Seq, "timestamp went backwards")
		}
		cr.append(leaf)
		prevSeq, prevMAC, prevTS = r.Seq, r.MAC, ts
		for cpIdx < len(cps) && cps[cpIdx].Size == r.Seq {
			if cr.root() != cps[cpIdx].Root {
				return fail(r.Seq, fmt.Sprintf("checkpoint root mismatch (size %d; rows %d..%d differ from the signed tree)", r.Seq, cpPrev+1, r.Seq))
			}
			cpPrev = r.Seq
			cpIdx++
		}
	}
	if err := rows.Err(); err != nil {
		return rep, fmt.Errorf("audit: verify: %w", err)
	}
	if prevSeq != rep.Rows {
		return rep, fmt.Errorf("audit: verify: row count changed during scan")
	}
	if cpIdx < len(cps) {
		last := cps[len(cps)-1].Size
		return fail(prevSeq+1, fmt.Sprintf("truncated below checkpoint (size %d, rows %d)", last, prevSeq))
	}
	if cpProblem != "" {
		return fail(0, cpProblem)
	}
	rep.OK = true
	return rep, nil
}
