package audit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// Phase says whether a row was written before (intent) or after (outcome) a
// tool call ran.
type Phase string

// Phases.
const (
	PhaseIntent  Phase = "intent"
	PhaseOutcome Phase = "outcome"
)

// Outcome is the result recorded in an outcome row.
type Outcome string

// Outcomes. Intent rows carry OutcomeNone.
const (
	OutcomeNone        Outcome = ""
	OutcomeSuccess     Outcome = "success"
	OutcomeFailure     Outcome = "failure"
	OutcomeRateLimited Outcome = "rate_limited"
	OutcomeDenied      Outcome = "denied"
)

// Record is what a caller appends. Params must already be free of secrets.
type Record struct {
	CallID     string          `json:"call_id"`
	Phase      Phase           `json:"phase"`
	Principal  string          `json:"principal"`
	Tool       string          `json:"tool"`
	Params     json.RawMessage `json:"params"` // nil means "{}"
	Outcome    Outcome         `json:"outcome"`
	ErrorCode  string          `json:"error_code"`
	DurationMS int64           `json:"duration_ms"`
}

// Entry is a stored row as Tail and Export print it.
type Entry struct {
	Seq  int64     `json:"seq"`
	Time time.Time `json:"ts"`
	Record
	KeyID string `json:"kid"`
	MAC   string `json:"mac"` // hex
}

// body is the canonical serialisation that leaf hashes cover. Field order is
// fixed by the struct; never reorder or rename, or old rows stop verifying.
type body struct {
	V          int             `json:"v"`
	Seq        int64           `json:"seq"`
	TS         string          `json:"ts"`
	CallID     string          `json:"call_id"`
	Phase      string          `json:"phase"`
	Principal  string          `json:"principal"`
	Tool       string          `json:"tool"`
	Params     json.RawMessage `json:"params"`
	Outcome    string          `json:"outcome"`
	ErrorCode  string          `json:"error_code"`
	DurationMS int64           `json:"duration_ms"`
	KeyID      string          `json:"kid"`
}

const bodyVersion = 1

// marshalBody is deterministic: strings are valid UTF-8 (normalise ensures
// it for new rows) and params is compact JSON, so encoding/json emits the
// same bytes for the same columns every time.
func marshalBody(b body) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(b); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

var errInvalidRecord = errors.New("audit: invalid record")

// normalise validates r and returns the exact column values to store.
// Strings are forced to valid UTF-8 because encoding/json would otherwise
// map different invalid inputs to the same body, letting an edit go unseen.
func normalise(r Record) (Record, error) {
	switch {
	case r.Phase == PhaseIntent && r.Outcome == OutcomeNone:
	case r.Phase == PhaseOutcome && validOutcome(r.Outcome):
	default:
		return Record{}, fmt.Errorf("%w: phase %q with outcome %q", errInvalidRecord, r.Phase, r.Outcome)
	}
	if r.DurationMS < 0 {
		return Record{}, fmt.Errorf("%w: negative duration", errInvalidRecord)
	}
	p := r.Params
	if len(bytes.TrimSpace(p)) == 0 {
		p = json.RawMessage("{}")
	}
	if !utf8.Valid(p) || !json.Valid(p) {
		return Record{}, fmt.Errorf("%w: params is not valid UTF-8 JSON", errInvalidRecord)
	}
	var c bytes.Buffer
	if err := json.Compact(&c, p); err != nil {
		return Record{}, fmt.Errorf("%w: params: %v", errInvalidRecord, err)
	}
	return Record{
		CallID:     strings.ToValidUTF8(r.CallID, "\uFFFD"),
		Phase:      r.Phase,
		Principal:  strings.ToValidUTF8(r.Principal, "\uFFFD"),
		Tool:       strings.ToValidUTF8(r.Tool, "\uFFFD"),
		Params:     json.RawMessage(c.Bytes()),
		Outcome:    r.Outcome,
		ErrorCode:  strings.ToValidUTF8(r.ErrorCode, "\uFFFD"),
		DurationMS: r.DurationMS,
	}, nil
}

func validOutcome(o Outcome) bool {
	switch o {
	case OutcomeSuccess, OutcomeFailure, OutcomeRateLimited, OutcomeDenied:
		return true
	}
	return false
}

// bodyFor builds the canonical body for a stored row.
func bodyFor(seq int64, ts, kid string, r Record) body {
	return body{
		V:          bodyVersion,
		Seq:        seq,
		TS:         ts,
		CallID:     r.CallID,
		Phase:      string(r.Phase),
		Principal:  r.Principal,
		Tool:       r.Tool,
		Params:     r.Params,
		Outcome:    string(r.Outcome),
		ErrorCode:  r.ErrorCode,
		DurationMS: r.DurationMS,
		KeyID:      kid,
	}
}
