package tests

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// requireDocker fails in CI and skips elsewhere when the daemon or the
// runner images are missing: CI must never report a skipped engine as a pass.
func requireDocker(t testing.TB) {
	t.Helper()
	miss := func(what string) {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s (required in CI: .ci/run installs Docker and builds the runners)", what)
		}
		t.Skipf("%s; run `make runners` with a Docker daemon to enable", what)
	}
	if err := exec.Command("docker", "info").Run(); err != nil {
		miss("no Docker daemon")
	}
	for _, lang := range []string{"python", "typescript", "bash"} {
		if err := exec.Command("docker", "image", "inspect", "sandbox-broker/runner-"+lang+":latest").Run(); err != nil {
			miss("runner image for " + lang + " is missing")
		}
	}
}

// forRuntimes runs fn once per OCI runtime (SANDBOX_RUNTIME): runc, and
// runsc (gVisor) when the daemon has it registered. CI must have it
// (.ci/run builds and registers it): there a missing runsc fails.
func forRuntimes(t *testing.T, fn func(t *testing.T, runtime string)) {
	t.Run("runc", func(t *testing.T) { fn(t, "runc") })
	t.Run("runsc", func(t *testing.T) {
		requireRunsc(t)
		fn(t, "runsc")
	})
}

func requireRunsc(t testing.TB) {
	t.Helper()
	requireDocker(t)
	if !haveRunsc(t) {
		t.Skip("runsc (gVisor) is not registered with the Docker daemon")
	}
}

// haveRunsc reports whether the daemon has runsc registered; in CI it
// must (.ci/run builds gVisor and registers it).
func haveRunsc(t testing.TB) bool {
	t.Helper()
	out, err := exec.Command("docker", "info", "--format", `{{json (index .Runtimes "runsc")}}`).Output()
	ok := err == nil && strings.Contains(string(out), "runsc")
	if !ok && os.Getenv("CI") == "true" {
		t.Fatalf("the Docker daemon has no runsc runtime (required in CI: .ci/run builds gVisor and registers it): %v %s", err, out)
	}
	return ok
}

type runResult struct {
	SessionID string `json:"session_id"`
	Success   bool   `json:"success"`
	ExitCode  int    `json:"exit_code"`
	Stdout    string `json:"stdout"`
	Stderr    string `json:"stderr"`
	Output    string `json:"output"`
	TimedOut  bool   `json:"timed_out"`
	OOMKilled bool   `json:"oom_killed"`
	Truncated bool   `json:"truncated"`
	Files     []struct {
		Name string `json:"name"`
		Size int64  `json:"size"`
		MIME string `json:"mime"`
		URL  string `json:"url"`
	} `json:"files"`
}

func run(t *testing.T, c *client.Client, args map[string]any) (runResult, *mcp.CallToolResult) {
	t.Helper()
	res := callTool(t, c, "run_code", args)
	if res.IsError {
		var e toolError
		resultJSON(t, res, &e)
		t.Fatalf("run_code failed: %+v", e)
	}
	var r runResult
	resultJSON(t, res, &r)
	return r, res
}

func engineBroker(t *testing.T, extra map[string]string) *Broker {
	t.Helper()
	requireDocker(t)
	env := map[string]string{"SANDBOX_POOL_SIZE": "1"}
	for k, v := range extra {
		env[k] = v
	}
	return StartHTTP(t, BrokerOpts{Token: testToken, Env: env})
}

func TestRunCodePlainAndStatePersists(t *testing.T) { forRuntimes(t, testRunCodePlainAndStatePersists) }

func testRunCodePlainAndStatePersists(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "python", "code": "print(6*7)\nopen('note.txt','w').write('kept')"})
	if !r.Success || r.ExitCode != 0 || strings.TrimSpace(r.Stdout) != "42" || !regexp.MustCompile(`^sess_[0-9a-f]{12}$`).MatchString(r.SessionID) {
		t.Fatalf("plain run: %+v", r)
	}
	if len(r.Files) != 1 || r.Files[0].Name != "note.txt" || r.Files[0].URL == "" {
		t.Fatalf("files: %+v", r.Files)
	}
	// Same session, other languages: the workspace is shared and persists.
	r2, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "bash", "code": "cat note.txt; ls /data/note.txt; pwd"})
	if !strings.Contains(r2.Stdout, "kept") || !strings.Contains(r2.Stdout, "/mnt/data") {
		t.Fatalf("bash in same session: %+v", r2)
	}
	r3, _ := run(t, c, map[string]any{"conversationId": r.SessionID, "language": "typescript",
		"code": "import { readFileSync } from 'fs';\nconst s: string = readFileSync('note.txt', 'utf8');\nconsole.log(s.length);"})
	if strings.TrimSpace(r3.Stdout) != "4" {
		t.Fatalf("typescript: %+v", r3)
	}
	// Errors come back as results with output, not as tool errors.
	r4, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "python", "code": "import sys\nprint('out')\nraise ValueError('boom')"})
	if r4.Success || r4.ExitCode != 1 || !strings.Contains(r4.Stderr, "ValueError: boom") || !strings.Contains(r4.Output, "out") {
		t.Fatalf("failing run: %+v", r4)
	}
	e := mustToolError(t, callTool(t, c, "run_code", map[string]any{"language": "cobol", "code": "x"}), "UNKNOWN_LANGUAGE")
	if !strings.Contains(e.Message, "python") {
		t.Fatalf("unknown language message lacks the list: %q", e.Message)
	}
}

func TestOutputIsCappedAndEscapesStripped(t *testing.T) {
	b := engineBroker(t, nil)
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "python", "code": "import sys\nprint('\\x1b[31mred\\x1b[0m \\x1b]0;title\\x07ok')\nsys.stdout.write('x' * 5_000_000)"})
	if !r.Truncated || len(r.Stdout) > 40<<10 || strings.Contains(r.Stdout, "\x1b") || !strings.Contains(r.Stdout, "red ok") {
		t.Fatalf("cap/escapes: truncated=%v len=%d head=%q", r.Truncated, len(r.Stdout), r.Stdout[:min(80, len(r.Stdout))])
	}
}

func TestTimeoutKillsWholeTree(t *testing.T) { forRuntimes(t, testTimeoutKillsWholeTree) }

func testTimeoutKillsWholeTree(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	start := time.Now()
	r, _ := run(t, c, map[string]any{"language": "python", "timeout_s": 2,
		"code": "import os, subprocess\nsubprocess.Popen(['setsid','sleep','1000'])\nwhile True: pass"})
	if !r.TimedOut || r.Success || time.Since(start) > 30*time.Second {
		t.Fatalf("timeout: %+v after %v", r, time.Since(start))
	}
	// Nothing survives into the next run.
	r3, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "python",
		"code": "import os\nprint(sum(1 for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/comm').read().strip()=='sleep'))"})
	if strings.TrimSpace(r3.Stdout) != "0" {
		t.Fatalf("a background sleep survived the timeout: %+v", r3)
	}
}

func TestMemoryBombReportedAsOOM(t *testing.T) { forRuntimes(t, testMemoryBombReportedAsOOM) }

func testMemoryBombReportedAsOOM(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt, "SANDBOX_MEMORY_MB": "256"})
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "python", "code": "x = bytearray(2 << 30)\nprint('allocated')"})
	if !r.OOMKilled || r.Success || strings.Contains(r.Stdout, "allocated") {
		t.Fatalf("memory bomb: %+v", r)
	}
	r2, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "python", "code": "print('alive')"})
	if strings.TrimSpace(r2.Stdout) != "alive" {
		t.Fatalf("session unusable after OOM: %+v", r2)
	}
}

func TestForkBombContained(t *testing.T) { forRuntimes(t, testForkBombContained) }

func testForkBombContained(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	start := time.Now()
	r, _ := run(t, c, map[string]any{"language": "bash", "timeout_s": 10, "code": "bomb() { bomb | bomb & }; bomb; sleep 3; echo done"})
	if time.Since(start) > 40*time.Second {
		t.Fatalf("fork bomb run took %v", time.Since(start))
	}
	// No bomb process survives into the next run; the session stays usable.
	r2, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "python",
		"code": "import os\nprint(sorted(open(f'/proc/{p}/comm').read().strip() for p in os.listdir('/proc') if p.isdigit()))"})
	if strings.Contains(r2.Stdout, "bash") || !strings.Contains(r2.Stdout, "python3") {
		t.Fatalf("processes after the fork bomb: %+v", r2)
	}
	if res := callTool(t, c, "get_usage", nil); res.IsError {
		t.Fatal("broker not serving after fork bomb")
	}
}

func TestNoNetworkAndNoWritesOutsideWorkspace(t *testing.T) {
	forRuntimes(t, testNoNetworkAndNoWritesOutsideWorkspace)
}

func testNoNetworkAndNoWritesOutsideWorkspace(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	code := `
import socket, os
results = {}
for name, addr in [("public", ("1.1.1.1", 53)), ("metadata", ("169.254.169.254", 80)), ("host", ("172.17.0.1", 80))]:
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect(addr); results[name] = "connected"
    except OSError as e:
        results[name] = type(e).__name__
try:
    socket.getaddrinfo("example.com", 80); results["dns"] = "resolved"
except OSError as e:
    results["dns"] = type(e).__name__
for path in ["/etc/evil", "/usr/bin/evil", "/opt/sandbox/evil", "/mnt/evil"]:
    try:
        open(path, "w").write("x"); results[path] = "written"
    except OSError as e:
        results[path] = e.errno
print(results)
print(open("/proc/self/status").read().split("CapEff:")[1].split()[0], os.getuid())
`
	r, _ := run(t, c, map[string]any{"language": "python", "code": code})
	for _, bad := range []string{"connected", "resolved", "written"} {
		if strings.Contains(r.Stdout, bad) {
			t.Fatalf("sandbox escaped (%s): %s", bad, r.Stdout)
		}
	}
	// No capabilities, and a per-session uid from SANDBOX_UID's range.
	if !regexp.MustCompile(`0000000000000000 19\d{8}\n`).MatchString(r.Stdout) {
		t.Fatalf("capabilities/uid: %s %s", r.Stdout, r.Stderr)
	}
}

func TestSessionsAreInvisibleToOtherPrincipals(t *testing.T) {
	requireDocker(t)
	tokens, tok := writeTokens(t, map[string]string{"alice": "pro", "bob": "pro"})
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens}})
	alice, bob := b.Client(t, tok["alice"]), b.Client(t, tok["bob"])
	r, _ := run(t, alice, map[string]any{"session_id": "shared-name", "language": "bash", "code": "echo secret > alice.txt"})
	for _, call := range []struct {
		tool string
		args map[string]any
	}{
		{"list_artifacts", map[string]any{"session_id": r.SessionID}},
		{"read_artifact", map[string]any{"session_id": r.SessionID, "path": "alice.txt"}},
		{"close_session", map[string]any{"session_id": r.SessionID}},
		{"list_artifacts", map[string]any{"session_id": "never-existed"}},
	} {
		e := mustToolError(t, callTool(t, bob, call.tool, call.args), "SANDBOX_NOT_FOUND")
		if strings.Contains(e.Message, "alice") {
			t.Fatalf("%s hints at the owner: %q", call.tool, e.Message)
		}
	}
	// Bob naming the same ID gets a fresh session of his own.
	rb, _ := run(t, bob, map[string]any{"session_id": "shared-name", "language": "bash", "code": "ls; cat alice.txt 2>&1 || true"})
	if strings.Contains(rb.Stdout, "secret") {
		t.Fatalf("bob read alice's file: %q", rb.Stdout)
	}
	// Alice's session is intact.
	var list struct {
		Files []struct{ Name string } `json:"files"`
	}
	resultJSON(t, callTool(t, alice, "list_artifacts", map[string]any{"session_id": "shared-name"}), &list)
	if len(list.Files) != 1 || list.Files[0].Name != "alice.txt" {
		t.Fatalf("alice's files: %+v", list)
	}
}

func TestSignedURLs(t *testing.T) {
	b := engineBroker(t, nil)
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "bash", "code": "echo hello > report.txt; ln -s /etc/passwd passwd.txt; ln -s ../../../../etc/shadow up.txt; mkfifo pipe.txt"})
	var fileURL string
	for _, f := range r.Files {
		if f.Name == "report.txt" {
			fileURL = f.URL
		}
		if f.Name != "report.txt" {
			t.Errorf("non-regular file offered as an artifact: %+v", f)
		}
	}
	if fileURL == "" {
		t.Fatalf("no URL for report.txt: %+v", r.Files)
	}
	status := func(u string) (int, string) {
		resp := do(t, mustReq(t, u))
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := status(fileURL); code != 200 || body != "hello\n" {
		t.Fatalf("download: %d %q", code, body)
	}
	u, _ := url.Parse(fileURL)
	q := u.Query()
	mutate := func(f func(u *url.URL, q url.Values)) string {
		u2 := *u
		q2 := url.Values{}
		for k, v := range q {
			q2[k] = append([]string{}, v...)
		}
		f(&u2, q2)
		u2.RawQuery = q2.Encode()
		return u2.String()
	}
	bad := map[string]string{
		"tampered sig": mutate(func(_ *url.URL, q url.Values) {
			s := q.Get("sig")
			flip := "A"
			if s[0] == 'A' {
				flip = "B"
			}
			q.Set("sig", flip+s[1:])
		}),
		"expired":      mutate(func(_ *url.URL, q url.Values) { q.Set("exp", "1000000000") }),
		"extended exp": mutate(func(_ *url.URL, q url.Values) { q.Set("exp", fmt.Sprint(time.Now().Add(365*24*time.Hour).Unix())) }),
		"other path":   mutate(func(u *url.URL, _ url.Values) { u.Path = strings.Replace(u.Path, "report.txt", "passwd.txt", 1) }),
		"unknown kid":  mutate(func(_ *url.URL, q url.Values) { q.Set("kid", "deadbeef") }),
		"dup sig":      mutate(func(_ *url.URL, q url.Values) { q.Add("sig", q.Get("sig")) }),
		"no signature": mutate(func(_ *url.URL, q url.Values) { q.Del("sig") }),
		"traversal":    mutate(func(u *url.URL, _ url.Values) { u.Path = strings.Replace(u.Path, "report.txt", "../report.txt", 1) }),
	}
	for name, u := range bad {
		if code, _ := status(u); code != http.StatusForbidden {
			t.Errorf("%s: status %d, want 403", name, code)
		}
	}
	// A correctly signed link to a symlink or FIFO is still not served.
	for _, name := range []string{"passwd.txt", "up.txt", "pipe.txt"} {
		var res struct {
			URL string `json:"url"`
		}
		out := callTool(t, c, "read_artifact", map[string]any{"session_id": r.SessionID, "path": name})
		if !out.IsError {
			resultJSON(t, out, &res)
			t.Fatalf("read_artifact served %s: %+v", name, res)
		}
		mustToolError(t, out, "FILE_NOT_FOUND")
	}
	signed := signViaUpload(t, c, r.SessionID)
	for _, name := range []string{"passwd.txt", "up.txt", "pipe.txt"} {
		u := strings.Replace(signed, "placeholder.txt", name, 1)
		if code, body := status(u); code == 200 || strings.Contains(body, "root:") {
			t.Errorf("%s: status %d", name, code)
		}
	}
}

// signViaUpload gets a valid signed URL shape for the session.
func signViaUpload(t *testing.T, c *client.Client, session string) string {
	var up struct {
		URL string `json:"url"`
	}
	resultJSON(t, callTool(t, c, "upload_file", map[string]any{"session_id": session, "path": "placeholder.txt", "content": "x"}), &up)
	return up.URL
}

func mustReq(t *testing.T, u string) *http.Request {
	req, err := http.NewRequest(http.MethodGet, u, nil)
	if err != nil {
		t.Fatal(err)
	}
	return req
}

func TestUploadFileRules(t *testing.T) {
	b := engineBroker(t, nil)
	c := b.Client(t, testToken)
	var up struct {
		SessionID string `json:"session_id"`
		Size      int    `json:"size"`
	}
	resultJSON(t, callTool(t, c, "upload_file", map[string]any{"path": "data/in.bin", "content_base64": "AAEC/w=="}), &up)
	if up.Size != 4 {
		t.Fatalf("upload: %+v", up)
	}
	mustToolError(t, callTool(t, c, "upload_file", map[string]any{"session_id": up.SessionID, "path": "data/in.bin", "content": "again"}), "FILE_EXISTS")
	callTool(t, c, "upload_file", map[string]any{"session_id": up.SessionID, "path": "data/in.bin", "content": "again", "overwrite": true})
	for _, p := range []string{"../escape", "/etc/passwd", "a/../../b", "a\\b", ""} {
		res := callTool(t, c, "upload_file", map[string]any{"session_id": up.SessionID, "path": p, "content": "x"})
		if !res.IsError {
			t.Errorf("path %q accepted", p)
		}
	}
	big := strings.Repeat("A", 14<<20-100)
	mustToolError(t, callTool(t, c, "upload_file", map[string]any{"session_id": up.SessionID, "path": "big.bin", "content_base64": big}), "FILE_SIZE_EXCEEDED")
	r, _ := run(t, c, map[string]any{"session_id": up.SessionID, "language": "python", "code": "print(open('data/in.bin').read())"})
	if strings.TrimSpace(r.Stdout) != "again" {
		t.Fatalf("uploaded file not visible to code: %+v", r)
	}
}

// TestMarketingReportDemo is the spec's end-to-end demo: upload a CSV, chart
// it, build a PDF report, download the PDF through its signed URL.
func TestMarketingReportDemo(t *testing.T) { forRuntimes(t, testMarketingReportDemo) }

func testMarketingReportDemo(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	csv := "month,channel,spend,revenue\n"
	for m := 1; m <= 12; m++ {
		for i, ch := range []string{"search", "social", "email"} {
			csv += fmt.Sprintf("2026-%02d,%s,%d,%d\n", m, ch, 1000+m*100+i*50, 2500+m*180+i*90)
		}
	}
	var up struct {
		SessionID string `json:"session_id"`
	}
	resultJSON(t, callTool(t, c, "upload_file", map[string]any{"path": "marketing.csv", "content": csv}), &up)
	code := `
import pandas as pd, matplotlib.pyplot as plt, seaborn as sns
from reportlab.lib.pagesizes import A4
from reportlab.platypus import SimpleDocTemplate, Paragraph, Image, PageBreak, Table
from reportlab.lib.styles import getSampleStyleSheet
df = pd.read_csv("marketing.csv")
df["roi"] = df.revenue / df.spend
by = df.groupby("channel")[["spend", "revenue"]].sum()
ax = by.plot.bar(title="Spend and revenue by channel"); plt.tight_layout(); plt.savefig("by_channel.png"); plt.close()
sns.lineplot(data=df, x="month", y="roi", hue="channel"); plt.xticks(rotation=45); plt.tight_layout(); plt.savefig("roi.png"); plt.close()
styles = getSampleStyleSheet()
doc = SimpleDocTemplate("report.pdf", pagesize=A4)
doc.build([Paragraph("Marketing report", styles["Title"]), Image("by_channel.png", 400, 300), PageBreak(),
           Paragraph("ROI by month", styles["Heading1"]), Image("roi.png", 400, 300), PageBreak(),
           Table([["channel", "spend", "revenue"]] + [[i, int(r.spend), int(r.revenue)] for i, r in by.iterrows()])])
print(by.to_string())
`
	r, res := run(t, c, map[string]any{"session_id": up.SessionID, "language": "python", "code": code, "timeout_s": 120})
	if !r.Success {
		t.Fatalf("report run failed: %s\n%s", r.Stdout, r.Stderr)
	}
	images := 0
	for _, ct := range res.Content {
		if im, ok := ct.(mcp.ImageContent); ok && im.MIMEType == "image/png" {
			images++
		}
	}
	if images != 2 {
		t.Errorf("inline images = %d, want 2", images)
	}
	var pdfURL string
	for _, f := range r.Files {
		if f.Name == "report.pdf" {
			pdfURL = f.URL
			if f.MIME != "application/pdf" {
				t.Errorf("pdf mime = %s", f.MIME)
			}
		}
	}
	if pdfURL == "" {
		t.Fatalf("no report.pdf link: %+v", r.Files)
	}
	resp := do(t, mustReq(t, pdfURL))
	pdf, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !bytes.HasPrefix(pdf, []byte("%PDF-")) {
		t.Fatalf("pdf download: %d %q", resp.StatusCode, pdf[:min(16, len(pdf))])
	}
	if pages := len(regexp.MustCompile(`/Type\s*/Page[^s]`).FindAll(pdf, -1)); pages != 3 {
		t.Fatalf("pdf has %d pages, want 3", pages)
	}
	if resp.Header.Get("Content-Disposition") == "" || resp.Header.Get("X-Content-Type-Options") != "nosniff" {
		t.Errorf("download headers: %v", resp.Header)
	}
}

func containersLabelled(t *testing.T, filter string) []string {
	out, err := exec.Command("docker", "ps", "-aq", "--filter", "label="+filter).Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(out))
}

func TestCloseSessionLeavesNoContainer(t *testing.T) {
	b := engineBroker(t, map[string]string{"SANDBOX_POOL_SIZE": "0"})
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "python", "code": "print(1)"})
	if len(containersLabelled(t, "sandbox.root="+b.Root)) == 0 {
		t.Fatal("no container while the session is open")
	}
	resultJSON(t, callTool(t, c, "close_session", map[string]any{"session_id": r.SessionID}), &map[string]any{})
	if left := containersLabelled(t, "sandbox.root="+b.Root); len(left) != 0 {
		t.Fatalf("containers left after close_session: %v", left)
	}
	mustToolError(t, callTool(t, c, "list_artifacts", map[string]any{"session_id": r.SessionID}), "SANDBOX_NOT_FOUND")
}

func TestRestartKeepsWorkspaceAndSweepsOrphans(t *testing.T) {
	forRuntimes(t, testRestartKeepsWorkspaceAndSweepsOrphans)
}

func testRestartKeepsWorkspaceAndSweepsOrphans(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"session_id": "survivor", "language": "python", "code": "open('keep.txt','w').write('still here')"})
	if len(containersLabelled(t, "sandbox.root="+b.Root)) == 0 {
		t.Fatal("no containers before the crash")
	}
	// Crash: no clean shutdown, containers are orphaned.
	b.Kill()
	if len(containersLabelled(t, "sandbox.root="+b.Root)) == 0 {
		t.Fatal("test premise: SIGKILL should leave orphans")
	}
	b2 := StartHTTP(t, BrokerOpts{Root: b.Root, Token: testToken, Env: map[string]string{"SANDBOX_POOL_SIZE": "0"}})
	if left := containersLabelled(t, "sandbox.root="+b2.Root); len(left) != 0 {
		t.Fatalf("orphans not swept at start: %v", left)
	}
	c2 := b2.Client(t, testToken)
	r2, _ := run(t, c2, map[string]any{"session_id": r.SessionID, "language": "python", "code": "print(open('keep.txt').read())"})
	if strings.TrimSpace(r2.Stdout) != "still here" {
		t.Fatalf("workspace lost across restart: %+v", r2)
	}
	if _, err := os.Stat(filepath.Join(b.Root, "workspaces")); err != nil {
		t.Fatal(err)
	}
}

func TestWorkspaceQuotaEnforced(t *testing.T) { forRuntimes(t, testWorkspaceQuotaEnforced) }

func testWorkspaceQuotaEnforced(t *testing.T, rt string) {
	b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt, "SANDBOX_MAX_WORKSPACE_MB": "5", "SANDBOX_MAX_FILES": "50"})
	c := b.Client(t, testToken)
	r, _ := run(t, c, map[string]any{"language": "python", "code": "open('keep.txt','w').write('ok')"})
	cases := map[string]string{
		"bytes after the run": "for i in range(8): open(f'big{i}.bin','wb').write(b'x' * (1 << 20))",
		"files after the run": "import os\nos.makedirs('many', exist_ok=True)\nfor i in range(200): open(f'many/{i}','w').close()",
		"watcher mid-run":     "import time\ni = 0\nwhile True:\n    open(f'fill{i}.bin','wb').write(b'y' * (1 << 20)); i += 1; time.sleep(0.05)",
	}
	for name, code := range cases {
		res := callTool(t, c, "run_code", map[string]any{"session_id": r.SessionID, "language": "python", "code": code, "timeout_s": 30})
		// Retrying the same run would fill the workspace again.
		if e := mustToolError(t, res, "QUOTA_EXCEEDED"); e.Retryable {
			t.Errorf("%s: a full workspace is reported retryable", name)
		}
		var list struct {
			Files []struct{ Name string } `json:"files"`
		}
		resultJSON(t, callTool(t, c, "list_artifacts", map[string]any{"session_id": r.SessionID}), &list)
		if len(list.Files) != 1 || list.Files[0].Name != "keep.txt" {
			t.Fatalf("%s: files left after the quota stop: %+v", name, list.Files)
		}
	}
	r2, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "python", "code": "print(open('keep.txt').read())"})
	if strings.TrimSpace(r2.Stdout) != "ok" {
		t.Fatalf("session unusable after quota stops: %+v", r2)
	}
}

func TestReadArtifactAndListRunners(t *testing.T) {
	b := engineBroker(t, nil)
	c := b.Client(t, testToken)
	var runners struct {
		Backend string `json:"backend"`
		Runners []struct {
			Language string `json:"language"`
			Image    string `json:"image"`
		} `json:"runners"`
	}
	resultJSON(t, callTool(t, c, "list_runners", nil), &runners)
	var langs []string
	for _, r := range runners.Runners {
		langs = append(langs, r.Language+"="+r.Image)
	}
	if runners.Backend != "docker" || strings.Join(langs, ",") != "bash=sandbox-broker/runner-bash:latest,python=sandbox-broker/runner-python:latest,typescript=sandbox-broker/runner-typescript:latest" {
		t.Fatalf("list_runners: %+v", runners)
	}
	code := `
import matplotlib.pyplot as plt
plt.plot([1, 2, 3]); plt.savefig("plot.png")
open("notes.md", "w").write("# title\n" + "line\n" * 10)
open("blob.bin", "wb").write(bytes(range(256)))
`
	r, _ := run(t, c, map[string]any{"language": "python", "code": code})
	type readResult struct {
		Encoding      string `json:"encoding"`
		MIME          string `json:"mime"`
		Text          string `json:"text"`
		ContentBase64 string `json:"content_base64"`
		Size          int64  `json:"size"`
		Length        int    `json:"length"`
		EOF           bool   `json:"eof"`
		URL           string `json:"url"`
	}
	read := func(args map[string]any) (readResult, *mcp.CallToolResult) {
		args["session_id"] = r.SessionID
		res := callTool(t, c, "read_artifact", args)
		var out readResult
		resultJSON(t, res, &out)
		if res.IsError || out.URL == "" {
			t.Fatalf("read_artifact %v: %+v", args, out)
		}
		return out, res
	}
	txt, _ := read(map[string]any{"path": "notes.md"})
	if txt.Encoding != "text" || !strings.HasPrefix(txt.Text, "# title") || !txt.EOF {
		t.Errorf("text: %+v", txt)
	}
	part, _ := read(map[string]any{"path": "notes.md", "offset": 8, "max_bytes": 5})
	if part.Text != "line\n" || part.EOF || part.Length != 5 {
		t.Errorf("range read: %+v", part)
	}
	img, res := read(map[string]any{"path": "plot.png"})
	hasImage := false
	for _, ct := range res.Content {
		if im, ok := ct.(mcp.ImageContent); ok && im.MIMEType == "image/png" && len(im.Data) > 100 {
			hasImage = true
		}
	}
	if img.Encoding != "image" || !hasImage {
		t.Errorf("image: %+v", img)
	}
	bin, _ := read(map[string]any{"path": "blob.bin"})
	if bin.Encoding != "base64" || bin.Size != 256 || !strings.HasPrefix(bin.ContentBase64, "AAECAwQF") {
		t.Errorf("binary: %+v", bin)
	}
	mustToolError(t, callTool(t, c, "read_artifact", map[string]any{"session_id": r.SessionID, "path": "missing.txt"}), "FILE_NOT_FOUND")
	mustToolError(t, callTool(t, c, "read_artifact", map[string]any{"session_id": r.SessionID, "path": "../../etc/passwd"}), "PATH_TRAVERSAL")
}

// zombieLeaderProbe prints how many live threads the processes named
// zombieleader have: live threads only, as an unreaped zombie runs no
// code. gVisor lists no threads of a zombie leader; its num_threads counts
// them beside the leader.
const zombieLeaderProbe = `
import glob
def fields(d):
    return open(d + "/stat").read().rsplit(")", 1)[1].split()
live = 0
for d in glob.glob("/proc/[0-9]*"):
    try:
        if open(d + "/comm").read().strip() != "zombieleader":
            continue
        tasks = glob.glob(d + "/task/[0-9]*")
        if tasks:
            live += sum(fields(t)[0] not in "ZX" for t in tasks)
        elif fields(d)[0] in "ZX":
            live += int(fields(d)[17]) - 1
        else:
            live += 1
    except (OSError, ValueError): pass
print(live)
`

// TestZombieLeaderThreadsDoNotSurvive: a process whose main thread exited
// (so it looks like a zombie) while another thread runs on must not outlive
// the run. The agent's sweep skips zombies, so this is the broker's
// host-side check at work: it sees the live thread in a new session and
// replaces the container. Both as a session's first run and after a clean
// one (whose check the next run's "before" reuses).
func TestZombieLeaderThreadsDoNotSurvive(t *testing.T) {
	forRuntimes(t, func(t *testing.T, rt string) {
		b := engineBroker(t, map[string]string{"SANDBOX_RUNTIME": rt})
		c := b.Client(t, testToken)
		testZombieLeaderThreadsDoNotSurvive(t, c, "")
		r, _ := run(t, c, map[string]any{"language": "python", "code": "print(1)"})
		testZombieLeaderThreadsDoNotSurvive(t, c, r.SessionID)
	})
}

func testZombieLeaderThreadsDoNotSurvive(t *testing.T, c *client.Client, session string) {
	spawn := `
import ctypes, os, threading, time
libc = ctypes.CDLL(None)
if os.fork() == 0:
    os.setsid()
    libc.prctl(15, b"zombieleader", 0, 0, 0)  # PR_SET_NAME, inherited by new threads
    threading.Thread(target=lambda: time.sleep(1000)).start()
    libc.pthread_exit(None)
time.sleep(0.3)
print("spawned")
`
	args := map[string]any{"language": "python", "code": spawn}
	if session != "" {
		args["session_id"] = session
	}
	r, _ := run(t, c, args)
	if strings.TrimSpace(r.Stdout) != "spawned" {
		t.Fatalf("spawn: %+v", r)
	}
	r2, _ := run(t, c, map[string]any{"session_id": r.SessionID, "language": "python", "code": zombieLeaderProbe})
	if strings.TrimSpace(r2.Stdout) != "0" {
		t.Fatalf("threads of a zombie leader survived the run (session %q): %+v", session, r2)
	}
}
