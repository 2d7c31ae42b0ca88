package files

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// get sends a GET to target with headers (name, value pairs).
func (e *env) get(t *testing.T, target string, headers ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+target, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, body
}

// TestDownloadBeyondTheOldCap: a 200 MiB file (sparse: no disk used)
// downloads whole and by range; the cap is the workspace quota.
func TestDownloadBeyondTheOldCap(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	name := filepath.Join(dir, "big.bin")
	const size = 200 << 20
	f, err := os.Create(name)
	if err != nil {
		t.Fatal(err)
	}
	// Marks at both ends and in the middle, zeros between.
	for _, off := range []int64{0, size / 2, size - 4} {
		if _, err := f.WriteAt([]byte("MARK"), off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	want := sha256.New()
	src, _ := os.Open(name)
	_, _ = io.Copy(want, src)
	src.Close()

	tg := e.target(t, idA, "big.bin")
	resp, err := http.Get(e.srv.URL + tg)
	if err != nil {
		t.Fatal(err)
	}
	got := sha256.New()
	n, err := io.Copy(got, resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || n != size || !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
		t.Fatalf("download: %d, %d bytes, %v, hash equal %v", resp.StatusCode, n, err, bytes.Equal(got.Sum(nil), want.Sum(nil)))
	}
	resp, body := e.get(t, tg, "Range", fmt.Sprintf("bytes=%d-%d", size/2, size/2+3))
	if resp.StatusCode != 206 || string(body) != "MARK" {
		t.Fatalf("middle range: %d %q", resp.StatusCode, body)
	}
	resp, body = e.get(t, tg, "Range", "bytes=-4")
	if resp.StatusCode != 206 || string(body) != "MARK" || resp.Header.Get("Content-Range") != fmt.Sprintf("bytes %d-%d/%d", size-4, size-1, size) {
		t.Fatalf("suffix range: %d %q %q", resp.StatusCode, body, resp.Header.Get("Content-Range"))
	}

	// The cap is the workspace quota, or what is configured.
	e.handler.Limits.MaxBytes = size - 1
	if s := status(t, e.srv.URL, tg); s != 404 {
		t.Fatalf("over the workspace quota: %d", s)
	}
	e.handler.MaxFileBytes = size
	if s := status(t, e.srv.URL, tg); s != 200 {
		t.Fatalf("at the configured cap: %d", s)
	}
}

var etagForm = regexp.MustCompile(`^"[A-Za-z0-9_-]{22}"$`)

// TestETagAndConditionals: a strong ETag that changes with the content,
// even when the size and mtime are put back, and the conditional requests
// of RFC 9110 evaluated against it.
func TestETagAndConditionals(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	name := filepath.Join(dir, "data.txt")
	writeFile(t, name, "0123456789abcdef")
	mtime := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	if err := os.Chtimes(name, mtime, mtime); err != nil {
		t.Fatal(err)
	}
	tg := e.target(t, idA, "data.txt")

	resp, body := e.get(t, tg)
	tag := resp.Header.Get("ETag")
	if resp.StatusCode != 200 || !etagForm.MatchString(tag) || resp.Header.Get("Last-Modified") != mtime.Format(http.TimeFormat) ||
		resp.Header.Get("Accept-Ranges") != "bytes" {
		t.Fatalf("first GET: %d %q %v", resp.StatusCode, body, resp.Header)
	}
	if r2, _ := e.get(t, tg); r2.Header.Get("ETag") != tag {
		t.Fatalf("ETag not stable: %q then %q", tag, r2.Header.Get("ETag"))
	}

	// Revalidation.
	resp, body = e.get(t, tg, "If-None-Match", tag)
	if resp.StatusCode != 304 || len(body) != 0 || resp.Header.Get("ETag") != tag {
		t.Fatalf("If-None-Match: %d %q", resp.StatusCode, body)
	}
	if resp, _ = e.get(t, tg, "If-None-Match", `"other", `+tag); resp.StatusCode != 304 {
		t.Fatalf("If-None-Match list: %d", resp.StatusCode)
	}
	if resp, _ = e.get(t, tg, "If-None-Match", `"other"`); resp.StatusCode != 200 {
		t.Fatalf("If-None-Match other: %d", resp.StatusCode)
	}
	if resp, _ = e.get(t, tg, "If-Modified-Since", mtime.Format(http.TimeFormat)); resp.StatusCode != 304 {
		t.Fatalf("If-Modified-Since at mtime: %d", resp.StatusCode)
	}
	if resp, _ = e.get(t, tg, "If-Modified-Since", mtime.Add(-time.Second).Format(http.TimeFormat)); resp.StatusCode != 200 {
		t.Fatalf("If-Modified-Since before mtime: %d", resp.StatusCode)
	}
	if resp, _ = e.get(t, tg, "If-Match", `"other"`); resp.StatusCode != 412 {
		t.Fatalf("If-Match other: %d", resp.StatusCode)
	}

	// Resuming: If-Range with the current tag gives the range, with any
	// other validator the whole file. A date is never trusted, since the
	// sandbox sets mtimes at will.
	if resp, body = e.get(t, tg, "Range", "bytes=10-", "If-Range", tag); resp.StatusCode != 206 || string(body) != "abcdef" {
		t.Fatalf("If-Range current: %d %q", resp.StatusCode, body)
	}
	if resp, body = e.get(t, tg, "Range", "bytes=10-", "If-Range", `"stale"`); resp.StatusCode != 200 || string(body) != "0123456789abcdef" {
		t.Fatalf("If-Range stale: %d %q", resp.StatusCode, body)
	}
	if resp, body = e.get(t, tg, "Range", "bytes=10-", "If-Range", mtime.Format(http.TimeFormat)); resp.StatusCode != 200 || len(body) != 16 {
		t.Fatalf("If-Range date: %d %q", resp.StatusCode, body)
	}

	// Same size, same mtime, other content: a new tag, and the old one no
	// longer revalidates or resumes.
	writeFile(t, name, "ZYXWVUTSRQPONMLK")
	if err := os.Chtimes(name, mtime, mtime); err != nil {
		t.Fatal(err)
	}
	resp, body = e.get(t, tg, "If-None-Match", tag)
	if resp.StatusCode != 200 || string(body) != "ZYXWVUTSRQPONMLK" || resp.Header.Get("ETag") == tag || !etagForm.MatchString(resp.Header.Get("ETag")) {
		t.Fatalf("after a same-size rewrite: %d %q ETag %q (was %q)", resp.StatusCode, body, resp.Header.Get("ETag"), tag)
	}
	if resp, body = e.get(t, tg, "Range", "bytes=10-", "If-Range", tag); resp.StatusCode != 200 || string(body) != "ZYXWVUTSRQPONMLK" {
		t.Fatalf("If-Range after rewrite: %d %q", resp.StatusCode, body)
	}
	// Replaced by another file (rename): a new tag too.
	newTag := resp.Header.Get("ETag")
	writeFile(t, name+".new", "ZYXWVUTSRQPONMLK")
	if err := os.Chtimes(name+".new", mtime, mtime); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(name+".new", name); err != nil {
		t.Fatal(err)
	}
	if resp, _ = e.get(t, tg, "If-None-Match", newTag); resp.StatusCode != 200 || resp.Header.Get("ETag") == newTag {
		t.Fatalf("after a rename: %d %q", resp.StatusCode, resp.Header.Get("ETag"))
	}
}

// TestRanges: single, suffix, open and multiple ranges, and unsatisfiable
// ones, with the download headers on every answer.
func TestRanges(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	content := "0123456789abcdefghijklmnopqrstuvwxyz"
	writeFile(t, filepath.Join(dir, "r.txt"), content)
	tg := e.target(t, idA, "r.txt")
	for _, c := range []struct{ rng, want, cr string }{
		{"bytes=0-0", "0", "bytes 0-0/36"},
		{"bytes=30-", "uvwxyz", "bytes 30-35/36"},
		{"bytes=-3", "xyz", "bytes 33-35/36"},
		{"bytes=34-99", "yz", "bytes 34-35/36"},
	} {
		resp, body := e.get(t, tg, "Range", c.rng)
		if resp.StatusCode != 206 || string(body) != c.want || resp.Header.Get("Content-Range") != c.cr ||
			resp.Header.Get("Content-Disposition") == "" || resp.Header.Get("Content-Security-Policy") != "sandbox" {
			t.Errorf("%s: %d %q %q", c.rng, resp.StatusCode, body, resp.Header.Get("Content-Range"))
		}
	}

	resp, body := e.get(t, tg, "Range", "bytes=0-1,10-12,-2")
	mt, params, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode != 206 || err != nil || mt != "multipart/byteranges" {
		t.Fatalf("multi-range: %d %q %v", resp.StatusCode, resp.Header.Get("Content-Type"), err)
	}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	var parts []string
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(p)
		parts = append(parts, p.Header.Get("Content-Range")+"="+string(b))
	}
	if want := []string{"bytes 0-1/36=01", "bytes 10-12/36=abc", "bytes 34-35/36=yz"}; strings.Join(parts, "|") != strings.Join(want, "|") {
		t.Fatalf("parts %q, want %q", parts, want)
	}

	for _, rng := range []string{"bytes=36-", "bytes=100-200"} {
		resp, _ := e.get(t, tg, "Range", rng)
		if resp.StatusCode != 416 || resp.Header.Get("Content-Range") != "bytes */36" {
			t.Errorf("%s: %d %q", rng, resp.StatusCode, resp.Header.Get("Content-Range"))
		}
	}
	// Ranges adding up to more than the file are ignored: the whole file,
	// once, rather than the same bytes many times.
	many := "bytes=" + strings.TrimSuffix(strings.Repeat("0-35,", 50), ",")
	if resp, body := e.get(t, tg, "Range", many); resp.StatusCode != 200 || string(body) != content {
		t.Errorf("overlapping ranges: %d, %d bytes", resp.StatusCode, len(body))
	}
}

// TestRangesHoldWhileTheFileFlips is TestSizeCapHoldsWhileTheFileFlips for
// range requests: whatever the size when the ranges are checked, no
// answer describes or sends a byte at or past the cap.
func TestRangesHoldWhileTheFileFlips(t *testing.T) {
	e := newEnv(t)
	dir := e.ws(t, idA)
	const limit = 1 << 20
	e.handler.MaxFileBytes = limit
	name := filepath.Join(dir, "flip.bin")
	writeFile(t, name, "")
	stop := make(chan struct{})
	flipped := make(chan struct{})
	go func() {
		defer close(flipped)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = os.Truncate(name, limit/2)
			_ = os.Truncate(name, 250<<20)
		}
	}()
	defer func() { close(stop); <-flipped }()

	crRE := regexp.MustCompile(`^bytes (\d+)-(\d+)/(\d+)$`)
	checkCR := func(i int, cr string) {
		m := crRE.FindStringSubmatch(cr)
		if m == nil {
			t.Fatalf("request %d: Content-Range %q", i, cr)
		}
		end, _ := strconv.ParseInt(m[2], 10, 64)
		total, _ := strconv.ParseInt(m[3], 10, 64)
		if end >= limit || total > limit {
			t.Fatalf("request %d: Content-Range %q beyond the %d cap", i, cr, limit)
		}
	}
	target := e.srv.URL + e.target(t, idA, "flip.bin")
	ranges := []string{"bytes=0-99", fmt.Sprintf("bytes=%d-", limit/2-10), fmt.Sprintf("bytes=%d-%d", limit-10, 200<<20),
		"bytes=-100", fmt.Sprintf("bytes=0-9,%d-%d", limit-5, 100<<20)}
	served := 0
	for i := 0; i < 400; i++ {
		req, _ := http.NewRequest(http.MethodGet, target, nil)
		req.Header.Set("Range", ranges[i%len(ranges)])
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.ContentLength > limit {
			t.Fatalf("request %d: Content-Length %d over the cap", i, resp.ContentLength)
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, limit+1))
		resp.Body.Close()
		if len(body) > limit {
			t.Fatalf("request %d: %d bytes, over the cap", i, len(body))
		}
		switch resp.StatusCode {
		case 206:
			served++
			if cr := resp.Header.Get("Content-Range"); cr != "" {
				checkCR(i, cr)
			} else { // multipart: every part's range within the cap
				_, params, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
				mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
				for p, err := mr.NextPart(); err == nil; p, err = mr.NextPart() {
					checkCR(i, p.Header.Get("Content-Range"))
				}
			}
		case 200, 404, 416:
		default:
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
	}
	if served == 0 {
		t.Fatal("no range was served: the flip loop never left the file under the cap")
	}
}
