package egress

import (
	"errors"
	"io"
)

// maxClientHello bounds the bytes read while looking for the SNI. Real
// ClientHellos (even with post-quantum key shares) are a few KiB.
const maxClientHello = 32 << 10

var (
	errNotTLS        = errors.New("not a TLS ClientHello")
	errBadHello      = errors.New("malformed ClientHello")
	errHelloTooLarge = errors.New("ClientHello too large")
)

// readClientHello reads TLS records from r until one whole ClientHello
// handshake message is in hand and returns every byte read (to forward
// once the SNI is approved) and the SNI ("" when absent). It never reads
// more than maxClientHello bytes plus one record header.
func readClientHello(r io.Reader) (raw []byte, sni string, err error) {
	var msg []byte
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return raw, "", err
		}
		raw = append(raw, hdr[:]...)
		if hdr[0] != 0x16 || hdr[1] != 3 {
			return raw, "", errNotTLS
		}
		n := int(hdr[3])<<8 | int(hdr[4])
		if n == 0 || n > 1<<14 {
			return raw, "", errBadHello
		}
		if len(raw)+n > maxClientHello {
			return raw, "", errHelloTooLarge
		}
		rec := make([]byte, n)
		if _, err := io.ReadFull(r, rec); err != nil {
			return raw, "", err
		}
		raw = append(raw, rec...)
		msg = append(msg, rec...)
		if len(msg) < 4 {
			continue
		}
		if msg[0] != 1 {
			return raw, "", errNotTLS
		}
		want := 4 + (int(msg[1])<<16 | int(msg[2])<<8 | int(msg[3]))
		if want > maxClientHello {
			return raw, "", errHelloTooLarge
		}
		if len(msg) >= want {
			sni, err := parseClientHello(msg[:want])
			return raw, sni, err
		}
	}
}

// parseClientHello extracts the host_name from a complete ClientHello
// handshake message (RFC 8446 §4.1.2, RFC 6066 §3). It refuses anything
// malformed, duplicate extensions and more than one host_name, so that a
// second name cannot hide behind the one that was checked.
func parseClientHello(m []byte) (string, error) {
	s := bytesReader(m)
	if t, ok := s.u8(); !ok || t != 1 {
		return "", errNotTLS
	}
	if l, ok := s.u24(); !ok || l != len(s) {
		return "", errBadHello
	}
	if !s.skip(2 + 32) { // legacy_version, random
		return "", errBadHello
	}
	if sid, ok := s.vec8(); !ok || len(sid) > 32 {
		return "", errBadHello
	}
	if cs, ok := s.vec16(); !ok || len(cs) == 0 || len(cs)%2 != 0 {
		return "", errBadHello
	}
	if cm, ok := s.vec8(); !ok || len(cm) == 0 {
		return "", errBadHello
	}
	if len(s) == 0 {
		return "", nil // no extensions at all
	}
	exts, ok := s.vec16()
	if !ok || len(s) != 0 {
		return "", errBadHello
	}
	var sni string
	seen := map[uint16]bool{}
	for len(exts) > 0 {
		typ, ok1 := exts.u16()
		data, ok2 := exts.vec16()
		if !ok1 || !ok2 || seen[typ] {
			return "", errBadHello
		}
		seen[typ] = true
		if typ != 0 {
			continue
		}
		list, ok := data.vec16()
		if !ok || len(data) != 0 || len(list) == 0 {
			return "", errBadHello
		}
		for len(list) > 0 {
			nt, ok1 := list.u8()
			name, ok2 := list.vec16()
			if !ok1 || !ok2 {
				return "", errBadHello
			}
			if nt != 0 {
				continue
			}
			if sni != "" || len(name) == 0 {
				return "", errBadHello
			}
			sni = string(name)
		}
	}
	return sni, nil
}

// bytesReader is a minimal length-prefixed reader (cryptobyte-style).
type bytesReader []byte

func (b *bytesReader) take(n int) ([]byte, bool) {
	if n < 0 || len(*b) < n {
		return nil, false
	}
	v := (*b)[:n]
	*b = (*b)[n:]
	return v, true
}

func (b *bytesReader) skip(n int) bool { _, ok := b.take(n); return ok }

func (b *bytesReader) u8() (int, bool) {
	v, ok := b.take(1)
	if !ok {
		return 0, false
	}
	return int(v[0]), true
}

func (b *bytesReader) u16() (uint16, bool) {
	v, ok := b.take(2)
	if !ok {
		return 0, false
	}
	return uint16(v[0])<<8 | uint16(v[1]), true
}

func (b *bytesReader) u24() (int, bool) {
	v, ok := b.take(3)
	if !ok {
		return 0, false
	}
	return int(v[0])<<16 | int(v[1])<<8 | int(v[2]), true
}

func (b *bytesReader) vec8() (bytesReader, bool) {
	n, ok := b.u8()
	if !ok {
		return nil, false
	}
	v, ok := b.take(n)
	return v, ok
}

func (b *bytesReader) vec16() (bytesReader, bool) {
	n, ok := b.u16()
	if !ok {
		return nil, false
	}
	v, ok := b.take(int(n))
	return v, ok
}
