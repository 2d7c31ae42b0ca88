// Package egress is the per-session HTTP/CONNECT forward proxy that gives a
// sandbox its only network path. It checks every request against the
// session's Policy, resolves names itself, refuses any non-public address
// and dials the checked IP, never the name.
package egress

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Mode is the kind of network access a sandbox gets.
type Mode string

// Modes.
const (
	ModeNone   Mode = "none"   // no network at all (the default)
	ModeAllow  Mode = "allow"  // only Allowed names, minus Denied
	ModePublic Mode = "public" // any public address
)

// Limits on a policy.
const (
	MaxDomains    = 64
	maxPolicyJSON = 64 << 10
)

// Policy is a sandbox's egress policy. Entries are normalised: lower-case
// DNS names without a trailing dot, or "*." plus such a name. A wildcard
// matches strict subdomains only, and Denied wins over Allowed.
type Policy struct {
	Mode    Mode
	Allowed []string
	Denied  []string
}

// Reasons reported in Decision.Reason and in logs.
const (
	ReasonAllowed        = "allowed"
	ReasonNetworkNone    = "network_none"
	ReasonNotAllowed     = "not_in_allowed_domains"
	ReasonDenied         = "in_denied_domains"
	ReasonIPLiteral      = "ip_literal"
	ReasonInvalidHost    = "invalid_host"
	ReasonPort           = "port_not_allowed"
	ReasonBlockedAddress = "blocked_address"
	ReasonResolveFailed  = "resolve_failed"
	ReasonDialFailed     = "dial_failed"
	ReasonSNIMismatch    = "sni_mismatch"
	ReasonSNIMissing     = "sni_missing"
	ReasonNotTLS         = "not_tls"
	ReasonConnLimit      = "conn_limit"
	ReasonByteLimit      = "byte_limit"
	ReasonMalformed      = "malformed_request"
	ReasonHeaderTooLarge = "header_too_large"
	ReasonScheme         = "unsupported_scheme"
	ReasonTimeout        = "timeout"
	ReasonClientGone     = "client_gone"
)

// ParsePolicy reads the sandbox_config.network tool argument: absent or
// null means "none"; the strings "none" and "public"; or an object
// {"allowed_domains": [...], "denied_domains": [...]} with no other keys.
// Errors are brokererr.InvalidInput.
func ParsePolicy(raw json.RawMessage) (Policy, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return Policy{Mode: ModeNone}, nil
	}
	if len(raw) > maxPolicyJSON {
		return Policy{}, invalid("network is too large")
	}
	switch raw[0] {
	case '"':
		var s string
		if err := strictDecode(raw, &s); err != nil {
			return Policy{}, invalid(`network must be "none", "public" or an object with allowed_domains`)
		}
		switch s {
		case "none":
			return Policy{Mode: ModeNone}, nil
		case "public":
			return Policy{Mode: ModePublic}, nil
		}
		return Policy{}, invalid(`network must be "none", "public" or an object with allowed_domains, not %s`, quoteShort(s))
	case '{':
		return parseObject(raw)
	}
	return Policy{}, invalid(`network must be "none", "public" or an object with allowed_domains`)
}

// parseObject walks the object token by token: encoding/json alone would
// match keys case-insensitively and let a duplicate key override the first.
func parseObject(raw []byte) (Policy, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if _, err := dec.Token(); err != nil {
		return Policy{}, invalid("network is not valid JSON")
	}
	var allowed, denied []string
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return Policy{}, invalid("network is not valid JSON")
		}
		key, _ := tok.(string)
		if key != "allowed_domains" && key != "denied_domains" {
			return Policy{}, invalid("network has unknown key %s; allowed keys are allowed_domains and denied_domains", quoteShort(key))
		}
		if seen[key] {
			return Policy{}, invalid("network has %s twice", key)
		}
		seen[key] = true
		var list []string
		if err := dec.Decode(&list); err != nil {
			return Policy{}, invalid("network.%s must be an array of strings", key)
		}
		if key == "allowed_domains" {
			allowed = list
		} else {
			denied = list
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return Policy{}, invalid("network is not valid JSON")
	}
	if _, err := dec.Token(); err != io.EOF {
		return Policy{}, invalid("network has trailing data")
	}
	if len(allowed) == 0 {
		return Policy{}, invalid(`network.allowed_domains must list at least one domain; use "none" for no network or "public" for any public host`)
	}
	p := Policy{Mode: ModeAllow, Allowed: allowed, Denied: denied}
	return p.Normalize()
}

// Normalize validates a policy built by hand (or parsed) and returns it with
// every entry in canonical form and duplicates removed.
func (p Policy) Normalize() (Policy, error) {
	if p.Mode == "" {
		p.Mode = ModeNone
	}
	switch p.Mode {
	case ModeNone, ModePublic:
		if len(p.Allowed) > 0 {
			return Policy{}, invalid("network mode %q takes no allowed_domains", p.Mode)
		}
	case ModeAllow:
		if len(p.Allowed) == 0 {
			return Policy{}, invalid("network.allowed_domains must list at least one domain")
		}
	default:
		return Policy{}, invalid("unknown network mode %s", quoteShort(string(p.Mode)))
	}
	var err error
	out := Policy{Mode: p.Mode}
	if out.Allowed, err = normalizeList("allowed_domains", p.Allowed); err != nil {
		return Policy{}, err
	}
	if out.Denied, err = normalizeList("denied_domains", p.Denied); err != nil {
		return Policy{}, err
	}
	return out, nil
}

func normalizeList(key string, in []string) ([]string, error) {
	if len(in) > MaxDomains {
		return nil, invalid("network.%s has %d entries; at most %d are allowed", key, len(in), MaxDomains)
	}
	var out []string
	seen := map[string]bool{}
	for i, e := range in {
		n, err := normalizeEntry(e)
		if err != nil {
			return nil, invalid("network.%s[%d]: %s is not a valid domain: %v", key, i, quoteShort(e), err)
		}
		if !seen[n] {
			seen[n] = true
			out = append(out, n)
		}
	}
	return out, nil
}

var (
	errEntryIP       = errors.New("IP addresses are not accepted, list domain names")
	errEntryWildcard = errors.New(`a wildcard must be "*." followed by a domain with at least two labels, such as *.example.com`)
)

// normalizeEntry canonicalises one policy entry: "name" or "*.name".
func normalizeEntry(e string) (string, error) {
	wild := strings.HasPrefix(e, "*.")
	if wild {
		e = e[2:]
	}
	if strings.Contains(e, "*") {
		return "", errEntryWildcard
	}
	name, ip, err := NormalizeHost(e)
	if err != nil {
		if wild && (err == errHostSingle || err == errHostEmpty) {
			return "", errEntryWildcard
		}
		return "", err
	}
	if ip.IsValid() {
		return "", errEntryIP
	}
	if wild {
		return "*." + name, nil
	}
	return name, nil
}

// Match reports whether the policy allows host by name alone (no address
// or port checks), with a Reason* code.
func (p Policy) Match(host string) (bool, string) {
	name, ip, err := NormalizeHost(host)
	if err != nil {
		return false, ReasonInvalidHost
	}
	ok, reason, _ := p.match(name, ip)
	return ok, reason
}

// match takes a host already normalised by NormalizeHost. rule says which
// part of the policy decided a refusal, for the model to read.
func (p Policy) match(name string, ip netip.Addr) (ok bool, reason, rule string) {
	switch p.Mode {
	case ModePublic, ModeAllow:
	default:
		return false, ReasonNetworkNone, `network: "none"`
	}
	if ip.IsValid() {
		if p.Mode == ModePublic {
			return true, ReasonAllowed, ""
		}
		return false, ReasonIPLiteral, "allowed_domains lists domain names only"
	}
	if e := matchEntry(p.Denied, name); e != "" {
		return false, ReasonDenied, fmt.Sprintf("denied_domains entry %q", e)
	}
	if p.Mode == ModePublic || matchEntry(p.Allowed, name) != "" {
		return true, ReasonAllowed, ""
	}
	return false, ReasonNotAllowed, "allowed_domains [" + listShort(p.Allowed) + "]"
}

// matchEntry returns the first entry that matches name, or "". Exact
// entries match exactly; "*.s" matches names ending in ".s" (a label
// boundary), never s itself. Both sides are canonical.
func matchEntry(entries []string, name string) string {
	for _, e := range entries {
		if suffix, ok := strings.CutPrefix(e, "*"); ok {
			if len(name) > len(suffix) && strings.HasSuffix(name, suffix) {
				return e
			}
		} else if e == name {
			return e
		}
	}
	return ""
}

// listShort joins entries for a message, eliding past about 200 bytes:
// the rule is repeated in every refusal the model reads.
func listShort(entries []string) string {
	const budget = 200
	var b strings.Builder
	for i, e := range entries {
		if i > 0 && b.Len()+len(e) > budget {
			fmt.Fprintf(&b, ", … %d more", len(entries)-i)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(e)
	}
	return b.String()
}

// String is the compact form for logs and the audit trail:
// "none", "public" or "allow=a.com,*.b.com deny=x.b.com".
func (p Policy) String() string {
	switch p.Mode {
	case ModeNone, "":
		return "none"
	case ModePublic:
		return "public"
	}
	s := "allow=" + strings.Join(p.Allowed, ",")
	if len(p.Denied) > 0 {
		s += " deny=" + strings.Join(p.Denied, ",")
	}
	return s
}

// JSONSchema describes the sandbox_config.network argument for tool
// listings; ParsePolicy is the authority, the schema only guides clients.
func JSONSchema() map[string]any {
	list := func(desc string, min int) map[string]any {
		return map[string]any{
			"type":        "array",
			"description": desc,
			"minItems":    min,
			"maxItems":    MaxDomains,
			"items": map[string]any{
				"type":      "string",
				"minLength": 1,
				"maxLength": MaxHostLen + 3,
				"pattern":   `^(\*\.)?[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+\.?$`,
			},
		}
	}
	return map[string]any{
		"description": `Network access for the sandbox. "none" (default): no network. "public": any public internet host (private, loopback and metadata addresses are always refused). An object allows only the listed domains over HTTP(S) via the sandbox's HTTP proxy; "*.example.com" matches subdomains of example.com but not example.com itself, and denied_domains wins.`,
		"oneOf": []any{
			map[string]any{"type": "string", "enum": []any{"none"}, "description": "No network access."},
			map[string]any{"type": "string", "enum": []any{"public"}, "description": "Any public host on ports 80 and 443."},
			map[string]any{
				"type":                 "object",
				"additionalProperties": false,
				"required":             []any{"allowed_domains"},
				"properties": map[string]any{
					"allowed_domains": list("Domains the sandbox may reach: exact names or *.suffix wildcards (ASCII; use punycode for international names).", 1),
					"denied_domains":  list("Domains refused even when allowed_domains matches.", 0),
				},
			},
		},
	}
}

func strictDecode(raw []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("trailing data")
	}
	return nil
}

func invalid(format string, args ...any) error {
	return brokererr.New(brokererr.InvalidInput, format, args...)
}

// quoteShort quotes model-supplied text for an error message, cut short.
func quoteShort(s string) string {
	const max = 80
	if len(s) > max {
		s = s[:max] + "…"
	}
	return fmt.Sprintf("%q", s)
}
