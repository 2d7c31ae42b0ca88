package statedb

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"syscall"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// TestClassify: only a store out of reach becomes UNAVAILABLE; a file
// that is not there, or an error that already has its code, stays as it is.
func TestClassify(t *testing.T) {
	cut := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	enoent := &fs.PathError{Op: "openat", Path: "missing.txt", Err: syscall.ENOENT}
	for _, c := range []struct {
		name string
		err  error
		want brokererr.Code // "" means returned unchanged
	}{
		{"a missing file", enoent, ""},
		{"a bare errno", syscall.EACCES, ""},
		{"FILE_NOT_FOUND over ENOENT", brokererr.Wrap(enoent, brokererr.FileNotFound, "no such file"), ""},
		{"FILE_NOT_FOUND over a cut connection", brokererr.Wrap(cut, brokererr.FileNotFound, "no such file"), ""},
		{"a plain error", errors.New("boom"), ""},
		{"a cut connection", fmt.Errorf("query: %w", cut), brokererr.Unavailable},
		{"an internal error over a cut connection", brokererr.Wrap(cut, brokererr.InternalError, "internal"), brokererr.Unavailable},
	} {
		got := Classify(c.err)
		if c.want == "" {
			if got != c.err {
				t.Errorf("%s: Classify changed %v into %v", c.name, c.err, got)
			}
			continue
		}
		if e := brokererr.As(got); e == nil || e.Code != c.want || !e.Retryable {
			t.Errorf("%s: Classify(%v) = %v, want retryable %s", c.name, c.err, got, c.want)
		}
	}
}
