package brokererr_test

import (
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

func TestCodesAreUpperSnakeAndUnique(t *testing.T) {
	re := regexp.MustCompile(`^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$`)
	seen := map[brokererr.Code]bool{}
	for _, c := range brokererr.Codes {
		if !re.MatchString(string(c)) {
			t.Errorf("code %q is not UPPER_SNAKE", c)
		}
		if seen[c] {
			t.Errorf("code %q listed twice", c)
		}
		seen[c] = true
	}
	if len(brokererr.Codes) < 19 {
		t.Errorf("Codes lists %d codes, want at least 19", len(brokererr.Codes))
	}
}

func TestNewRetryability(t *testing.T) {
	retryable := map[brokererr.Code]bool{
		brokererr.RateLimitExceeded: true, brokererr.SandboxTimeout: true, brokererr.Unavailable: true,
	}
	for _, c := range brokererr.Codes {
		e := brokererr.New(c, "n=%d", 3)
		if e.Retryable != retryable[c] {
			t.Errorf("%s: Retryable = %v", c, e.Retryable)
		}
		if e.Message != "n=3" || e.Error() != string(c)+": n=3" || e.RetryAfter != 0 {
			t.Errorf("%s: %#v / %q", c, e, e.Error())
		}
	}
	e := brokererr.New(brokererr.InvalidInput, "x").WithRetryAfter(1500 * time.Millisecond)
	if !e.Retryable || e.RetryAfter != 1500*time.Millisecond {
		t.Errorf("WithRetryAfter: %#v", e)
	}
	// A quota is retryable only when its window refills.
	if e := brokererr.New(brokererr.QuotaExceeded, "workspace is full"); e.Retryable {
		t.Error("a full workspace is not retryable")
	}
	if e := brokererr.New(brokererr.QuotaExceeded, "daily time used up").WithRetryAfter(time.Hour); !e.Retryable {
		t.Error("a windowed quota is retryable")
	}
	if e := brokererr.New(brokererr.NotConfigured, "GitHub is not configured"); e.Retryable {
		t.Error("NOT_CONFIGURED is not retryable")
	}
	if e := brokererr.New(brokererr.Unavailable, "the app exited").WithRetryAfter(time.Second).NotRetryable(); e.Retryable || e.RetryAfter != 0 {
		t.Errorf("NotRetryable: %#v", e)
	}
}

func TestWrapKeepsCauseServerSide(t *testing.T) {
	cause := fmt.Errorf("open /home/u/secret: %w", fs.ErrPermission)
	e := brokererr.Wrap(cause, brokererr.PermissionDenied, "not allowed")
	if e.Message != "not allowed" || e.Error() != "PERMISSION_DENIED: not allowed" {
		t.Errorf("Wrap leaks the cause into the message: %q", e.Error())
	}
	if !errors.Is(e, fs.ErrPermission) || e.Unwrap() != cause {
		t.Error("Wrap lost the cause")
	}
}

func TestAsAndCodeOf(t *testing.T) {
	inner := brokererr.New(brokererr.FileNotFound, "no such file")
	wrapped := fmt.Errorf("layer: %w", inner)
	joined := errors.Join(errors.New("other"), wrapped)
	outer := brokererr.Wrap(inner, brokererr.Unavailable, "outer")
	cases := []struct {
		err  error
		as   *brokererr.Error
		code brokererr.Code
	}{
		{nil, nil, ""},
		{errors.New("plain"), nil, brokererr.InternalError},
		{inner, inner, brokererr.FileNotFound},
		{wrapped, inner, brokererr.FileNotFound},
		{joined, inner, brokererr.FileNotFound},
		{outer, outer, brokererr.Unavailable}, // the outermost wins
	}
	for i, c := range cases {
		if got := brokererr.As(c.err); got != c.as {
			t.Errorf("%d: As = %v, want %v", i, got, c.as)
		}
		if got := brokererr.CodeOf(c.err); got != c.code {
			t.Errorf("%d: CodeOf = %q, want %q", i, got, c.code)
		}
	}
}

func TestTypedNilIsSafe(t *testing.T) {
	var e *brokererr.Error
	var err error = e // non-nil interface holding a nil pointer
	if brokererr.As(err) != nil {
		t.Error("As(typed nil) should be nil")
	}
	if got := brokererr.CodeOf(err); got != brokererr.InternalError {
		t.Errorf("CodeOf(typed nil) = %q", got)
	}
	if err.Error() == "" || e.Unwrap() != nil {
		t.Error("typed nil must not panic and has no cause")
	}
}
