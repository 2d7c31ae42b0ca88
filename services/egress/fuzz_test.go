package egress

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

func FuzzParsePolicy(f *testing.F) {
	for _, s := range []string{
		``, `null`, `"none"`, `"public"`, `"x"`, `{}`, `[]`, `{"allowed_domains":["a.com"]}`,
		`{"allowed_domains":["*.A.com.","a.com"],"denied_domains":["b.a.com"]}`,
		`{"allowed_domains":["a.com"],"allowed_domains":["b.com"]}`, `{"Allowed_Domains":["a.com"]}`,
		`{"allowed_domains":["xn--e1afmkfd.xn--p1ai","еxample.com"]}`, `{"allowed_domains":["0x7f.1"]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, err := ParsePolicy(raw)
		if err != nil {
			if brokererr.CodeOf(err) != brokererr.InvalidInput {
				t.Fatalf("error %v has code %s", err, brokererr.CodeOf(err))
			}
			return
		}
		switch p.Mode {
		case ModeNone, ModePublic:
			if len(p.Allowed)+len(p.Denied) != 0 {
				t.Fatalf("mode %s with entries %+v", p.Mode, p)
			}
		case ModeAllow:
			if len(p.Allowed) == 0 || len(p.Allowed) > MaxDomains || len(p.Denied) > MaxDomains {
				t.Fatalf("bad entry counts %+v", p)
			}
		default:
			t.Fatalf("mode %q", p.Mode)
		}
		q, err := p.Normalize()
		if err != nil || !reflect.DeepEqual(p, q) {
			t.Fatalf("not a fixed point: %+v -> %+v, %v", p, q, err)
		}
		for _, e := range append(append([]string{}, p.Allowed...), p.Denied...) {
			name := strings.TrimPrefix(e, "*.")
			if strings.ContainsAny(name, "*:") || strings.HasSuffix(name, ".") || strings.ToLower(name) != name {
				t.Fatalf("entry %q not canonical", e)
			}
		}
		if p.Mode == ModeAllow { // the compact form round-trips through the object form
			obj := map[string][]string{"allowed_domains": p.Allowed}
			if len(p.Denied) > 0 {
				obj["denied_domains"] = p.Denied
			}
			b, _ := json.Marshal(obj)
			r, err := ParsePolicy(b)
			if err != nil || r.String() != p.String() {
				t.Fatalf("round trip %s: %v %q != %q", b, err, r.String(), p.String())
			}
		}
	})
}

func FuzzNormalizeHostAndMatch(f *testing.F) {
	for _, s := range []string{
		"example.com", "EXAMPLE.com.", "a.example.com", "evil-example.com", "example.com.evil.com",
		"0x7f.1", "2130706433", "127.1", "::ffff:127.0.0.1", "64:ff9b::a9fe:a9fe", "[::1]", "fe80::1%eth0",
		"еxample.com", "xn--xample-2of.com", "a..b", "1.2.3.4.", "example.com:443", "\u212aexample.com",
	} {
		f.Add(s)
	}
	pol := allowPolicyF(f)
	f.Fuzz(func(t *testing.T, in string) {
		name, ip, err := NormalizeHost(in)
		if err != nil {
			if ok, reason := pol.Match(in); ok || reason != ReasonInvalidHost {
				t.Fatalf("invalid host %q matched: %v %s", in, ok, reason)
			}
			return
		}
		n2, ip2, err := NormalizeHost(name)
		if err != nil || n2 != name || ip2 != ip {
			t.Fatalf("not idempotent: %q -> %q -> %q %v", in, name, n2, err)
		}
		if ip.IsValid() {
			if ip.String() != name || ip.Zone() != "" || ip.Is4In6() {
				t.Fatalf("IP %q normalised to %q", in, name)
			}
		} else {
			for i := 0; i < len(name); i++ {
				c := name[i]
				if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.') {
					t.Fatalf("name %q has byte %q", name, c)
				}
			}
			if last := name[strings.LastIndexByte(name, '.')+1:]; last == "" || last[0] >= '0' && last[0] <= '9' {
				t.Fatalf("name %q has a numeric last label", name)
			}
		}
		// The matcher against a reference: exact "example.com", subdomains
		// of "github.com", minus "evil.github.com".
		want := !ip.IsValid() && (name == "example.com" ||
			strings.HasSuffix(name, ".github.com") && name != "evil.github.com")
		if ok, _ := pol.Match(in); ok != want {
			t.Fatalf("Match(%q) = %v, want %v", in, ok, want)
		}
	})
}

func allowPolicyF(f *testing.F) Policy {
	p, err := Policy{Mode: ModeAllow, Allowed: []string{"example.com", "*.github.com"}, Denied: []string{"evil.github.com"}}.Normalize()
	if err != nil {
		f.Fatal(err)
	}
	return p
}

func FuzzSplitHostPort(f *testing.F) {
	for _, s := range []string{"a.com:443", "[::1]:80", "a.com", "[::1]", ":80", "a:b:c", "a.com:0080", "[1.2.3.4]:1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		h, p, err := splitHostPort(in, 0)
		if err != nil {
			return
		}
		if p < 1 || p > 65535 {
			t.Fatalf("port %d", p)
		}
		back := h + ":" + strconv.Itoa(p)
		if strings.Contains(h, ":") {
			back = "[" + h + "]:" + strconv.Itoa(p)
		}
		if back != in {
			t.Fatalf("%q split to %q %d, which rebuilds as %q", in, h, p, back)
		}
	})
}

func FuzzClientHello(f *testing.F) {
	f.Add(captureHello(f, &tls.Config{ServerName: "example.com"}))
	f.Add(captureHello(f, &tls.Config{ServerName: "a.b.example.org", MaxVersion: tls.VersionTLS12}))
	f.Add(append([]byte{0x16, 3, 1, 0, byte(len(hello(sniExt("a.example"))))}, hello(sniExt("a.example"))...))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		raw, sni, err := readClientHello(bytes.NewReader(in))
		if len(raw) > maxClientHello+5 || !bytes.HasPrefix(in, raw) {
			t.Fatalf("read %d bytes, not a prefix of the input", len(raw))
		}
		if err == nil && sni != "" && !bytes.Contains(raw, []byte(sni)) {
			t.Fatalf("sni %q not in the hello", sni)
		}
		if len(in) > 9 {
			_, _ = parseClientHello(in[5:])
		}
	})
}
