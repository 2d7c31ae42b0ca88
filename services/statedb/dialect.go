package statedb

import (
	"regexp"
	"strconv"
	"strings"
)

// The store's SQL is written once, in the subset SQLite and PostgreSQL
// share, with SQLite's placeholders (? and ?N). The dialect layer is what
// is left over: Postgres gets its placeholders renumbered ($N) on every
// statement, and its DDL the column types SQLite's names stand for.

// IsPostgresURL reports whether loc names a PostgreSQL database (a
// DATABASE_URL) rather than a SQLite file path.
func IsPostgresURL(loc string) bool {
	return strings.HasPrefix(loc, "postgres://") || strings.HasPrefix(loc, "postgresql://")
}

// rebind rewrites ? and ?N placeholders as $N, leaving string literals,
// quoted identifiers and comments alone.
func rebind(q string) string {
	if !strings.Contains(q, "?") {
		return q
	}
	var b strings.Builder
	b.Grow(len(q) + 8)
	n := 0
	for i := 0; i < len(q); i++ {
		c := q[i]
		switch {
		case c == '\'' || c == '"':
			j := i + 1
			for j < len(q) && q[j] != c {
				j++
			}
			b.WriteString(q[i:min(j+1, len(q))])
			i = j
		case c == '-' && i+1 < len(q) && q[i+1] == '-':
			j := strings.IndexByte(q[i:], '\n')
			if j < 0 {
				j = len(q) - i
			}
			b.WriteString(q[i : i+j])
			i += j - 1
		case c == '?':
			j := i + 1
			for j < len(q) && q[j] >= '0' && q[j] <= '9' {
				j++
			}
			b.WriteByte('$')
			if j > i+1 {
				b.WriteString(q[i+1 : j])
			} else {
				n++
				b.WriteString(strconv.Itoa(n))
			}
			i = j - 1
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// pgDDL maps SQLite's column types and table options to PostgreSQL's:
// INTEGER is 64-bit in SQLite (BIGINT), BLOB is BYTEA, and STRICT and
// WITHOUT ROWID (SQLite storage choices) have no counterpart.
var pgDDL = []struct {
	re  *regexp.Regexp
	out string
}{
	{regexp.MustCompile(`\bINTEGER\b`), "BIGINT"},
	{regexp.MustCompile(`\bBLOB\b`), "BYTEA"},
	{regexp.MustCompile(`\)\s*(STRICT|WITHOUT ROWID)\b`), ")"},
}

// PostgresDDL rewrites a schema step written for SQLite for PostgreSQL.
// No table relies on SQLite's rowid assigning an INTEGER PRIMARY KEY: rows
// carry their own keys, the same on both stores.
func PostgresDDL(step string) string {
	for _, r := range pgDDL {
		step = r.re.ReplaceAllString(step, r.out)
	}
	return step
}
