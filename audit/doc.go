// Package audit is the broker's tamper-evident, append-only audit log.
//
// Rows live in SQLite (WAL, file mode 0600), written by one writer
// goroutine that commits concurrent callers' rows together (group commit):
// an intent row is fsynced before Append returns, an outcome row is
// committed at once and fsynced with the next intent row, checkpoint or
// SyncDelay later. Triggers
// reject UPDATE, DELETE and out-of-chain INSERTs, but they only guard against
// application bugs: anyone with write access can drop them. Tampering is
// detected by cryptography instead:
//
//   - every row's logical fields are serialised canonically into body,
//     leaf = SHA256(0x00 || body) (RFC 6962 leaf hash);
//   - mac = HMAC-SHA256(K, "audit-v1" || u64be(seq) || prev_mac || leaf),
//     where K lives outside the database and prev_mac of the first row is
//     32 zero bytes (never NULL);
//   - every CheckpointEvery rows, every CheckpointInterval and on Close, the
//     RFC 6962 Merkle root of all leaves is signed with Ed25519 as a
//     C2SP-style note ("sandbox-broker/audit\n<size>\n<base64 root>\n") and
//     appended to a separate checkpoint file.
//
// Verify recomputes every leaf and MAC from the stored columns and checks the
// tree root at every checkpoint size, so it catches edited, deleted, inserted
// and truncated rows, and a chain rewritten by someone who holds the HMAC key
// but not the signing key. The checkpoint file only helps against truncation
// if a copy of it is kept where the DB writer cannot rewrite it.
package audit
