package github

import (
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	gh "github.com/google/go-github/v92/github"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// read runs an idempotent GitHub read with a timeout per attempt, retrying
// transport failures and 5xx answers a bounded number of times.
func (m *Manager) read(ctx context.Context, rs *repoState, call func(context.Context) (*gh.Response, error)) error {
	var err error
	for attempt := 0; attempt < readAttempts; attempt++ {
		if attempt > 0 {
			t := time.NewTimer(retryBase << (attempt - 1))
			select {
			case <-ctx.Done():
				t.Stop()
				return err
			case <-t.C:
			}
		}
		err = m.write(ctx, rs, call)
		if !retryable(ctx, err) {
			return err
		}
	}
	return err
}

// write runs one GitHub call with a timeout; writes are never retried.
// While the repo's token is rate limited no request is made at all.
func (m *Manager) write(ctx context.Context, rs *repoState, call func(context.Context) (*gh.Response, error)) error {
	if err := rs.limited(time.Now()); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, m.timeout)
	defer cancel()
	resp, err := call(cctx)
	if resp != nil && resp.Response != nil {
		rs.tok.sawExpiry(resp.Header)
		m.warnExpiring(rs.tok, time.Now())
		if resp.Body != nil {
			_ = resp.Body.Close()
		}
	}
	return err
}

func retryable(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil || brokererr.As(err) != nil {
		return false
	}
	var rle *gh.RateLimitError
	var abuse *gh.AbuseRateLimitError
	if errors.As(err, &rle) || errors.As(err, &abuse) {
		return false
	}
	var er *gh.ErrorResponse
	if errors.As(err, &er) {
		return er.Response != nil && er.Response.StatusCode >= 500
	}
	var redirect *gh.RedirectionError
	return !errors.As(err, &redirect) && !errors.Is(err, errTooLarge)
}

// capTransport bounds every response body, so a broken or hostile endpoint
// cannot make the broker buffer without limit.
type capTransport struct {
	base http.RoundTripper
	max  int64
}

func (t capTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.base.RoundTrip(r)
	if err == nil && resp.Body != nil {
		resp.Body = &capBody{ReadCloser: resp.Body, left: t.max}
	}
	return resp, err
}

var errTooLarge = errors.New("github: response body too large")

type capBody struct {
	io.ReadCloser
	left int64
}

func (b *capBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// At the cap: fine if the body ends here, an error if it goes on.
		var one [1]byte
		if n, err := b.ReadCloser.Read(one[:]); n == 0 && err != nil {
			return 0, err
		}
		return 0, errTooLarge
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}
