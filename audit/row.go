package audit

import (
	"bytes"
	"crypto/hmac"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"

	"golang.org/x/mod/sumdb/tlog"
)

// selectRow lists every stored column in scanRow's order.
const selectRow = selectV1Columns + `, body_version, transport, client_addr, user_agent, mcp_session, toolset FROM audit`

const selectV1Columns = `SELECT seq, ts, call_id, phase, principal, tool, params, outcome,
	error_code, duration_ms, leaf, prev_mac, mac, kid`

// selectRowFor is selectRow for a database at schema version v, which
// readers never migrate: columns added later read as the defaults their
// migration gives existing rows.
func selectRowFor(v int) (string, error) {
	switch v {
	case 1:
		return selectV1Columns + `, 1, '', '', '', '', '' FROM audit`, nil
	case schemaVersion:
		return selectRow, nil
	}
	return "", fmt.Errorf("audit: unsupported schema version %d", v)
}

// storedRow is one row exactly as stored.
type storedRow struct {
	Seq     int64
	TS      string
	V       int // body version
	Rec     Record
	Leaf    []byte
	PrevMAC []byte
	MAC     []byte
	KeyID   string
}

type scanner interface{ Scan(dest ...any) error }

func scanRow(s scanner) (storedRow, error) {
	var r storedRow
	var phase, outcome, params string
	o := &r.Rec.Source
	err := s.Scan(&r.Seq, &r.TS, &r.Rec.CallID, &phase, &r.Rec.Principal, &r.Rec.Tool,
		&params, &outcome, &r.Rec.ErrorCode, &r.Rec.DurationMS, &r.Leaf, &r.PrevMAC, &r.MAC, &r.KeyID,
		&r.V, &o.Transport, &o.ClientAddr, &o.UserAgent, &o.MCPSession, &o.Toolset)
	r.Rec.Phase, r.Rec.Outcome, r.Rec.Params = Phase(phase), Outcome(outcome), json.RawMessage(params)
	return r, err
}

// recompute derives leaf and MAC from the logical columns alone, with the
// given previous MAC (the verifier's, not the row's own prev_mac column).
func (r storedRow) recompute(key, prevMAC []byte) (tlog.Hash, []byte, error) {
	// Params must be stored compact; otherwise whitespace edits would not
	// change the body.
	var c bytes.Buffer
	if err := json.Compact(&c, r.Rec.Params); err != nil || !bytes.Equal(c.Bytes(), r.Rec.Params) {
		return tlog.Hash{}, nil, fmt.Errorf("params not canonical JSON")
	}
	body, err := bodyFor(r.V, r.Seq, r.TS, r.KeyID, r.Rec)
	if err != nil {
		return tlog.Hash{}, nil, err
	}
	b, err := marshalBody(body)
	if err != nil {
		return tlog.Hash{}, nil, err
	}
	leaf := leafHash(b)
	return leaf, computeMAC(key, r.Seq, prevMAC, leaf), nil
}

// check returns "" if the row's MAC and leaf verify against prevMAC, or a
// short reason.
func (r storedRow) check(key, prevMAC []byte) string {
	leaf, mac, err := r.recompute(key, prevMAC)
	switch {
	case err != nil:
		return "mac mismatch (unreadable row: " + err.Error() + ")"
	case !hmac.Equal(mac, r.MAC):
		return "mac mismatch"
	case !bytes.Equal(leaf[:], r.Leaf):
		return "leaf mismatch"
	}
	return ""
}

func (r storedRow) entry() (Entry, error) {
	ts, err := time.Parse(time.RFC3339Nano, r.TS)
	if err != nil {
		return Entry{}, fmt.Errorf("audit: seq %d: bad timestamp", r.Seq)
	}
	return Entry{Seq: r.Seq, Time: ts.UTC(), Record: r.Rec, KeyID: r.KeyID, MAC: hex.EncodeToString(r.MAC)}, nil
}
