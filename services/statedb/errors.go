package statedb

import (
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// Classify turns a failure to reach the PostgreSQL server (down,
// restarting, connection cut) into a retryable UNAVAILABLE: the statement
// did not commit, so the same call can be sent again. Anything else is
// returned as it is.
func Classify(err error) error {
	if err == nil || !unreachable(err) {
		return err
	}
	if e := brokererr.As(err); e != nil && e.Code != brokererr.InternalError {
		return err // already says what went wrong (FILE_NOT_FOUND, ...)
	}
	return brokererr.Wrap(err, brokererr.Unavailable, "the state store is unavailable (restarting or unreachable); retry shortly")
}

func unreachable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// 08: connection exception; 57P0x: admin/crash shutdown, cannot
		// connect now.
		return strings.HasPrefix(pgErr.Code, "08") || strings.HasPrefix(pgErr.Code, "57P0")
	}
	// *net.OpError, not net.Error: every syscall.Errno is a net.Error, and
	// a file's ENOENT is no sign of a store out of reach.
	var opErr *net.OpError
	var connErr *pgconn.ConnectError
	return errors.Is(err, driver.ErrBadConn) || errors.As(err, &connErr) || errors.As(err, &opErr) ||
		pgconn.SafeToRetry(err) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed)
}
