package statedb

import (
	"strings"
	"testing"
)

func TestRebind(t *testing.T) {
	for in, want := range map[string]string{
		`SELECT a FROM t WHERE b = ? AND c = ?`:       `SELECT a FROM t WHERE b = $1 AND c = $2`,
		`UPDATE t SET a = ?1 WHERE a > ?1 AND b = ?2`: `UPDATE t SET a = $1 WHERE a > $1 AND b = $2`,
		`SELECT '?', "a?" FROM t WHERE x = ? -- why?`: `SELECT '?', "a?" FROM t WHERE x = $1 -- why?`,
		"SELECT 1 -- c?\nWHERE a = ?":                 "SELECT 1 -- c?\nWHERE a = $1",
		`SELECT 'unterminated ?`:                      `SELECT 'unterminated ?`,
		`VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`: `VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)`,
	} {
		if got := rebind(in); got != want {
			t.Errorf("rebind(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestPostgresDDL(t *testing.T) {
	in := "CREATE TABLE t (a INTEGER PRIMARY KEY, b BLOB, c TEXT, d INTEGERS) WITHOUT ROWID;\nCREATE TABLE u (x INTEGER) STRICT"
	want := "CREATE TABLE t (a BIGINT PRIMARY KEY, b BYTEA, c TEXT, d INTEGERS);\nCREATE TABLE u (x BIGINT)"
	if got := PostgresDDL(in); got != want {
		t.Fatalf("PostgresDDL = %q, want %q", got, want)
	}
}

func FuzzRebind(f *testing.F) {
	f.Add(`SELECT '?' FROM t WHERE a = ?1 AND b = ? -- ?`)
	f.Fuzz(func(t *testing.T, q string) {
		// Every placeholder is rewritten: a second pass finds none, and
		// text outside placeholders is kept.
		out := rebind(q)
		if again := rebind(out); again != out {
			t.Fatalf("rebind(%q) = %q left placeholders (second pass %q)", q, out, again)
		}
		if strings.Count(out, "?")+strings.Count(out, "$") < strings.Count(q, "?") {
			t.Fatalf("rebind(%q) = %q lost text", q, out)
		}
	})
}
