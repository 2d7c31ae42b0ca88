package audit

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
)

// Tail writes the last n entries as JSON lines, oldest first.
func Tail(ctx context.Context, path string, n int, w io.Writer) error {
	if n < 1 {
		return errors.New("audit: tail: n must be at least 1")
	}
	db, sel, err := openReader(ctx, path)
	if err != nil {
		return err
	}
	defer db.Close()
	rows, err := db.QueryContext(ctx, sel+" ORDER BY seq DESC LIMIT ?", n)
	if err != nil {
		return fmt.Errorf("audit: tail: %w", err)
	}
	defer rows.Close()
	var entries []Entry
	if err := eachEntry(rows, func(e Entry) error { entries = append(entries, e); return nil }); err != nil {
		return fmt.Errorf("audit: tail: %w", err)
	}
	slices.Reverse(entries)
	enc := json.NewEncoder(w)
	for _, e := range entries {
		if err := enc.Encode(e); err != nil {
			return fmt.Errorf("audit: tail: %w", err)
		}
	}
	return nil
}

// Export writes every entry in seq order. Only format "jsonl" exists.
func Export(ctx context.Context, path string, format string, w io.Writer) error {
	if format != "jsonl" {
		return fmt.Errorf("audit: export: unknown format %q (want jsonl)", format)
	}
	db, sel, err := openReader(ctx, path)
	if err != nil {
		return err
	}
	defer db.Close()
	rows, err := db.QueryContext(ctx, sel+" ORDER BY seq")
	if err != nil {
		return fmt.Errorf("audit: export: %w", err)
	}
	defer rows.Close()
	enc := json.NewEncoder(w)
	if err := eachEntry(rows, func(e Entry) error { return enc.Encode(e) }); err != nil {
		return fmt.Errorf("audit: export: %w", err)
	}
	return nil
}

func eachEntry(rows *sql.Rows, fn func(Entry) error) error {
	for rows.Next() {
		r, err := scanRow(rows)
		if err != nil {
			return err
		}
		e, err := r.entry()
		if err != nil {
			return err
		}
		if err := fn(e); err != nil {
			return err
		}
	}
	return rows.Err()
}
