package audit

import (
	"bytes"
	"context"
	"crypto/hmac"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// VerifyOptions says what to verify and with which keys (HMACKey and
// Verifier are required; Signer is unused).
type VerifyOptions struct {
	Path           string
	CheckpointPath string
	Keys           Keys
}

// VerifyReport is Verify's finding. Only the first problem is reported:
// row problems in seq order first, then checkpoint-file and trigger problems.
type VerifyReport struct {
	OK          bool
	Rows        int64 // rows in the database
	Checkpoints int   // valid checkpoints read (up to the first bad one)
	FirstBadSeq int64 // 0 when OK, and for problems not tied to a row
	Problem     string
}

// Verify recomputes every leaf and MAC from the stored logical columns,
// checks that seqs are dense, timestamps never go backwards, the RFC 6962
// root at every checkpoint size equals the signed one, and the log is at
// least as long as its newest checkpoint. Tamper findings go in the report;
// err is only for I/O and configuration problems. It opens the database
// read-only and never modifies anything.
//
// How each case is reported (FirstBadSeq: Problem):
//
//	edited column in row k           k: "mac mismatch"
//	edited leaf / prev_mac / kid     k: "leaf mismatch" / "prev_mac mismatch" / "unknown kid"
//	deleted row k                    k: "missing row (gap)"
//	forged or renumbered row at k    k: "mac mismatch"
//	first seq below 1                1: "sequence out of order (found seq s)"
//	backdated row k (re-MACed)       k: "timestamp went backwards"
//	rows after m deleted, a          m+1: "truncated below checkpoint (size S, rows m)"
//	checkpoint of size S > m
//	database deleted, checkpoints    1: "database missing: truncated below checkpoint (size S, rows 0)"
//	chain rewritten with the HMAC    S: "checkpoint root mismatch (size S; rows p+1..S
//	key, no signing key                 differ from the signed tree)", S the first
//	                                    checkpoint that disagrees, p the last that agreed
//	unsigned/edited checkpoint i     0: "checkpoint signature invalid (checkpoint i)"
//	unparsable checkpoint i          0: "checkpoint malformed (checkpoint i...)"
//	checkpoint sizes decrease        0: "checkpoint sizes out of order (checkpoint i)"
//	triggers dropped                 0: "append-only triggers missing: [...]"
//
// A missing database with no checkpoints is an error (nothing to compare);
// a missing checkpoint file is zero checkpoints, so callers should alert on
// Rows > 0 && Checkpoints == 0. The checkpoint file is read before the
// database, so a log being appended to concurrently never looks truncated.
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
	cps, cpProblem, err := readCheckpoints(opts.CheckpointPath, opts.Keys.Verifier)
	if err != nil {
		return rep, err
	}
	rep.Checkpoints = len(cps)

	db, sel, err := openReader(ctx, opts.Path)
	if errors.Is(err, ErrNoDatabase) && len(cps) > 0 {
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
	tx, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		return rep, fmt.Errorf("audit: verify: %w", err)
	}
	defer tx.Rollback()
	if err := tx.QueryRowContext(ctx, "SELECT count(*) FROM audit").Scan(&rep.Rows); err != nil {
		return rep, fmt.Errorf("audit: verify: %w", err)
	}
	rows, err := tx.QueryContext(ctx, sel+" ORDER BY seq")
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
	// Triggers only stop application bugs, but their absence shows someone
	// wrote to the file outside the app.
	missing, err := missingTriggers(ctx, tx, statedb.IsPostgresURL(opts.Path))
	if err != nil {
		return rep, fmt.Errorf("audit: verify: %w", err)
	}
	if len(missing) > 0 {
		return fail(0, fmt.Sprintf("append-only triggers missing: %v", missing))
	}
	rep.OK = true
	return rep, nil
}
