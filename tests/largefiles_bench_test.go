package tests

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// benchFileBytes is the size of the file BenchmarkSignedFiles moves.
const benchFileBytes = 256 << 20

// BenchmarkSignedFiles measures signed downloads and uploads of a 256 MiB
// file through the broker over loopback HTTP, in MB/s at the p50 time,
// beside same-run baselines with the same client (curl): Go's
// http.FileServer serving the same file (sendfile), and a bare Go server
// that streams a PUT body to a synced temporary file and renames it; and
// reading the file from the page cache.
// Run with a fixed count: go test -run '^$' -bench BenchmarkSignedFiles -benchtime 8x ./tests/
func BenchmarkSignedFiles(b *testing.B) {
	requireDocker(b)
	if _, err := exec.LookPath("curl"); err != nil {
		b.Fatal("curl is needed as the common client")
	}
	broker := StartHTTP(b, BrokerOpts{Token: testToken, Env: map[string]string{
		"SANDBOX_POOL_SIZE": "0", "RATE_LIMIT_PER_MINUTE": "100000", "SANDBOX_MAX_WORKSPACE_MB": "1024"}})
	c := broker.Client(b, testToken)
	src := filepath.Join(b.TempDir(), "src.bin")
	data := make([]byte, benchFileBytes)
	_, _ = rand.Read(data)
	if err := os.WriteFile(src, data, 0o644); err != nil {
		b.Fatal(err)
	}
	up := createUploadURL(b, c, map[string]any{"path": "bench.bin", "overwrite": true})
	curl := func(b *testing.B, args ...string) string {
		out, err := exec.Command("curl", append([]string{"-sS", "-o", "/dev/null", "-w", "%{http_code} %{size_download} %{size_upload}"}, args...)...).CombinedOutput()
		if err != nil {
			b.Fatalf("curl %v: %v %s", args, err, out)
		}
		return string(out)
	}
	upload := func(b *testing.B, u string) time.Duration {
		return timed(func() {
			if out := curl(b, "-T", src, u); !strings.HasPrefix(out, "20") || !strings.HasSuffix(out, fmt.Sprint(benchFileBytes)) {
				b.Fatalf("PUT: %s", out)
			}
		})
	}
	download := func(b *testing.B, u string) time.Duration {
		return timed(func() {
			if out := curl(b, u); out != fmt.Sprintf("200 %d 0", benchFileBytes) {
				b.Fatalf("GET: %s", out)
			}
		})
	}
	upload(b, up.URL)
	var ra struct {
		URL string `json:"url"`
	}
	resultJSON(b, callTool(b, c, "read_artifact", map[string]any{"session_id": up.SessionID, "path": "bench.bin", "max_bytes": 1}), &ra)
	if ra.URL == "" {
		b.Fatal("no download link")
	}
	wid := strings.SplitN(strings.SplitN(ra.URL, "/files/", 2)[1], "/", 2)[0]
	dir := filepath.Join(broker.Root, "workspaces", wid)
	if got, err := os.ReadFile(filepath.Join(dir, "bench.bin")); err != nil || !bytes.Equal(got, data) {
		b.Fatalf("uploaded file differs: %v", err)
	}
	fileServer := httptest.NewServer(http.FileServer(http.Dir(dir)))
	defer fileServer.Close()
	sink := b.TempDir()
	plainPut := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f, err := os.CreateTemp(sink, ".up-*")
		if err == nil {
			_, err = io.Copy(f, r.Body)
		}
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = os.Rename(f.Name(), filepath.Join(sink, "bench.bin"))
		}
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer plainPut.Close()

	cases := []struct {
		name string
		call func(b *testing.B) time.Duration
	}{
		{"broker_signed_download", func(b *testing.B) time.Duration { return download(b, ra.URL) }},
		{"baseline_go_fileserver_download", func(b *testing.B) time.Duration { return download(b, fileServer.URL+"/bench.bin") }},
		{"baseline_page_cache_read", func(b *testing.B) time.Duration {
			return timed(func() {
				f, err := os.Open(filepath.Join(dir, "bench.bin"))
				if err != nil {
					b.Fatal(err)
				}
				n, err := io.Copy(io.Discard, struct{ io.Reader }{f})
				f.Close()
				if err != nil || n != benchFileBytes {
					b.Fatalf("read: %d %v", n, err)
				}
			})
		}},
		{"broker_signed_upload", func(b *testing.B) time.Duration { return upload(b, up.URL) }},
		{"baseline_go_put_to_synced_file", func(b *testing.B) time.Duration { return upload(b, plainPut.URL) }},
	}
	mbps := map[string]float64{}
	for _, cs := range cases {
		b.Run(cs.name, func(b *testing.B) {
			lat := make([]time.Duration, 0, b.N)
			for i := 0; i < b.N; i++ {
				lat = append(lat, cs.call(b))
			}
			q50, q95 := percentile(lat, 50), percentile(lat, 95)
			mbps[cs.name] = float64(benchFileBytes) / 1e6 / q50.Seconds()
			b.ReportMetric(mbps[cs.name], "MB/s")
			b.ReportMetric(ms(q50), "p50-ms")
			b.ReportMetric(ms(q95), "p95-ms")
			b.ReportMetric(0, "ns/op")
		})
	}
	if mbps["broker_signed_download"] > 0 && mbps["baseline_go_fileserver_download"] > 0 {
		fmt.Printf("summary: 256 MiB signed download %.0f MB/s vs Go http.FileServer %.0f MB/s (%.2fx) and page-cache read %.0f MB/s; signed upload %.0f MB/s vs a bare Go PUT-to-synced-file server %.0f MB/s (%.2fx); client curl, p50\n",
			mbps["broker_signed_download"], mbps["baseline_go_fileserver_download"], mbps["broker_signed_download"]/mbps["baseline_go_fileserver_download"],
			mbps["baseline_page_cache_read"], mbps["broker_signed_upload"], mbps["baseline_go_put_to_synced_file"],
			mbps["broker_signed_upload"]/mbps["baseline_go_put_to_synced_file"])
	}
}
