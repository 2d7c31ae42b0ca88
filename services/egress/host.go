package egress

import (
	"errors"
	"net/netip"
	"strconv"
	"strings"
)

// MaxHostLen is the longest DNS name accepted (RFC 1035, without the root dot).
const MaxHostLen = 253

var (
	errHostEmpty   = errors.New("empty host")
	errHostLong    = errors.New("host longer than 253 bytes")
	errHostLabel   = errors.New("host has an empty or over-long label")
	errHostChars   = errors.New("host may only contain ASCII letters, digits, hyphens and dots (use punycode xn-- for international names)")
	errHostHyphen  = errors.New("host label starts or ends with a hyphen")
	errHostSingle  = errors.New("host must have at least two labels")
	errHostNumeric = errors.New("host looks like a number, not a domain name (IP addresses must be written in canonical form)")
	errHostIP      = errors.New("IP address is not in canonical form")
	errHostMapped  = errors.New("IPv4-mapped IPv6 addresses are not accepted; use the IPv4 form")
	errHostPort    = errors.New("invalid port")
)

// NormalizeHost returns the canonical form of a request host: a lower-case
// DNS name without its trailing dot, or a canonical IP literal (IPv6
// without brackets). ip is valid only for IP literals. Only forms that every
// parser reads the same way pass: IPv4 literals must be dotted-quad decimal
// (netip refuses 127.1, 0x7f.0.0.1, 0177.0.0.1, 2130706433), IPv6 literals
// must be bracket-free, zone-free, canonical and not IPv4-mapped. A name
// whose last label starts with a digit is refused because inet_aton-style
// resolvers would read "0x7f.1" or "017700000001" as an address.
func NormalizeHost(h string) (name string, ip netip.Addr, err error) {
	if h == "" {
		return "", netip.Addr{}, errHostEmpty
	}
	if len(h) > MaxHostLen+1 {
		return "", netip.Addr{}, errHostLong
	}
	h = asciiLower(h)
	if strings.Contains(h, ":") {
		a, err := netip.ParseAddr(h)
		if err != nil || a.Zone() != "" || !a.Is6() {
			return "", netip.Addr{}, errHostIP
		}
		if a.Is4In6() {
			return "", netip.Addr{}, errHostMapped
		}
		if a.String() != h {
			return "", netip.Addr{}, errHostIP
		}
		return h, a, nil
	}
	if a, err := netip.ParseAddr(h); err == nil {
		if a.String() != h {
			return "", netip.Addr{}, errHostIP
		}
		return h, a, nil
	}
	h = strings.TrimSuffix(h, ".")
	if err := checkName(h); err != nil {
		return "", netip.Addr{}, err
	}
	return h, netip.Addr{}, nil
}

// checkName enforces the strict LDH rule on a lower-cased name without a
// trailing dot. IDNA is not available in this module, so non-ASCII is
// refused rather than mapped: a homoglyph can never equal an allowed name.
func checkName(h string) error {
	if h == "" {
		return errHostEmpty
	}
	if len(h) > MaxHostLen {
		return errHostLong
	}
	labels := strings.Split(h, ".")
	if len(labels) < 2 {
		if isNumericish(h) {
			return errHostNumeric
		}
		return errHostSingle
	}
	for _, l := range labels {
		if l == "" || len(l) > 63 {
			return errHostLabel
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return errHostChars
			}
		}
		if l[0] == '-' || l[len(l)-1] == '-' {
			return errHostHyphen
		}
	}
	if last := labels[len(labels)-1]; last[0] >= '0' && last[0] <= '9' {
		return errHostNumeric
	}
	return nil
}

// isNumericish reports a leading digit, which no TLD has but every
// inet_aton form does.
func isNumericish(s string) bool { return s != "" && s[0] >= '0' && s[0] <= '9' }

// asciiLower lower-cases ASCII letters only; other bytes are left for the
// validator to refuse (strings.ToLower would map e.g. the Kelvin sign to k).
func asciiLower(s string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c >= 'A' && c <= 'Z' {
			b := []byte(s)
			for j := i; j < len(b); j++ {
				if b[j] >= 'A' && b[j] <= 'Z' {
					b[j] += 'a' - 'A'
				}
			}
			return string(b)
		}
	}
	return s
}

// splitHostPort splits an authority ("host:port", "[v6]:port", or "host"
// when defPort > 0). The port must be plain decimal 1..65535.
func splitHostPort(auth string, defPort int) (string, int, error) {
	host, portStr := auth, ""
	if strings.HasPrefix(auth, "[") {
		end := strings.IndexByte(auth, ']')
		if end < 0 {
			return "", 0, errHostIP
		}
		v6, rest := auth[1:end], auth[end+1:]
		if rest != "" {
			if rest[0] != ':' {
				return "", 0, errHostPort
			}
			portStr = rest[1:]
			if portStr == "" {
				return "", 0, errHostPort
			}
		}
		if !strings.Contains(v6, ":") {
			return "", 0, errHostIP // brackets are for IPv6 only
		}
		return finishHostPort(v6, portStr, defPort)
	}
	if i := strings.LastIndexByte(auth, ':'); i >= 0 {
		host, portStr = auth[:i], auth[i+1:]
		if strings.Contains(host, ":") {
			return "", 0, errHostIP // unbracketed IPv6
		}
		if portStr == "" {
			return "", 0, errHostPort
		}
	}
	return finishHostPort(host, portStr, defPort)
}

func finishHostPort(host, portStr string, defPort int) (string, int, error) {
	if portStr == "" {
		if defPort <= 0 {
			return "", 0, errHostPort
		}
		return host, defPort, nil
	}
	if len(portStr) > 5 || portStr[0] == '0' {
		return "", 0, errHostPort
	}
	for i := 0; i < len(portStr); i++ {
		if portStr[i] < '0' || portStr[i] > '9' {
			return "", 0, errHostPort
		}
	}
	p, err := strconv.Atoi(portStr)
	if err != nil || p < 1 || p > 65535 {
		return "", 0, errHostPort
	}
	return host, p, nil
}
