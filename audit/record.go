package audit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
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
	Source
}

// Source is where a call came from and what it belongs to. Rows written
// before schema version 2 have none; export omits the empty fields.
type Source struct {
	Transport  string `json:"transport,omitempty"`   // "stdio", "http" or "console"
	ClientAddr string `json:"client_addr,omitempty"` // the HTTP peer, host:port
	UserAgent  string `json:"user_agent,omitempty"`  // as sent, cleaned and capped
	MCPSession string `json:"mcp_session,omitempty"` // the MCP session ID
	Toolset    string `json:"toolset,omitempty"`     // the tool's toolset
}

// Caps on Source fields; the user agent is whatever the client sent.
const (
	MaxUserAgent  = 256
	maxSourceText = 128
)

// Entry is a stored row as Tail and Export print it.
type Entry struct {
	Seq  int64     `json:"seq"`
	Time time.Time `json:"ts"`
	Record
	KeyID string `json:"kid"`
	MAC   string `json:"mac"` // hex
}

// body is the canonical serialisation that leaf hashes cover, as rows of
// body version 1 have it. Field order is fixed by the struct; never reorder
// or rename, or old rows stop verifying.
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

// bodyV2 is body version 2: version 1's fields, then the Source's, all
// always present. The stored body_version says which a row uses, and the
// body itself says it too ("v"), so relabelling a row breaks its MAC.
type bodyV2 struct {
	body
	Transport  string `json:"transport"`
	ClientAddr string `json:"client_addr"`
	UserAgent  string `json:"user_agent"`
	MCPSession string `json:"mcp_session"`
	Toolset    string `json:"toolset"`
}

// bodyVersion is what new rows are written with.
const bodyVersion = 2

// marshalBody is deterministic: strings are valid UTF-8 (normalise ensures
// it for new rows) and params is compact JSON, so encoding/json emits the
// same bytes for the same columns every time.
func marshalBody(b any) ([]byte, error) {
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
	switch r.Transport {
	case "", "stdio", "http", "console":
	default:
		return Record{}, fmt.Errorf("%w: transport %q", errInvalidRecord, r.Transport)
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
		Source: Source{
			Transport:  r.Transport,
			ClientAddr: cleanText(r.ClientAddr, maxSourceText),
			UserAgent:  cleanText(r.UserAgent, MaxUserAgent),
			MCPSession: cleanText(r.MCPSession, maxSourceText),
			Toolset:    cleanText(r.Toolset, maxSourceText),
		},
	}, nil
}

// cleanText makes a client-chosen string safe to store and show: valid
// UTF-8, controls and invisible characters as U+FFFD (so a reader of an
// export sees that something was there), at most max bytes.
func cleanText(s string, max int) string {
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) || textsafe.Invisible(r) {
			return utf8.RuneError
		}
		return r
	}, strings.ToValidUTF8(s, "\uFFFD"))
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

func validOutcome(o Outcome) bool {
	switch o {
	case OutcomeSuccess, OutcomeFailure, OutcomeRateLimited, OutcomeDenied:
		return true
	}
	return false
}

// bodyFor builds the canonical body of version v for a stored row.
func bodyFor(v int, seq int64, ts, kid string, r Record) (any, error) {
	b := body{
		V:          v,
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
	switch v {
	case 1:
		if r.Source != (Source{}) {
			return nil, errors.New("body version 1 has no source")
		}
		return b, nil
	case 2:
		o := r.Source
		return bodyV2{body: b, Transport: o.Transport, ClientAddr: o.ClientAddr, UserAgent: o.UserAgent,
			MCPSession: o.MCPSession, Toolset: o.Toolset}, nil
	}
	return nil, fmt.Errorf("unknown body version %d", v)
}
