package codesandbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"unicode"
)

// maxServerMessage bounds the server text we keep in an error cause.
const maxServerMessage = 200

// envelope is the management API's wrapper (codesandbox-api.md §1.1).
type envelope struct {
	Success *bool             `json:"success"`
	Errors  []json.RawMessage `json:"errors"`
	Data    json.RawMessage   `json:"data"`
}

var (
	errNoEnvelope = errors.New("response is not a JSON envelope")
	errNoData     = errors.New("no data returned")
	errNotSuccess = errors.New("envelope reports success=false")
)

// decodeEnvelope returns the envelope's data and its first error message.
// Bodies that are not an envelope (429s without one, HTML from a gateway)
// give errNoEnvelope and no message.
func decodeEnvelope(body []byte) (data json.RawMessage, msg string, err error) {
	var env envelope
	if err := json.Unmarshal(body, &env); err != nil {
		return nil, "", errNoEnvelope
	}
	if len(env.Errors) > 0 {
		msg = errorText(env.Errors[0])
	}
	if env.Success != nil && !*env.Success {
		return nil, msg, errNotSuccess
	}
	d := bytes.TrimSpace(env.Data)
	if len(d) == 0 || bytes.Equal(d, []byte("null")) {
		return nil, msg, errNoData
	}
	return env.Data, msg, nil
}

// errorText renders one entry of errors[]: a string, or an object whose
// "message" (or whole JSON) is used. It is cleaned and bounded because it
// ends up in logs.
func errorText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) != nil {
		var obj struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(raw, &obj) == nil && obj.Message != "" {
			s = obj.Message
		} else {
			s = string(raw)
		}
	}
	return cleanText(s, maxServerMessage)
}

// cleanText drops control characters and cuts s to at most n bytes on a
// rune boundary.
func cleanText(s string, n int) string {
	var b strings.Builder
	for _, r := range s {
		if unicode.IsControl(r) || r == unicode.ReplacementChar {
			r = ' '
		}
		if b.Len()+len(string(r)) > n {
			break
		}
		b.WriteRune(r)
	}
	return b.String()
}
