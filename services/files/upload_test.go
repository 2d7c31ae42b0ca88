package files

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// auditLog records what the handler tells UploadAudit.
type auditLog struct {
	mu      sync.Mutex
	fail    error // returned by begin
	begun   []Upload
	results []UploadResult
	errs    []error
}

func (a *auditLog) begin(_ context.Context, u Upload, sigHash string) (func(UploadResult, error), error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.fail != nil {
		return nil, a.fail
	}
	if len(sigHash) != 12 {
		return nil, fmt.Errorf("sig hash %q", sigHash)
	}
	a.begun = append(a.begun, u)
	return func(res UploadResult, err error) {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.results = append(a.results, res)
		a.errs = append(a.errs, err)
	}, nil
}

func (a *auditLog) ends() ([]UploadResult, []error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.results), slices.Clone(a.errs)
}

// uploadEnv is an env whose handler takes uploads, audited into its log.
func uploadEnv(t *testing.T) (*env, *auditLog) {
	e := newEnv(t)
	a := &auditLog{}
	e.handler.Audit = a.begin
	return e, a
}

// uploadTarget signs an upload link and returns its request target.
func (e *env) uploadTarget(t *testing.T, id, path string, max int64, overwrite bool) string {
	t.Helper()
	u, exp, err := e.signer.UploadURL(id, path, max, overwrite)
	if err != nil {
		t.Fatal(err)
	}
	if !exp.Equal(e.clock().Add(DefaultUploadTTL)) {
		t.Fatalf("exp %v", exp)
	}
	return strings.TrimPrefix(u, "https://files.example.com")
}

// put sends body to target; a body that is not a *bytes.Reader goes
// chunked, with no length announced.
func (e *env) put(t *testing.T, target string, body io.Reader) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, e.srv.URL+target, body)
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
	if resp.Header.Get("Content-Type") == "application/json" {
		if err := json.Unmarshal(raw, &out); err != nil {
			t.Fatalf("PUT %d: body %q is not JSON", resp.StatusCode, raw)
		}
	}
	return resp.StatusCode, out
}

// onlyReader hides a reader's other methods, so the client sends it
// chunked and the server cannot know its length in advance.
type onlyReader struct{ io.Reader }

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

// leftovers lists every entry under dir (relative paths).
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && p != dir {
			rel, _ := filepath.Rel(dir, p)
			out = append(out, rel)
		}
		return nil
	})
	slices.Sort(out)
	return out
}

func TestUploadRoundTrip(t *testing.T) {
	e, a := uploadEnv(t)
	dir := e.ws(t, idA)
	data := randomBytes(t, 20<<20+12345)
	sum := sha256.Sum256(data)

	// Streamed with no length, into a directory that does not exist yet.
	code, out := e.put(t, e.uploadTarget(t, idA, "in/big.bin", 32<<20, false), onlyReader{bytes.NewReader(data)})
	if code != http.StatusCreated || out["size"] != float64(len(data)) || out["sha256"] != hex.EncodeToString(sum[:]) ||
		out["path"] != "in/big.bin" || out["replaced"] != false {
		t.Fatalf("PUT: %d %v", code, out)
	}
	got, err := os.ReadFile(filepath.Join(dir, "in/big.bin"))
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("stored file differs (%d bytes, %v)", len(got), err)
	}
	if l := leftovers(t, dir); !slices.Equal(l, []string{"in", "in/big.bin"}) {
		t.Fatalf("workspace holds %v", l)
	}
	// Given to the workspace's owner, as the sandbox user must be able to
	// change it.
	var dst, fst syscall.Stat_t
	if err := syscall.Stat(dir, &dst); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(filepath.Join(dir, "in/big.bin"), &fst); err != nil {
		t.Fatal(err)
	}
	if fst.Uid != dst.Uid || fst.Gid != dst.Gid || fst.Mode&0o777 != uint32(workspace.FileMode) {
		t.Errorf("file %d:%d %o, workspace %d:%d", fst.Uid, fst.Gid, fst.Mode&0o777, dst.Uid, dst.Gid)
	}

	// The same link again: the file exists and the link may not overwrite.
	code, out = e.put(t, e.uploadTarget(t, idA, "in/big.bin", 32<<20, false), bytes.NewReader([]byte("other")))
	if code != http.StatusConflict || out["error"] != "FILE_EXISTS" {
		t.Fatalf("second PUT: %d %v", code, out)
	}
	// A link that may overwrite replaces it.
	code, out = e.put(t, e.uploadTarget(t, idA, "in/big.bin", 10, true), bytes.NewReader([]byte("other")))
	if code != http.StatusOK || out["replaced"] != true || out["size"] != float64(5) {
		t.Fatalf("overwrite: %d %v", code, out)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "in/big.bin")); string(got) != "other" {
		t.Fatalf("after overwrite: %q", got)
	}
	// An empty body is an empty file.
	if code, out = e.put(t, e.uploadTarget(t, idA, "empty", 10, false), bytes.NewReader(nil)); code != http.StatusCreated {
		t.Fatalf("empty: %d %v", code, out)
	}

	// Every verified upload was audited before and after.
	res, errs := a.ends()
	if len(a.begun) != 4 || len(res) != 4 {
		t.Fatalf("audit: %d begun, %d ended", len(a.begun), len(res))
	}
	if b := a.begun[0]; b.WorkspaceID != idA || b.Path != "in/big.bin" || b.MaxBytes != 32<<20 || b.Overwrite {
		t.Errorf("audited %+v", b)
	}
	if errs[0] != nil || res[0].SHA256 != hex.EncodeToString(sum[:]) || brokererr.CodeOf(errs[1]) != brokererr.FileExists {
		t.Errorf("audit outcomes: %v %v", res, errs)
	}
}

// TestUploadLinksAreTheirOwnKind: download links never upload, upload
// links never download, and any change to an upload link refuses it
// before its body is read.
func TestUploadLinksAreTheirOwnKind(t *testing.T) {
	e, a := uploadEnv(t)
	dir := e.ws(t, idA)
	writeFile(t, filepath.Join(dir, "x.txt"), "keep")
	up := e.uploadTarget(t, idA, "new.txt", 100, true)
	if s := status(t, e.srv.URL, up); s != http.StatusForbidden {
		t.Errorf("GET with an upload link: %d", s)
	}
	if resp, _ := raw(t, e.srv.URL, "HEAD", up); resp.StatusCode != http.StatusForbidden {
		t.Errorf("HEAD with an upload link: %d", resp.StatusCode)
	}
	down := e.target(t, idA, "x.txt")
	if code, _ := e.put(t, down, strings.NewReader("overwritten")); code != http.StatusForbidden {
		t.Errorf("PUT with a download link: %d", code)
	}
	// A download link with the upload parameters added is still refused.
	if code, _ := e.put(t, down+"&max=100&ow=1", strings.NewReader("overwritten")); code != http.StatusForbidden {
		t.Errorf("PUT with a download link and upload parameters: %d", code)
	}

	p, q, _ := strings.Cut(up, "?")
	v, _ := url.ParseQuery(q)
	with := func(k, val string) string {
		w := url.Values{}
		for kk, vv := range v {
			w[kk] = slices.Clone(vv)
		}
		if val == "" {
			w.Del(k)
		} else {
			w.Set(k, val)
		}
		return p + "?" + w.Encode()
	}
	bad := map[string]string{
		"bigger max":       with("max", "1000000"),
		"ow flipped":       with("ow", "0"),
		"ow spelled true":  with("ow", "true"),
		"max with zero":    with("max", "0100"),
		"max zero":         with("max", "0"),
		"no max":           with("max", ""),
		"no ow":            with("ow", ""),
		"expired":          with("exp", fmt.Sprint(t0.Add(-time.Second).Unix())),
		"download TTL":     with("exp", fmt.Sprint(t0.Add(DefaultTTL).Unix())),
		"tampered sig":     with("sig", strings.Repeat("A", sigLen)),
		"other workspace":  strings.Replace(up, idA, idB, 1),
		"other path":       strings.Replace(up, "new.txt", "x.txt", 1),
		"traversal":        strings.Replace(up, "new.txt", "../new.txt", 1),
		"encoded dots":     strings.Replace(up, "new.txt", "%2e%2e/new.txt", 1),
		"encoded slash":    strings.Replace(up, "new.txt", "a%2Fnew.txt", 1),
		"double slash":     strings.Replace(up, "/new.txt", "//new.txt", 1),
		"extra parameter":  up + "&x=1",
		"repeated max":     up + "&max=100",
		"absolute":         strings.Replace(up, idA+"/new.txt", idA+"//etc/passwd", 1),
		"preview-like sig": strings.Replace(up, "/files/", "/preview/", 1),
	}
	for name, tg := range bad {
		code, _ := e.put(t, tg, strings.NewReader("evil"))
		if code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, code)
		}
	}
	if l := leftovers(t, dir); !slices.Equal(l, []string{"x.txt"}) {
		t.Fatalf("workspace holds %v", l)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "x.txt")); string(got) != "keep" {
		t.Fatalf("x.txt = %q", got)
	}
	if len(a.begun) != 0 {
		t.Fatalf("refused links were audited as uploads: %v", a.begun)
	}

	// A refused upload is answered without reading its body: the client's
	// "Expect: 100-continue" never gets a 100.
	c, err := net.Dial("tcp", strings.TrimPrefix(e.srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "PUT %s HTTP/1.1\r\nHost: files.example.com\r\nContent-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n", with("sig", strings.Repeat("A", sigLen)))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusForbidden || !resp.Close {
		t.Fatalf("refused PUT: %d, connection close %v", resp.StatusCode, resp.Close)
	}
}

// TestUploadStopsAtTheQuota: an upload that would take the workspace past
// its quota is refused while it streams (not after), and leaves nothing.
func TestUploadStopsAtTheQuota(t *testing.T) {
	e, a := uploadEnv(t)
	dir := e.ws(t, idA)
	e.handler.Limits = workspace.Limits{MaxFiles: 10, MaxBytes: 8 << 20}
	writeFile(t, filepath.Join(dir, "old.bin"), strings.Repeat("x", 3<<20))

	// The client streams 256 MiB through a pipe; the server must answer
	// long before it has all of it, while the client is still sending.
	const total = 256 << 20
	pr, pw := io.Pipe()
	var sent atomic.Int64
	go func() {
		chunk := make([]byte, 64<<10)
		for sent.Load() < total {
			n, err := pw.Write(chunk)
			sent.Add(int64(n))
			if err != nil {
				return
			}
		}
		pw.Close()
	}()
	req, _ := http.NewRequest(http.MethodPut, e.srv.URL+e.uploadTarget(t, idA, "deep/er/big.bin", 1<<30, false), onlyReader{pr})
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	atAnswer := sent.Load()
	var out map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	pr.CloseWithError(errors.New("test done"))
	if resp.StatusCode != http.StatusRequestEntityTooLarge || out["error"] != "QUOTA_EXCEEDED" {
		t.Fatalf("over quota: %d %v", resp.StatusCode, out)
	}
	if atAnswer >= total {
		t.Errorf("answered only after the whole body was sent")
	}
	if l := leftovers(t, dir); !slices.Equal(l, []string{"old.bin"}) {
		t.Fatalf("workspace holds %v after a refused upload", l)
	}
	// Within the quota it fits: 3 MiB + 5 MiB.
	code, out := e.put(t, e.uploadTarget(t, idA, "fits.bin", 1<<30, false), onlyReader{bytes.NewReader(make([]byte, 5<<20))})
	if code != http.StatusCreated {
		t.Fatalf("within quota: %d %v", code, out)
	}
	// The file count is a quota too: 10 entries at most.
	for i := range 7 {
		writeFile(t, filepath.Join(dir, fmt.Sprintf("f%d", i)), "")
	}
	code, out = e.put(t, e.uploadTarget(t, idA, "one-too-many", 10, false), strings.NewReader("x"))
	if code != http.StatusRequestEntityTooLarge || out["error"] != "QUOTA_EXCEEDED" {
		t.Fatalf("file count: %d %v", code, out)
	}
	_, errs := a.ends()
	if len(errs) != 3 || brokererr.CodeOf(errs[0]) != brokererr.QuotaExceeded || errs[1] != nil {
		t.Fatalf("audited outcomes %v", errs)
	}
}

// TestUploadSizeCaps: the link's max and the handler's cap both hold, for
// announced lengths (refused before reading) and chunked bodies (refused
// at the first byte over).
func TestUploadSizeCaps(t *testing.T) {
	e, _ := uploadEnv(t)
	dir := e.ws(t, idA)
	e.handler.MaxFileBytes = 1 << 20
	for name, c := range map[string]struct {
		max  int64
		body io.Reader
	}{
		"announced over max":   {100, bytes.NewReader(make([]byte, 101))},
		"chunked over max":     {100, onlyReader{bytes.NewReader(make([]byte, 101))}},
		"announced over cap":   {10 << 20, bytes.NewReader(make([]byte, 1<<20+1))},
		"chunked over the cap": {10 << 20, onlyReader{bytes.NewReader(make([]byte, 2<<20))}},
	} {
		code, out := e.put(t, e.uploadTarget(t, idA, "f.bin", c.max, false), c.body)
		if code != http.StatusRequestEntityTooLarge || out["error"] != "FILE_SIZE_EXCEEDED" {
			t.Errorf("%s: %d %v", name, code, out)
		}
	}
	if code, _ := e.put(t, e.uploadTarget(t, idA, "f.bin", 100, false), bytes.NewReader(make([]byte, 100))); code != http.StatusCreated {
		t.Errorf("exactly max: %d", code)
	}
	if l := leftovers(t, dir); !slices.Equal(l, []string{"f.bin"}) {
		t.Fatalf("workspace holds %v", l)
	}
}

// TestUploadNeverWritesThroughLinks: symlinked parents and targets, and
// special files, are refused; nothing lands outside the workspace.
func TestUploadNeverWritesThroughLinks(t *testing.T) {
	e, _ := uploadEnv(t)
	dir := e.ws(t, idA)
	outside := t.TempDir()
	if err := os.Symlink(outside, filepath.Join(dir, "out")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(outside, "target"), filepath.Join(dir, "link.txt")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path string
		code int
	}{
		{"out/escaped.txt", http.StatusForbidden},
		{"link.txt", http.StatusForbidden},
		{"fifo", http.StatusConflict},
	} {
		code, out := e.put(t, e.uploadTarget(t, idA, c.path, 100, true), strings.NewReader("evil"))
		if code != c.code {
			t.Errorf("%s: %d %v, want %d", c.path, code, out, c.code)
		}
	}
	if l := leftovers(t, outside); len(l) != 0 {
		t.Fatalf("written outside the workspace: %v", l)
	}
	// A workspace that does not exist takes nothing.
	code, _ := e.put(t, e.uploadTarget(t, idB, "x", 100, false), strings.NewReader("x"))
	if code != http.StatusNotFound {
		t.Errorf("missing workspace: %d", code)
	}
}

// TestUploadAuditComesFirst: no audit, no upload.
func TestUploadAuditComesFirst(t *testing.T) {
	e, a := uploadEnv(t)
	dir := e.ws(t, idA)
	for name, c := range map[string]struct {
		fail error
		code int
	}{
		"audit log down":      {errors.New("disk full"), http.StatusServiceUnavailable},
		"no owning session":   {brokererr.New(brokererr.SandboxNotFound, "no session"), http.StatusNotFound},
		"session store error": {brokererr.New(brokererr.Unavailable, "db"), http.StatusServiceUnavailable},
	} {
		a.fail = c.fail
		if code, out := e.put(t, e.uploadTarget(t, idA, "x.txt", 100, false), strings.NewReader("x")); code != c.code {
			t.Errorf("%s: %d %v, want %d", name, code, out, c.code)
		}
	}
	e.handler.Audit = nil
	if code, _ := e.put(t, e.uploadTarget(t, idA, "x.txt", 100, false), strings.NewReader("x")); code != http.StatusServiceUnavailable {
		t.Errorf("no auditor: %d", code)
	}
	if l := leftovers(t, dir); len(l) != 0 {
		t.Fatalf("unaudited uploads wrote %v", l)
	}
}

// rawPut starts a PUT of length bytes on its own connection and sends the
// first part of the body; the caller sends the rest or stalls.
func rawPut(t *testing.T, srvURL, target string, length int, first []byte) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(srvURL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(c, "PUT %s HTTP/1.1\r\nHost: files.example.com\r\nContent-Length: %d\r\n\r\n", target, length)
	if _, err := c.Write(first); err != nil {
		t.Fatal(err)
	}
	return c, bufio.NewReader(c)
}

// TestUploadMinimumRate: a body may take longer than the grace period as
// long as it keeps the minimum rate; one that stalls is cut off (408) and
// leaves nothing.
func TestUploadMinimumRate(t *testing.T) {
	e, _ := uploadEnv(t)
	dir := e.ws(t, idA)
	e.handler.UploadGrace = 300 * time.Millisecond
	e.handler.UploadMinRate = 100 << 10

	// 4 × 100 KiB, one every 400 ms: 1.2 s in all, four times the grace,
	// but ahead of the rate (byte n is due by 0.3 s + n/100 KiB s).
	chunk := bytes.Repeat([]byte("a"), 100<<10)
	c, br := rawPut(t, e.srv.URL, e.uploadTarget(t, idA, "steady.bin", 1<<20, false), 4*len(chunk), chunk)
	for range 3 {
		time.Sleep(400 * time.Millisecond) // pacing the client, not waiting for the server
		if _, err := c.Write(chunk); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("steady upload: %d", resp.StatusCode)
	}

	// 1 KiB, then nothing: cut off once the grace and the 10 ms the KiB
	// earned are over.
	start := time.Now()
	_, br = rawPut(t, e.srv.URL, e.uploadTarget(t, idA, "stalled.bin", 1<<20, false), 1<<20, make([]byte, 1<<10))
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(body), "too slowly") {
		t.Fatalf("stalled upload: %d %s", resp.StatusCode, body)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("cut off after %v, before the grace period", d)
	}
	if l := leftovers(t, dir); !slices.Equal(l, []string{"steady.bin"}) {
		t.Fatalf("workspace holds %v", l)
	}
}

// TestUploadsPerWorkspaceAreCapped: past MaxUploadsPerWorkspace running
// uploads into one workspace, more get 429; other workspaces are not held
// up.
func TestUploadsPerWorkspaceAreCapped(t *testing.T) {
	e, _ := uploadEnv(t)
	dirA := e.ws(t, idA)
	e.ws(t, idB)
	var conns []net.Conn
	var readers []*bufio.Reader
	for i := range MaxUploadsPerWorkspace {
		c, br := rawPut(t, e.srv.URL, e.uploadTarget(t, idA, fmt.Sprintf("u%d", i), 100, false), 2, []byte("a"))
		conns, readers = append(conns, c), append(readers, br)
	}
	// The held uploads have started once their temporary files exist.
	deadline := time.Now().Add(10 * time.Second)
	for len(leftovers(t, dirA)) < MaxUploadsPerWorkspace && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	code, out := e.put(t, e.uploadTarget(t, idA, "one-more", 100, false), strings.NewReader("x"))
	if code != http.StatusTooManyRequests || out["error"] != "RATE_LIMIT_EXCEEDED" {
		t.Fatalf("fifth upload: %d %v", code, out)
	}
	if code, _ := e.put(t, e.uploadTarget(t, idB, "elsewhere", 100, false), strings.NewReader("x")); code != http.StatusCreated {
		t.Fatalf("other workspace: %d", code)
	}
	for i, c := range conns {
		if _, err := c.Write([]byte("b")); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(readers[i], nil)
		if err != nil || resp.StatusCode != http.StatusCreated {
			t.Fatalf("held upload %d: %v %v", i, resp, err)
		}
	}
	if code, _ := e.put(t, e.uploadTarget(t, idA, "one-more", 100, false), strings.NewReader("x")); code != http.StatusCreated {
		t.Fatalf("after the others finished: %d", code)
	}
}

// FuzzVerifyUpload mutates upload links: nothing panics, nothing verifies
// but the exact links signed (parameters may only be reordered), and
// download and upload links never verify as each other.
func FuzzVerifyUpload(f *testing.F) {
	keys, _ := NewKeyring(master(1), master(2))
	s := &Signer{Keys: keys, BaseURL: "https://f.example", Now: func() time.Time { return t0 }}
	type signed struct{ path, query string }
	var uploads, downloads []signed
	for _, c := range []struct {
		p   string
		max int64
		ow  bool
	}{{"out/data.csv", 100, false}, {"é x.txt", 1 << 30, true}} {
		u, _, err := s.UploadURL(idA, c.p, c.max, c.ow)
		if err != nil {
			f.Fatal(err)
		}
		pu, _ := url.Parse(u)
		uploads = append(uploads, signed{pu.EscapedPath(), pu.RawQuery})
		f.Add(pu.EscapedPath(), pu.RawQuery)
		f.Add(pu.EscapedPath(), strings.Replace(pu.RawQuery, "ow=0", "ow=1", 1))
		d, _, _ := s.URL(idA, c.p)
		pd, _ := url.Parse(d)
		downloads = append(downloads, signed{pd.EscapedPath(), pd.RawQuery})
		f.Add(pd.EscapedPath(), pd.RawQuery)
		f.Add(pd.EscapedPath(), pd.RawQuery+"&max=100&ow=0")
	}
	f.Add("/files/"+idA+"/%2e%2e/x", "exp=1&kid=a&max=1&ow=1&sig=b")
	paramSet := func(q string) []string {
		ps := strings.Split(q, "&")
		slices.Sort(ps)
		return ps
	}
	isOneOf := func(p, q string, set []signed) bool {
		for _, v := range set {
			if p == v.path && slices.Equal(paramSet(q), paramSet(v.query)) {
				return true
			}
		}
		return false
	}
	f.Fuzz(func(t *testing.T, p, q string) {
		if u, err := s.VerifyUpload(p, q); err == nil && !isOneOf(p, q, uploads) {
			t.Fatalf("VerifyUpload accepted %q ? %q -> %+v", p, q, u)
		}
		if tg, err := s.Verify(p, q); err == nil && !isOneOf(p, q, downloads) {
			t.Fatalf("Verify accepted %q ? %q -> %+v", p, q, tg)
		}
		if _, err := s.VerifyPreview(idA, q); err == nil {
			t.Fatalf("VerifyPreview accepted file link query %q", q)
		}
	})
}

// TestRefusedUploadAnswerArrives: a verified upload refused mid-stream
// lingers on its body (bounded) instead of closing on a client that is
// still sending: closing with unread data resets the connection, and a
// client whose write fails first (net/http's does) never sees the answer.
func TestRefusedUploadAnswerArrives(t *testing.T) {
	e, _ := uploadEnv(t)
	e.ws(t, idA)
	e.handler.Limits = workspace.Limits{MaxFiles: 10, MaxBytes: 4 << 20}
	c, br := rawPut(t, e.srv.URL, e.uploadTarget(t, idA, "big.bin", 1<<30, false), 64<<20, nil)
	wrote := make(chan error, 1)
	go func() { // past the quota, short of what was announced
		chunk := make([]byte, 64<<10)
		for range (12 << 20) / len(chunk) {
			if _, err := c.Write(chunk); err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	}()
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("answer: %v %v", resp, err)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("the client could not finish sending after the answer: %v", err)
	}
}
