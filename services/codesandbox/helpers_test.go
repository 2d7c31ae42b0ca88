package codesandbox

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
)

const testKey = "csb_v1_secret_test_key_0123456789"

// logBuf collects log lines so tests can check what was never logged.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func newFake(t *testing.T) *csbfake.Server { return csbfake.New(t, testKey) }

// fastOptions retry quickly so tests stay short.
func fastOptions(f *csbfake.Server, log *logBuf) Options {
	o := Options{
		BaseURL:      f.URL(),
		APIKey:       testKey,
		Timeout:      5 * time.Second,
		RetryBase:    2 * time.Millisecond,
		MaxRetryWait: 50 * time.Millisecond,
	}
	if log != nil {
		o.Log = zerolog.New(log).Level(zerolog.DebugLevel)
	}
	return o
}

func newClient(t *testing.T, f *csbfake.Server, log *logBuf, mod func(*Options)) *Client {
	t.Helper()
	o := fastOptions(f, log)
	if mod != nil {
		mod(&o)
	}
	c, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ctx(t *testing.T) context.Context {
	t.Helper()
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func wantCode(t *testing.T, err error, code brokererr.Code) *brokererr.Error {
	t.Helper()
	if err == nil {
		t.Fatalf("want %s, got no error", code)
	}
	e := brokererr.As(err)
	if e == nil || e.Code != code {
		t.Fatalf("want %s, got %v", code, err)
	}
	return e
}

// count returns how many recorded requests match method and path.
func count(f *csbfake.Server, method, path string) int {
	n := 0
	for _, r := range f.Requests() {
		if r.Method == method && r.Path == path {
			n++
		}
	}
	return n
}

// await blocks until cond holds; the fake wakes it on every change, so
// nothing polls or sleeps. The timeout only bounds a broken test.
func await(t *testing.T, f *csbfake.Server, what string, cond func() bool) {
	t.Helper()
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.Await(c, cond); err != nil {
		t.Fatalf("timed out waiting for %s", what)
	}
}
