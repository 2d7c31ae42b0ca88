package egress

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

func TestParsePolicyAccepts(t *testing.T) {
	cases := []struct {
		raw  string
		want Policy
		str  string
	}{
		{``, Policy{Mode: ModeNone}, "none"},
		{`null`, Policy{Mode: ModeNone}, "none"},
		{` "none" `, Policy{Mode: ModeNone}, "none"},
		{`"public"`, Policy{Mode: ModePublic}, "public"},
		{`{"allowed_domains":["Example.COM.","*.GitHub.com","example.com"]}`,
			Policy{Mode: ModeAllow, Allowed: []string{"example.com", "*.github.com"}}, "allow=example.com,*.github.com"},
		{`{"denied_domains":["evil.github.com"],"allowed_domains":["*.github.com"]}`,
			Policy{Mode: ModeAllow, Allowed: []string{"*.github.com"}, Denied: []string{"evil.github.com"}}, "allow=*.github.com deny=evil.github.com"},
		{`{"allowed_domains":["xn--bcher-kva.example"],"denied_domains":null}`,
			Policy{Mode: ModeAllow, Allowed: []string{"xn--bcher-kva.example"}}, "allow=xn--bcher-kva.example"},
	}
	for _, c := range cases {
		got, err := ParsePolicy(json.RawMessage(c.raw))
		if err != nil {
			t.Errorf("ParsePolicy(%s): %v", c.raw, err)
			continue
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("ParsePolicy(%s) = %+v, want %+v", c.raw, got, c.want)
		}
		if got.String() != c.str {
			t.Errorf("String() = %q, want %q", got.String(), c.str)
		}
	}
}

func TestParsePolicyRefuses(t *testing.T) {
	many := make([]string, MaxDomains+1)
	for i := range many {
		many[i] = "a" + strings.Repeat("b", i%5) + ".example.com"
	}
	manyJSON, _ := json.Marshal(map[string]any{"allowed_domains": many})
	cases := []struct{ raw, wantMsg string }{
		{`"all"`, `not "all"`},
		{`"NONE"`, `network must be`},
		{`true`, `network must be`},
		{`42`, `network must be`},
		{`["example.com"]`, `network must be`},
		{`"none" "public"`, `network must be`},
		{`{}`, `allowed_domains must list at least one`},
		{`{"allowed_domains":[]}`, `allowed_domains must list at least one`},
		{`{"denied_domains":["x.com"]}`, `allowed_domains must list at least one`},
		{`{"allowed_domains":["a.com"],"extra":1}`, `unknown key "extra"`},
		{`{"ALLOWED_DOMAINS":["a.com"]}`, `unknown key "ALLOWED_DOMAINS"`},
		{`{"allowed_domains":["a.com"],"allowed_domains":["b.com"]}`, `twice`},
		{`{"allowed_domains":"a.com"}`, `must be an array of strings`},
		{`{"allowed_domains":[1]}`, `must be an array of strings`},
		{`{"allowed_domains":["a.com"]} x`, `trailing data`},
		{`{"allowed_domains":["a.com"]`, `not valid JSON`},
		{string(manyJSON), `at most 64`},
		{`{"allowed_domains":["127.0.0.1"]}`, `IP addresses are not accepted`},
		{`{"allowed_domains":["::1"]}`, `IP addresses are not accepted`},
		{`{"allowed_domains":["*"]}`, `wildcard`},
		{`{"allowed_domains":["*.com"]}`, `wildcard`},
		{`{"allowed_domains":["a.*.com"]}`, `wildcard`},
		{`{"allowed_domains":["**.a.com"]}`, `wildcard`},
		{`{"allowed_domains":["localhost"]}`, `at least two labels`},
		{`{"allowed_domains":["exämple.com"]}`, `ASCII`},
		{`{"allowed_domains":["еxample.com"]}`, `ASCII`}, // Cyrillic е
		{`{"allowed_domains":["ex_ample.com"]}`, `ASCII`},
		{`{"allowed_domains":["ex ample.com"]}`, `ASCII`},
		{`{"allowed_domains":["a.com%00"]}`, `ASCII`},
		{`{"allowed_domains":["a..com"]}`, `label`},
		{`{"allowed_domains":["-a.com"]}`, `hyphen`},
		{`{"allowed_domains":["a.123"]}`, `number`},
		{`{"allowed_domains":["0x7f.1"]}`, `number`},
		{`{"allowed_domains":["https://a.com"]}`, `IP address is not in canonical form`},
		{`{"allowed_domains":["` + strings.Repeat("a", 64) + `.com"]}`, `label`},
		{`{"allowed_domains":["a.com"],"denied_domains":["b..com"]}`, `denied_domains[0]`},
	}
	for _, c := range cases {
		_, err := ParsePolicy(json.RawMessage(c.raw))
		if err == nil {
			t.Errorf("ParsePolicy(%.60s) accepted", c.raw)
			continue
		}
		if brokererr.CodeOf(err) != brokererr.InvalidInput {
			t.Errorf("ParsePolicy(%.60s): code %s, want INVALID_INPUT", c.raw, brokererr.CodeOf(err))
		}
		if !strings.Contains(err.Error(), c.wantMsg) {
			t.Errorf("ParsePolicy(%.60s) = %q, want it to mention %q", c.raw, err, c.wantMsg)
		}
	}
}

func TestNormalizeRefusesHandBuiltPolicies(t *testing.T) {
	for _, p := range []Policy{
		{Mode: "open"},
		{Mode: ModePublic, Allowed: []string{"a.com"}},
		{Mode: ModeAllow},
		{Mode: ModeAllow, Allowed: []string{"a.com"}, Denied: []string{"1.2.3.4"}},
	} {
		if _, err := p.Normalize(); err == nil {
			t.Errorf("Normalize(%+v) accepted", p)
		}
	}
	if p, err := (Policy{}).Normalize(); err != nil || p.Mode != ModeNone {
		t.Errorf("zero Policy normalises to %+v, %v; want none", p, err)
	}
}

func TestMatchLookalikes(t *testing.T) {
	p := allowPolicy(t, []string{"example.com", "*.github.com"}, "evil.github.com", "*.internal.github.com")
	cases := []struct {
		host   string
		ok     bool
		reason string
	}{
		{"example.com", true, ReasonAllowed},
		{"EXAMPLE.com.", true, ReasonAllowed},
		{"Example.Com", true, ReasonAllowed},
		{"www.example.com", false, ReasonNotAllowed}, // exact entries match exactly
		{"example.com.evil.com", false, ReasonNotAllowed},
		{"evil-example.com", false, ReasonNotAllowed},
		{"evilexample.com", false, ReasonNotAllowed},
		{"example.co", false, ReasonNotAllowed},
		{"example.com..", false, ReasonInvalidHost},
		{"еxample.com", false, ReasonInvalidHost},       // Cyrillic е
		{"exa\u200bmple.com", false, ReasonInvalidHost}, // zero-width space
		{"xn--xample-2of.com", false, ReasonNotAllowed}, // punycode of the homoglyph
		{"example\u3002com", false, ReasonInvalidHost},  // ideographic full stop
		{"\u212aexample.com", false, ReasonInvalidHost}, // Kelvin sign lower-cases to k elsewhere
		{"github.com", false, ReasonNotAllowed},         // wildcard excludes the apex
		{"api.github.com", true, ReasonAllowed},
		{"a.b.github.com", true, ReasonAllowed},
		{"API.GitHub.com.", true, ReasonAllowed},
		{"evilgithub.com", false, ReasonNotAllowed},
		{"github.com.evil.io", false, ReasonNotAllowed},
		{"evil.github.com", false, ReasonDenied},
		{"EVIL.github.com.", false, ReasonDenied},
		{"x.evil.github.com", true, ReasonAllowed}, // exact deny covers only itself
		{"internal.github.com", true, ReasonAllowed},
		{"a.internal.github.com", false, ReasonDenied},
		{"93.184.215.14", false, ReasonIPLiteral},
		{"2606:4700::1111", false, ReasonIPLiteral},
	}
	for _, c := range cases {
		ok, reason := p.Match(c.host)
		if ok != c.ok || reason != c.reason {
			t.Errorf("Match(%q) = %v, %s; want %v, %s", c.host, ok, reason, c.ok, c.reason)
		}
	}
	pub := Policy{Mode: ModePublic}
	if ok, _ := pub.Match("93.184.215.14"); !ok {
		t.Error("public mode refused a public IP literal by policy")
	}
	if ok, r := pub.Match("anything.example"); !ok || r != ReasonAllowed {
		t.Errorf("public mode: %v %s", ok, r)
	}
	none := Policy{Mode: ModeNone}
	if ok, r := none.Match("example.com"); ok || r != ReasonNetworkNone {
		t.Errorf("none mode: %v %s", ok, r)
	}
}

func TestNormalizeHost(t *testing.T) {
	good := map[string]string{
		"Example.COM.":          "example.com",
		"a-b.c-d.example":       "a-b.c-d.example",
		"xn--bcher-kva.example": "xn--bcher-kva.example",
		"8.8.8.8":               "8.8.8.8",
		"2606:4700:4700::1111":  "2606:4700:4700::1111",
		"127.0.0.1":             "127.0.0.1", // syntax only: the range check refuses it later
	}
	for in, want := range good {
		got, _, err := NormalizeHost(in)
		if err != nil || got != want {
			t.Errorf("NormalizeHost(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	bad := []string{
		"", ".", "..", "localhost", "localhost.", "com",
		"0x7f.1", "0x7f000001", "017700000001", "2130706433", "127.1", "0177.0.0.1", "127.0.0.01",
		"0x7f.0x0.0x0.0x1", "1.2.3.4.", "1.2.3", "256.1.1.1", "1.2.3.4.5",
		"::ffff:127.0.0.1", "::ffff:7f00:1", "::FFFF:169.254.169.254", "[::1]", "::127.0.0.1",
		"2001:DB8:0:0::1", "2001:db8:0::1", "fe80::1%eth0", "0:0:0:0:0:0:0:1",
		"a..com", "-a.com", "a-.com", "a_b.com", "a b.com", "a%2e.com", "a/b.com", "a@b.com",
		"a.com:80", "exämple.com", "\x00.com", strings.Repeat("a", 64) + ".com",
		strings.Repeat("a.", 127) + "com",
	}
	for _, in := range bad {
		if got, _, err := NormalizeHost(in); err == nil {
			t.Errorf("NormalizeHost(%q) accepted as %q", in, got)
		}
	}
}

func TestSplitHostPort(t *testing.T) {
	type r struct {
		host string
		port int
	}
	good := map[string]r{
		"example.com:443":  {"example.com", 443},
		"[2001:db8::1]:80": {"2001:db8::1", 80},
		"1.2.3.4:65535":    {"1.2.3.4", 65535},
	}
	for in, want := range good {
		h, p, err := splitHostPort(in, 0)
		if err != nil || h != want.host || p != want.port {
			t.Errorf("splitHostPort(%q) = %q %d %v", in, h, p, err)
		}
	}
	if h, p, err := splitHostPort("example.com", 80); err != nil || h != "example.com" || p != 80 {
		t.Errorf("default port: %q %d %v", h, p, err)
	}
	for _, in := range []string{"example.com", "example.com:", "example.com:0", "example.com:0443", "example.com:65536",
		"example.com:+80", "example.com:8x", "::1:443", "[::1]", "[::1]x", "[1.2.3.4]:80", "[::1]:", "a:b:c"} {
		if h, p, err := splitHostPort(in, 0); err == nil {
			t.Errorf("splitHostPort(%q) accepted: %q %d", in, h, p)
		}
	}
}

// blockedAddrs covers every range of the deny table in security-cases.md
// §3.3 item 5 and catalogue cases 27 to 29, plus the IANA extras.
var blockedAddrs = []string{
	// IPv4 deny table.
	"0.0.0.0", "0.1.2.3", "10.0.0.1", "10.255.255.255", "100.64.0.1", "100.127.255.255", "100.100.100.200",
	"127.0.0.1", "127.255.255.254", "169.254.0.1", "169.254.169.254", "172.16.0.1", "172.31.255.255",
	"192.0.0.1", "192.0.0.170", "192.0.2.1", "192.88.99.1", "192.168.1.1", "198.18.0.1", "198.19.255.255",
	"198.51.100.7", "203.0.113.9", "224.0.0.1", "239.255.255.250", "240.0.0.1", "255.255.255.255",
	// IPv6.
	"::", "::1", "::127.0.0.1", "::8.8.8.8", "fd00:ec2::254", "fc00::1", "fdff::1", "fe80::1", "febf::1",
	"fec0::1", "ff02::1", "ff05::1:3", "100::1", "2001:db8::1", "2001::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2",
	"2001:2::1", "2001:10::1", "3fff::1", "5f00::1", "4000::1",
	// IPv4-mapped: unwrapped, then checked as IPv4.
	"::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "::ffff:100.100.100.200", "::ffff:0.0.0.0",
	// NAT64 (well-known and local-use), with metadata, loopback and even public IPv4 embedded.
	"64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1", "64:ff9b::808:808", "64:ff9b:1::a9fe:a9fe", "64:ff9b:1:ffff::1",
	// 6to4 with embedded metadata, loopback, private and public.
	"2002:a9fe:a9fe::1", "2002:7f00:1::", "2002:c0a8:101::1", "2002:808:808::1",
}

func TestBlockedReason(t *testing.T) {
	for _, s := range blockedAddrs {
		a := netip.MustParseAddr(s)
		if why := BlockedReason(a); why == "" {
			t.Errorf("BlockedReason(%s) = allowed, want blocked", s)
		}
	}
	if BlockedReason(netip.MustParseAddr("fe80::1%eth0")) == "" {
		t.Error("zoned address allowed")
	}
	if BlockedReason(netip.Addr{}) == "" {
		t.Error("invalid address allowed")
	}
	// Embedded addresses are named in the (log-only) reason.
	if why := BlockedReason(netip.MustParseAddr("64:ff9b::a9fe:a9fe")); why != "nat64_link_local" {
		t.Errorf("NAT64 metadata reason %q", why)
	}
	if why := BlockedReason(netip.MustParseAddr("2002:7f00:1::")); why != "6to4_loopback" {
		t.Errorf("6to4 loopback reason %q", why)
	}
	public := []string{
		"8.8.8.8", "1.1.1.1", pubA, "100.63.255.255", "100.128.0.0", "172.15.255.255", "172.32.0.0",
		"192.0.1.255", "192.169.0.1", "198.17.255.255", "198.20.0.0", "223.255.255.254", "9.255.255.255", "11.0.0.0",
		"::ffff:8.8.8.8", "2606:4700:4700::1111", pubB, "2001:200::1", "2003::1", "3ffe::1",
	}
	for _, s := range public {
		if why := BlockedReason(netip.MustParseAddr(s)); why != "" {
			t.Errorf("BlockedReason(%s) = %q, want public", s, why)
		}
	}
}

func TestRecheckControl(t *testing.T) {
	for _, a := range []string{"127.0.0.1:80", "[::1]:443", "169.254.169.254:80", "[::ffff:10.0.0.1]:443", "bad"} {
		if recheckControl("tcp", a, nil) == nil {
			t.Errorf("recheckControl(%s) allowed", a)
		}
	}
	if err := recheckControl("tcp", pubA+":443", nil); err != nil {
		t.Errorf("recheckControl(public): %v", err)
	}
}

func TestJSONSchemaAgreesWithParser(t *testing.T) {
	s := JSONSchema()
	if oneOf, _ := s["oneOf"].([]any); len(oneOf) != 3 {
		t.Fatalf("oneOf has %d branches, want 3", len(oneOf))
	}
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := jsonschema.UnmarshalJSON(strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("network.json", doc); err != nil {
		t.Fatal(err)
	}
	sch, err := c.Compile("network.json")
	if err != nil {
		t.Fatalf("schema does not compile: %v", err)
	}
	for _, raw := range []string{
		`"none"`, `"public"`, `{"allowed_domains":["example.com","*.github.com"]}`,
		`{"allowed_domains":["example.com."],"denied_domains":["x.example.com"]}`,
	} {
		v, _ := jsonschema.UnmarshalJSON(strings.NewReader(raw))
		if err := sch.Validate(v); err != nil {
			t.Errorf("schema refuses %s: %v", raw, err)
		}
		if _, err := ParsePolicy(json.RawMessage(raw)); err != nil {
			t.Errorf("parser refuses %s: %v", raw, err)
		}
	}
	for _, raw := range []string{
		`"all"`, `{}`, `{"allowed_domains":[]}`, `{"allowed_domains":["a.com"],"x":1}`,
		`{"allowed_domains":["a_b.com"]}`, `{"allowed_domains":["localhost"]}`, `{"allowed_domains":["exämple.com"]}`, `7`,
	} {
		v, _ := jsonschema.UnmarshalJSON(strings.NewReader(raw))
		if err := sch.Validate(v); err == nil {
			t.Errorf("schema accepts %s", raw)
		}
		if _, err := ParsePolicy(json.RawMessage(raw)); err == nil {
			t.Errorf("parser accepts %s", raw)
		}
	}
}

// A refusal names the rule, with a long allow-list cut short: the rule is
// repeated in every refusal the model reads.
func TestRefusalRuleIsShort(t *testing.T) {
	var allowed []string
	for i := 0; i < MaxDomains; i++ {
		allowed = append(allowed, fmt.Sprintf("host%02d.%s.example.com", i, strings.Repeat("x", 40)))
	}
	p, err := Policy{Mode: ModeAllow, Allowed: allowed, Denied: []string{"*.bad.example.com"}}.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	name, ip, _ := NormalizeHost("other.example.net")
	ok, reason, rule := p.match(name, ip)
	if ok || reason != ReasonNotAllowed || !strings.HasPrefix(rule, "allowed_domains [host00.") || !strings.HasSuffix(rule, "more]") || len(rule) > 300 {
		t.Fatalf("%v %s %q (%d bytes)", ok, reason, rule, len(rule))
	}
	name, ip, _ = NormalizeHost("a.bad.example.com")
	if ok, reason, rule := p.match(name, ip); ok || reason != ReasonDenied || rule != `denied_domains entry "*.bad.example.com"` {
		t.Fatalf("%v %s %q", ok, reason, rule)
	}
}
