package egress

import (
	"bytes"
	"crypto/tls"
	"net"
	"testing"
	"time"
)

// captureHello returns the bytes a real crypto/tls client sends first.
func captureHello(t testing.TB, cfg *tls.Config) []byte {
	t.Helper()
	c1, c2 := net.Pipe()
	defer c1.Close()
	defer c2.Close()
	go func() { _ = tls.Client(c1, cfg).Handshake() }()
	_ = c2.SetDeadline(time.Now().Add(5 * time.Second))
	raw, _, err := readClientHello(c2)
	if err != nil {
		t.Fatalf("capture ClientHello: %v", err)
	}
	return raw
}

func TestReadClientHelloRealClient(t *testing.T) {
	for _, sni := range []string{"example.com", "API.GitHub.com"} {
		raw := captureHello(t, &tls.Config{ServerName: sni, MinVersion: tls.VersionTLS12})
		got, name, err := readClientHello(bytes.NewReader(raw))
		if err != nil || name != sni || !bytes.Equal(got, raw) {
			t.Errorf("readClientHello: sni %q err %v (want %q), raw equal %v", name, err, sni, bytes.Equal(got, raw))
		}
	}
	// An IP ServerName is not sent as SNI (RFC 6066).
	raw := captureHello(t, &tls.Config{ServerName: "93.184.215.14", InsecureSkipVerify: true}) //nolint:gosec // test only
	if _, name, err := readClientHello(bytes.NewReader(raw)); err != nil || name != "" {
		t.Errorf("IP ServerName: sni %q err %v, want none", name, err)
	}
}

// TestReadClientHelloAcrossRecords splits one ClientHello over several TLS
// records, which the protocol allows, and still finds the SNI.
func TestReadClientHelloAcrossRecords(t *testing.T) {
	raw := captureHello(t, &tls.Config{ServerName: "example.com"})
	msg := raw[5:]
	var split []byte
	for len(msg) > 0 {
		n := min(len(msg), 100)
		split = append(split, 0x16, 3, 1, byte(n>>8), byte(n))
		split = append(split, msg[:n]...)
		msg = msg[n:]
	}
	got, sni, err := readClientHello(bytes.NewReader(split))
	if err != nil || sni != "example.com" || !bytes.Equal(got, split) {
		t.Fatalf("split hello: sni %q err %v", sni, err)
	}
}

// hello builds a minimal ClientHello message with the given extensions.
func hello(exts []byte) []byte {
	body := []byte{3, 3}
	body = append(body, make([]byte, 32)...)
	body = append(body, 0)             // session id
	body = append(body, 0, 2, 0x13, 1) // one cipher suite
	body = append(body, 1, 0)          // null compression
	body = append(body, byte(len(exts)>>8), byte(len(exts)))
	body = append(body, exts...)
	return append([]byte{1, byte(len(body) >> 16), byte(len(body) >> 8), byte(len(body))}, body...)
}

func sniExt(names ...string) []byte {
	var list []byte
	for _, n := range names {
		list = append(list, 0, byte(len(n)>>8), byte(len(n)))
		list = append(list, n...)
	}
	data := append([]byte{byte(len(list) >> 8), byte(len(list))}, list...)
	return append([]byte{0, 0, byte(len(data) >> 8), byte(len(data))}, data...)
}

func TestParseClientHelloHostile(t *testing.T) {
	if sni, err := parseClientHello(hello(sniExt("a.example"))); err != nil || sni != "a.example" {
		t.Fatalf("baseline: %q %v", sni, err)
	}
	if sni, err := parseClientHello(hello(nil)); err != nil || sni != "" {
		t.Errorf("no SNI: %q %v", sni, err)
	}
	bad := map[string][]byte{
		"two host_names":      hello(sniExt("a.example", "b.example")),
		"two SNI extensions":  hello(append(sniExt("a.example"), sniExt("b.example")...)),
		"empty host_name":     hello(sniExt("")),
		"empty name list":     hello([]byte{0, 0, 0, 2, 0, 0}),
		"not a ClientHello":   append([]byte{2}, hello(nil)[1:]...),
		"length mismatch":     append(hello(sniExt("a.example")), 0),
		"truncated extension": hello([]byte{0, 0, 0, 9, 0}),
		"long session id":     func() []byte { h := hello(nil); h[4+34] = 33; return h }(),
	}
	for name, m := range bad {
		if sni, err := parseClientHello(m); err == nil {
			t.Errorf("%s: accepted with sni %q", name, sni)
		}
	}
	full := hello(sniExt("a.example"))
	for i := 0; i < len(full); i++ {
		if _, err := parseClientHello(full[:i]); err == nil {
			t.Errorf("truncated at %d accepted", i)
		}
	}
}

func TestReadClientHelloRefuses(t *testing.T) {
	rec := func(typ byte, body []byte) []byte {
		return append([]byte{typ, 3, 1, byte(len(body) >> 8), byte(len(body))}, body...)
	}
	cases := map[string][]byte{
		"plain HTTP":      []byte("GET / HTTP/1.1\r\nHost: a\r\n\r\n"),
		"alert record":    rec(0x15, []byte{2, 40}),
		"empty record":    rec(0x16, nil),
		"oversize record": {0x16, 3, 1, 0x48, 0x01},
		"not handshake 1": rec(0x16, []byte{2, 0, 0, 1, 0}),
		"huge message":    rec(0x16, []byte{1, 0xff, 0xff, 0xff}),
		"SSLv2 hello":     {0x80, 0x2e, 0x01, 0x03, 0x01},
	}
	for name, b := range cases {
		if _, sni, err := readClientHello(bytes.NewReader(b)); err == nil {
			t.Errorf("%s: accepted (sni %q)", name, sni)
		}
	}
	// A message claiming almost 32 KiB in many small records stops at the bound.
	var big []byte
	big = append(big, rec(0x16, []byte{1, 0, 0x7f, 0})...)
	for len(big) < 2*maxClientHello {
		big = append(big, rec(0x16, make([]byte, 1000))...)
	}
	if raw, _, err := readClientHello(bytes.NewReader(big)); err == nil || len(raw) > maxClientHello+5 {
		t.Errorf("oversized hello: err %v after %d bytes", err, len(raw))
	}
}
