package tests

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"mime"
	"mime/multipart"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
)

// uploadLink is create_upload_url's result.
type uploadLink struct {
	SessionID string `json:"session_id"`
	Path      string `json:"path"`
	Method    string `json:"method"`
	URL       string `json:"url"`
	MaxBytes  int64  `json:"max_bytes"`
	Overwrite bool   `json:"overwrite"`
	ExpiresAt string `json:"expires_at"`
	URI       string `json:"uri"`
}

func createUploadURL(t testing.TB, c *client.Client, args map[string]any) uploadLink {
	t.Helper()
	var l uploadLink
	res := callTool(t, c, "create_upload_url", args)
	if res.IsError {
		t.Fatalf("create_upload_url: %+v", res.Content)
	}
	resultJSON(t, res, &l)
	if l.Method != http.MethodPut || l.URL == "" {
		t.Fatalf("create_upload_url: %+v", l)
	}
	return l
}

// putBody PUTs body to u (chunked unless body is a *bytes.Reader) and
// returns the status and the JSON answer.
func putBody(t testing.TB, u string, body io.Reader) (int, map[string]any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, u, body)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	raw, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(raw, &out)
	return resp.StatusCode, out
}

// getRange GETs u with headers (name, value pairs).
func getWith(t testing.TB, u string, headers ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
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

// randomStream is n deterministic pseudo-random bytes, without a length
// the HTTP client could see.
type randomStream struct{ r io.Reader }

func newRandomStream(seed uint64, n int64) randomStream {
	var s [32]byte
	s[0] = byte(seed)
	return randomStream{io.LimitReader(rand.NewChaCha8(s), n)}
}

func (s randomStream) Read(p []byte) (int, error) { return s.r.Read(p) }

func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// TestLargeFileDownloads: a 200 MB file of random bytes, written by sandbox
// code, downloads whole and by ranges through the broker's signed link
// (it was refused with 404 above 64 MiB), with a strong ETag that
// revalidates (304) until the content changes.
func TestLargeFileDownloads(t *testing.T) {
	b := engineBroker(t, nil)
	c := b.Client(t, testToken)
	const size = 200_000_000
	r, _ := run(t, c, map[string]any{"language": "bash", "timeout_s": 120,
		"code": fmt.Sprintf("head -c %d /dev/urandom > big.bin && sha256sum big.bin | cut -d' ' -f1", size)})
	want := strings.TrimSpace(r.Stdout)
	var link string
	for _, f := range r.Files {
		if f.Name == "big.bin" && f.Size == size {
			link = f.URL
		}
	}
	if link == "" || len(want) != 64 {
		t.Fatalf("run: %+v", r)
	}

	resp, err := http.Get(link)
	if err != nil {
		t.Fatal(err)
	}
	all, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || len(all) != size || sha256Hex(all) != want {
		t.Fatalf("full download: %d, %d bytes, %v, sha256 %s want %s", resp.StatusCode, len(all), err, sha256Hex(all), want)
	}
	tag := resp.Header.Get("ETag")
	if !strings.HasPrefix(tag, `"`) || resp.Header.Get("Content-Disposition") != "attachment; filename*=UTF-8''big.bin" ||
		resp.Header.Get("Content-Security-Policy") != "sandbox" || resp.Header.Get("Accept-Ranges") != "bytes" {
		t.Fatalf("headers: %v", resp.Header)
	}

	// Ranges: the first and last bytes, spans across the middle, and a
	// multipart answer, each checked against the full download.
	for _, rg := range [][2]int{{0, 0}, {size - 1, size - 1}, {12_345_678, 99_999_999}, {size / 2, size - 1}} {
		resp, body := getWith(t, link, "Range", fmt.Sprintf("bytes=%d-%d", rg[0], rg[1]))
		if resp.StatusCode != 206 || !bytes.Equal(body, all[rg[0]:rg[1]+1]) ||
			resp.Header.Get("Content-Range") != fmt.Sprintf("bytes %d-%d/%d", rg[0], rg[1], size) {
			t.Fatalf("range %v: %d, %d bytes, %q", rg, resp.StatusCode, len(body), resp.Header.Get("Content-Range"))
		}
	}
	resp, body := getWith(t, link, "Range", "bytes=0-9,150000000-150000099,-10")
	_, params, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.StatusCode != 206 || err != nil {
		t.Fatalf("multi-range: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	wantParts := [][]byte{all[:10], all[150_000_000:150_000_100], all[size-10:]}
	for i, w := range wantParts {
		p, err := mr.NextPart()
		if err != nil {
			t.Fatalf("part %d: %v", i, err)
		}
		got, _ := io.ReadAll(p)
		if !bytes.Equal(got, w) {
			t.Fatalf("part %d differs", i)
		}
	}
	// Resuming with If-Range: the rest of the file.
	resp, body = getWith(t, link, "Range", "bytes=199999990-", "If-Range", tag)
	if resp.StatusCode != 206 || !bytes.Equal(body, all[size-10:]) {
		t.Fatalf("If-Range resume: %d", resp.StatusCode)
	}

	// Revalidation until the content changes (same size, mtime put back).
	if resp, body = getWith(t, link, "If-None-Match", tag); resp.StatusCode != 304 || len(body) != 0 {
		t.Fatalf("If-None-Match: %d, %d bytes", resp.StatusCode, len(body))
	}
	run(t, c, map[string]any{"session_id": r.SessionID, "language": "bash",
		"code": "t=$(stat -c %y big.bin); printf XXXX | dd of=big.bin bs=1 seek=1000 conv=notrunc status=none; touch -d \"$t\" big.bin"})
	resp, body = getWith(t, link, "If-None-Match", tag, "Range", "bytes=1000-1003")
	if resp.StatusCode != 206 || string(body) != "XXXX" || resp.Header.Get("ETag") == tag {
		t.Fatalf("after a same-size rewrite: %d %q ETag %q", resp.StatusCode, body, resp.Header.Get("ETag"))
	}
	if resp, body = getWith(t, link, "Range", "bytes=1000-1003", "If-Range", tag); resp.StatusCode != 200 || len(body) != size {
		t.Fatalf("If-Range with the old tag: %d, %d bytes (want the whole new file)", resp.StatusCode, len(body))
	}
}

// TestSignedUploads: a 100 MB upload streamed by the client lands intact,
// owned by the sandbox, audited; an upload past the workspace quota is
// refused while it streams and leaves nothing; tampered, expired,
// download-signed and traversing links are refused.
func TestSignedUploads(t *testing.T) {
	b := engineBroker(t, map[string]string{"SANDBOX_MAX_WORKSPACE_MB": "160", "FILE_URL_MAX_MB": "1024"})
	c := b.Client(t, testToken)
	const size = 100_000_000
	l := createUploadURL(t, c, map[string]any{"path": "in/upload.bin"})
	if l.MaxBytes != 1024<<20 || l.Overwrite || !strings.HasPrefix(l.URI, "sandbox://"+l.SessionID+"/") {
		t.Fatalf("link: %+v", l)
	}
	if exp, err := time.Parse(time.RFC3339, l.ExpiresAt); err != nil || time.Until(exp) > 16*time.Minute || time.Until(exp) < 10*time.Minute {
		t.Fatalf("expires_at %q", l.ExpiresAt)
	}
	sum := sha256.New()
	code, out := putBody(t, l.URL, io.TeeReader(newRandomStream(1, size), sum))
	want := hex.EncodeToString(sum.Sum(nil))
	if code != http.StatusCreated || out["size"] != float64(size) || out["sha256"] != want {
		t.Fatalf("PUT: %d %v", code, out)
	}
	// The sandbox sees it whole, and may change it (it is the owner).
	r, _ := run(t, c, map[string]any{"session_id": l.SessionID, "language": "bash",
		"code": "sha256sum in/upload.bin | cut -d' ' -f1; ls -A in; echo x >> in/upload.bin && sha256sum in/upload.bin | cut -d' ' -f1"})
	lines := strings.Fields(r.Stdout)
	if len(lines) != 3 || lines[0] != want || lines[1] != "upload.bin" || len(lines[2]) != 64 {
		t.Fatalf("in the sandbox: %q", r.Stdout)
	}
	appended := lines[2]
	// The same link again may not overwrite.
	if code, out = putBody(t, l.URL, strings.NewReader("again")); code != http.StatusConflict || out["error"] != "FILE_EXISTS" {
		t.Fatalf("second PUT: %d %v", code, out)
	}

	// Over the quota (160 MiB; 100 MB used), refused mid-stream: the
	// client gets its answer before it has sent its 200 MB.
	l2 := createUploadURL(t, c, map[string]any{"session_id": l.SessionID, "path": "too/big.bin"})
	var sent atomic.Int64
	req, _ := http.NewRequest(http.MethodPut, l2.URL, countingReader{newRandomStream(2, 200_000_000), &sent})
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	atAnswer := sent.Load()
	err = json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusRequestEntityTooLarge || out["error"] != "QUOTA_EXCEEDED" {
		t.Fatalf("over quota: %d %v %v", resp.StatusCode, out, err)
	}
	if atAnswer >= 200_000_000 {
		t.Errorf("the broker answered only after the whole over-quota body was sent")
	}
	r, _ = run(t, c, map[string]any{"session_id": l.SessionID, "language": "bash", "code": "ls -A; ls -A in"})
	if got := strings.Fields(r.Stdout); strings.Join(got, " ") != "in upload.bin" {
		t.Fatalf("workspace after the refused upload: %q", r.Stdout)
	}

	// Links that must not work.
	u, _ := url.Parse(l2.URL)
	mutate := func(f func(u *url.URL, q url.Values)) string {
		u2 := *u
		q := u.Query()
		f(&u2, q)
		u2.RawQuery = q.Encode()
		return u2.String()
	}
	var ra struct {
		URL string `json:"url"`
	}
	resultJSON(t, callTool(t, c, "read_artifact", map[string]any{"session_id": l.SessionID, "path": "in/upload.bin", "max_bytes": 1}), &ra)
	download := ra.URL
	bad := map[string]string{
		"tampered sig":  mutate(func(_ *url.URL, q url.Values) { q.Set("sig", strings.Repeat("A", len(q.Get("sig")))) }),
		"expired":       mutate(func(_ *url.URL, q url.Values) { q.Set("exp", "1000000000") }),
		"larger max":    mutate(func(_ *url.URL, q url.Values) { q.Set("max", "2000000000") }),
		"overwrite":     mutate(func(_ *url.URL, q url.Values) { q.Set("ow", "1") }),
		"other path":    mutate(func(u *url.URL, _ url.Values) { u.Path = strings.Replace(u.Path, "too/big.bin", "in/upload.bin", 1) }),
		"traversal":     mutate(func(u *url.URL, _ url.Values) { u.Path = strings.Replace(u.Path, "too/big.bin", "too/../../x", 1) }),
		"download link": download,
	}
	for name, bu := range bad {
		if code, _ := putBody(t, bu, strings.NewReader("evil")); code != http.StatusForbidden {
			t.Errorf("PUT with %s: %d, want 403", name, code)
		}
	}
	if resp, _ := getWith(t, l2.URL); resp.StatusCode != http.StatusForbidden {
		t.Errorf("GET with an upload link: %d", resp.StatusCode)
	}
	r, _ = run(t, c, map[string]any{"session_id": l.SessionID, "language": "bash", "code": "sha256sum in/upload.bin | cut -d' ' -f1; ls -A; ls -A in"})
	if got := strings.Join(strings.Fields(r.Stdout), " "); got != appended+" in upload.bin" {
		t.Fatalf("workspace after refused links: %q", r.Stdout)
	}

	// Audited like a tool call: intent, then outcome with the stored hash.
	var intents, outcomes int
	for _, e := range auditEntries(t, b.Root) {
		if e.Tool != "files.upload" {
			continue
		}
		if e.Principal != "default" {
			t.Errorf("upload row with principal %q", e.Principal)
		}
		if strings.Contains(string(e.Params), l.URL[strings.Index(l.URL, "sig="):]) {
			t.Errorf("audit row holds the signature: %s", e.Params)
		}
		switch e.Phase {
		case "intent":
			intents++
		case "outcome":
			outcomes++
			if e.Outcome == "success" && !strings.Contains(string(e.Params), want) {
				t.Errorf("success row without the hash: %s", e.Params)
			}
		}
	}
	if intents != 3 || outcomes != 3 { // stored, exists, over quota
		t.Errorf("files.upload rows: %d intents, %d outcomes", intents, outcomes)
	}
}

type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c countingReader) Read(p []byte) (int, error) {
	k, err := c.r.Read(p)
	c.n.Add(int64(k))
	return k, err
}

// TestSlowUploadsKeepTheMinimumRate: behind the broker's connection and
// body guards, an upload may take longer than MCP_BODY_TIMEOUT_S as long as
// it keeps FILE_UPLOAD_MIN_KBPS, a verified upload is not closed to make
// room for unauthenticated connections, and one that stalls is cut off
// (408) and leaves nothing.
func TestSlowUploadsKeepTheMinimumRate(t *testing.T) {
	b := engineBroker(t, map[string]string{"MCP_BODY_TIMEOUT_S": "2", "FILE_UPLOAD_MIN_KBPS": "64", "MCP_MAX_UNAUTH_CONNS_PER_ADDR": "4"})
	c := b.Client(t, testToken)
	l := createUploadURL(t, c, map[string]any{"path": "steady.bin"})
	addr := strings.TrimPrefix(strings.SplitN(l.URL, "/files/", 2)[0], "http://")
	target := "/files/" + strings.SplitN(l.URL, "/files/", 2)[1]
	// between runs after each chunk but the last.
	send := func(target string, length int, chunks [][]byte, between func()) (int, time.Duration) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
		start := time.Now()
		fmt.Fprintf(conn, "PUT %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n", target, addr, length)
		for i, ch := range chunks {
			if i > 0 {
				between()
			}
			if _, err := conn.Write(ch); err != nil {
				break
			}
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode, time.Since(start)
	}
	// 5 × 256 KiB, one a second: 4 s, twice the body timeout, at 256 KiB/s.
	// Meanwhile 8 connections from the same address send nothing: past the
	// per-address limit for unauthenticated connections (4), the oldest are
	// closed, but never the verified upload.
	chunk := bytes.Repeat([]byte("s"), 256<<10)
	var idle []net.Conn
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	code, took := send(target, 5*len(chunk), [][]byte{chunk, chunk, chunk, chunk, chunk}, func() {
		for range 2 {
			ic, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			idle = append(idle, ic)
		}
		time.Sleep(time.Second) // the client's pace
	})
	if code != http.StatusCreated || took < 4*time.Second {
		t.Fatalf("steady upload: %d after %v", code, took)
	}
	// 64 KiB, then nothing: cut off after the 2 s grace and the 1 s the
	// bytes earned.
	l2 := createUploadURL(t, c, map[string]any{"session_id": l.SessionID, "path": "stalled.bin"})
	code, took = send("/files/"+strings.SplitN(l2.URL, "/files/", 2)[1], 10<<20, [][]byte{make([]byte, 64<<10)}, func() {})
	if code != http.StatusRequestTimeout || took < 3*time.Second || took > 20*time.Second {
		t.Fatalf("stalled upload: %d after %v", code, took)
	}
	r, _ := run(t, c, map[string]any{"session_id": l.SessionID, "language": "bash", "code": "ls -A"})
	if strings.TrimSpace(r.Stdout) != "steady.bin" {
		t.Fatalf("workspace: %q", r.Stdout)
	}
}

// TestSignedUploadIntoANewSession: on both backends, a link made for a
// session that has not run anything yet works (the workspace is prepared
// for it), and the file belongs to the session's sandbox user.
func TestSignedUploadIntoANewSession(t *testing.T) {
	backends(t, nil, func(t *testing.T, backend string, b *Broker, c *client.Client) {
		l := createUploadURL(t, c, map[string]any{"path": "sub/in.txt", "max_bytes": 64})
		if code, out := putBody(t, l.URL, strings.NewReader("uploaded\n")); code != http.StatusCreated || out["size"] != float64(9) {
			t.Fatalf("PUT: %d %v", code, out)
		}
		r, _ := run(t, c, map[string]any{"session_id": l.SessionID, "language": "bash",
			"code": "echo appended >> sub/in.txt && cat sub/in.txt && test \"$(stat -c %u sub/in.txt)\" = \"$(id -u)\" && echo owned"})
		if r.Stdout != "uploaded\nappended\nowned\n" {
			t.Fatalf("in the sandbox: %q", r.Stdout)
		}
		if code, out := putBody(t, l.URL, strings.NewReader(strings.Repeat("x", 65))); code != http.StatusRequestEntityTooLarge || out["error"] != "FILE_SIZE_EXCEEDED" {
			t.Fatalf("over max_bytes: %d %v", code, out)
		}
	})
}
