// Package brokererr defines the structured errors that tools return to the
// model. Only errors of type *Error carry a message out of the server; any
// other error becomes INTERNAL_ERROR with no detail.
//
// Retryable tells the model whether sending the same call again, unchanged,
// can succeed without anyone changing the broker's configuration, the
// call's input or the caller's files. So: a rate or quota window that
// refills is retryable (WithRetryAfter says when); a dependency that is
// briefly down (UNAVAILABLE) is retryable; a service the operator has not
// configured (NOT_CONFIGURED), a full workspace or bad input is not, and
// NotRetryable marks an UNAVAILABLE that waiting will not cure.
package brokererr

import (
	"errors"
	"fmt"
	"time"
)

// Code is an UPPER_SNAKE error code the client can branch on.
type Code string

// The spec's codes, extended where later tools need more.
const (
	InvalidInput      Code = "INVALID_INPUT"
	RateLimitExceeded Code = "RATE_LIMIT_EXCEEDED"
	QuotaExceeded     Code = "QUOTA_EXCEEDED"
	PermissionDenied  Code = "PERMISSION_DENIED"
	PathTraversal     Code = "PATH_TRAVERSAL"
	FileSizeExceeded  Code = "FILE_SIZE_EXCEEDED"
	SandboxNotFound   Code = "SANDBOX_NOT_FOUND"
	SandboxTimeout    Code = "SANDBOX_TIMEOUT"
	InvalidRepo       Code = "INVALID_REPO"
	InvalidBranch     Code = "INVALID_BRANCH"
	GitHubAuthFailed  Code = "GITHUB_AUTH_FAILED"
	TokenExpired      Code = "TOKEN_EXPIRED"
	InternalError     Code = "INTERNAL_ERROR"
	// Extensions.
	Unauthenticated = Code("UNAUTHENTICATED")
	Unavailable     = Code("UNAVAILABLE")
	FileExists      = Code("FILE_EXISTS")
	FileNotFound    = Code("FILE_NOT_FOUND")
	UnknownLanguage = Code("UNKNOWN_LANGUAGE")
	Conflict        = Code("CONFLICT")
	// NotConfigured: the broker is not set up for this (no backend, no
	// provider, no allow-list); only the operator can change that.
	NotConfigured = Code("NOT_CONFIGURED")
)

// Codes lists every code, for docs and tests.
var Codes = []Code{
	InvalidInput, RateLimitExceeded, QuotaExceeded, PermissionDenied, PathTraversal,
	FileSizeExceeded, SandboxNotFound, SandboxTimeout, InvalidRepo, InvalidBranch,
	GitHubAuthFailed, TokenExpired, InternalError,
	Unauthenticated, Unavailable, FileExists, FileNotFound, UnknownLanguage, Conflict, NotConfigured,
}

// retryableByDefault marks codes where the same call may succeed later.
// QUOTA_EXCEEDED is not among them: only a windowed quota refills, and its
// error says when with WithRetryAfter; a full workspace stays full.
var retryableByDefault = map[Code]bool{
	RateLimitExceeded: true,
	SandboxTimeout:    true,
	Unavailable:       true,
}

// Error is an error the model can act on.
type Error struct {
	Code       Code
	Message    string
	Retryable  bool
	RetryAfter time.Duration // 0 when unknown
	cause      error         // kept for logs, never sent to the client
}

// Error is safe on a nil *Error, which a handler can return as a non-nil
// error interface by mistake.
func (e *Error) Error() string {
	if e == nil {
		return string(InternalError) + ": nil error"
	}
	return string(e.Code) + ": " + e.Message
}

// Unwrap exposes the internal cause to errors.Is/As.
func (e *Error) Unwrap() error {
	if e == nil {
		return nil
	}
	return e.cause
}

// New returns an error with the code's default retryability.
func New(code Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...), Retryable: retryableByDefault[code]}
}

// Wrap is New with an internal cause that stays server-side.
func Wrap(cause error, code Code, format string, args ...any) *Error {
	e := New(code, format, args...)
	e.cause = cause
	return e
}

// WithRetryAfter marks the error retryable after d.
func (e *Error) WithRetryAfter(d time.Duration) *Error {
	e.Retryable = true
	e.RetryAfter = d
	return e
}

// NotRetryable marks an error that the same call cannot get past by
// waiting (the sandbox's own program failed, say).
func (e *Error) NotRetryable() *Error {
	e.Retryable = false
	e.RetryAfter = 0
	return e
}

// As returns the *Error in err's chain, or nil.
func As(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return nil
}

// CodeOf returns err's code; unknown errors are INTERNAL_ERROR.
func CodeOf(err error) Code {
	if err == nil {
		return ""
	}
	if e := As(err); e != nil {
		return e.Code
	}
	return InternalError
}
