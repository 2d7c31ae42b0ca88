package audit

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"

	"golang.org/x/mod/sumdb/tlog"
)

const macDomain = "audit-v1"

// zeroMAC is prev_mac of the first row.
var zeroMAC = make([]byte, sha256.Size)

// leafHash is the RFC 6962 leaf hash SHA256(0x00 || body).
func leafHash(body []byte) tlog.Hash { return tlog.RecordHash(body) }

// computeMAC binds seq, the previous row and this row's leaf under the
// HMAC key, so a row can be neither edited, moved nor dropped without K.
func computeMAC(key []byte, seq int64, prevMAC []byte, leaf tlog.Hash) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(macDomain))
	var s [8]byte
	binary.BigEndian.PutUint64(s[:], uint64(seq))
	m.Write(s[:])
	m.Write(prevMAC)
	m.Write(leaf[:])
	return m.Sum(nil)
}

// treeRoot folds a compact range (roots of the perfect subtrees of a tree,
// largest first) into the RFC 6962 root, as tlog.TreeHash does.
func treeRoot(stack []tlog.Hash) tlog.Hash {
	if len(stack) == 0 {
		return tlog.Hash{}
	}
	h := stack[len(stack)-1]
	for i := len(stack) - 2; i >= 0; i-- {
		h = tlog.NodeHash(stack[i], h)
	}
	return h
}

// compactRange accumulates leaves and yields the root at any size with
// O(log n) memory; Verify uses it instead of the stored hash table, which an
// attacker could have edited.
type compactRange struct {
	n     int64
	stack []tlog.Hash
}

func (c *compactRange) append(leaf tlog.Hash) {
	c.stack = append(c.stack, leaf)
	// Merge completed subtrees: one merge per trailing 1-bit of n.
	for n := c.n; n&1 == 1; n >>= 1 {
		k := len(c.stack)
		c.stack = append(c.stack[:k-2], tlog.NodeHash(c.stack[k-2], c.stack[k-1]))
	}
	c.n++
}

func (c *compactRange) root() tlog.Hash { return treeRoot(c.stack) }
