package egress

import (
	"net/netip"
)

// blockedRange is one entry of the IP deny table; why is for logs only.
type blockedRange struct {
	p   netip.Prefix
	why string
}

func mustPrefixes(why string, ps ...string) []blockedRange {
	out := make([]blockedRange, 0, len(ps))
	for _, p := range ps {
		out = append(out, blockedRange{netip.MustParsePrefix(p), why})
	}
	return out
}

// blocked4 and blocked6 follow security-cases.md §3.3 item 5 plus the IANA
// special-purpose registries. The netip predicates miss several of these
// (CGNAT, NAT64, 6to4, 198.18/15, 240/4), so the table is explicit.
var blocked4 = concat(
	mustPrefixes("this_network", "0.0.0.0/8"),
	mustPrefixes("private", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"),
	mustPrefixes("cgnat", "100.64.0.0/10"), // includes Alibaba metadata 100.100.100.200
	mustPrefixes("loopback", "127.0.0.0/8"),
	mustPrefixes("link_local", "169.254.0.0/16"), // includes 169.254.169.254 metadata
	mustPrefixes("ietf_protocol", "192.0.0.0/24"),
	mustPrefixes("documentation", "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"),
	mustPrefixes("6to4_relay", "192.88.99.0/24"),
	mustPrefixes("benchmark", "198.18.0.0/15"),
	mustPrefixes("multicast", "224.0.0.0/4"),
	mustPrefixes("reserved", "240.0.0.0/4"), // includes 255.255.255.255
)

var blocked6 = concat(
	// ::/96 holds ::, ::1 and the deprecated IPv4-compatible form; none is
	// a legitimate destination, so the whole range is refused.
	mustPrefixes("ipv4_compatible", "::/96"),
	mustPrefixes("nat64", "64:ff9b::/96", "64:ff9b:1::/48"),
	mustPrefixes("discard", "100::/64"),
	mustPrefixes("ietf_protocol", "2001::/23"), // Teredo 2001::/32, benchmark, ORCHID
	mustPrefixes("documentation", "2001:db8::/32", "3fff::/20"),
	mustPrefixes("6to4", "2002::/16"),
	mustPrefixes("unique_local", "fc00::/7"), // includes fd00:ec2::254 metadata
	mustPrefixes("link_local", "fe80::/10"),
	mustPrefixes("site_local", "fec0::/10"),
	mustPrefixes("multicast", "ff00::/8"),
)

// global6 is the only IPv6 space allocated for global unicast; anything
// outside it is refused even if the table above misses it.
var (
	global6   = netip.MustParsePrefix("2000::/3")
	nat64WKP  = netip.MustParsePrefix("64:ff9b::/96")
	sixToFour = netip.MustParsePrefix("2002::/16")
)

func concat(parts ...[]blockedRange) []blockedRange {
	var out []blockedRange
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// BlockedReason returns why a is not a public destination, or "" when it
// is. IPv4-mapped IPv6 is unwrapped and checked as IPv4; NAT64 and 6to4
// are refused whole, and their embedded IPv4 is named in the reason when it
// is itself blocked (for the log).
func BlockedReason(a netip.Addr) string {
	if !a.IsValid() {
		return "invalid"
	}
	if a.Zone() != "" {
		return "zoned"
	}
	if a.Is4In6() {
		a = a.Unmap()
	}
	if a.Is4() {
		for _, r := range blocked4 {
			if r.p.Contains(a) {
				return r.why
			}
		}
		if !a.IsGlobalUnicast() {
			return "not_global"
		}
		return ""
	}
	for _, r := range blocked6 {
		if r.p.Contains(a) {
			if v4, ok := embedded4(a); ok {
				if why := BlockedReason(v4); why != "" {
					return r.why + "_" + why
				}
			}
			return r.why
		}
	}
	if !global6.Contains(a) || !a.IsGlobalUnicast() {
		return "not_global"
	}
	return ""
}

// embedded4 extracts the IPv4 address carried by NAT64 (last 32 bits) and
// 6to4 (bits 16..47) addresses.
func embedded4(a netip.Addr) (netip.Addr, bool) {
	b := a.As16()
	switch {
	case nat64WKP.Contains(a):
		return netip.AddrFrom4([4]byte{b[12], b[13], b[14], b[15]}), true
	case sixToFour.Contains(a):
		return netip.AddrFrom4([4]byte{b[2], b[3], b[4], b[5]}), true
	}
	return netip.Addr{}, false
}
