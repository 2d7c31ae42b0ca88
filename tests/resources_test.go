package tests

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"
)

// fileRef is a file as run_code, list_artifacts, upload_file and
// read_artifact report it.
type fileRef struct {
	Name string `json:"name"`
	Size int64  `json:"size"`
	MIME string `json:"mime"`
	URI  string `json:"uri"`
	URL  string `json:"url"`
}

// readResource reads uri; err is the JSON-RPC error, if any.
func readResource(t testing.TB, c *client.Client, uri string) ([]mcp.ResourceContents, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var req mcp.ReadResourceRequest
	req.Params.URI = uri
	res, err := c.ReadResource(ctx, req)
	if err != nil {
		return nil, err
	}
	return res.Contents, nil
}

// readBlob reads uri and returns its one blob's bytes and MIME type.
func readBlob(t testing.TB, c *client.Client, uri string) ([]byte, string) {
	t.Helper()
	contents, err := readResource(t, c, uri)
	if err != nil || len(contents) != 1 {
		t.Fatalf("resources/read %s: %v %+v", uri, err, contents)
	}
	blob, ok := contents[0].(mcp.BlobResourceContents)
	if !ok {
		t.Fatalf("resources/read %s: %T, want a blob", uri, contents[0])
	}
	if blob.URI != uri {
		t.Fatalf("resources/read %s answered for %s", uri, blob.URI)
	}
	data, err := base64.StdEncoding.DecodeString(blob.Blob)
	if err != nil {
		t.Fatalf("blob of %s: %v", uri, err)
	}
	return data, blob.MIMEType
}

// readText reads uri and returns its one text content.
func readText(t testing.TB, c *client.Client, uri string) (string, string) {
	t.Helper()
	contents, err := readResource(t, c, uri)
	if err != nil || len(contents) != 1 {
		t.Fatalf("resources/read %s: %v %+v", uri, err, contents)
	}
	text, ok := contents[0].(mcp.TextResourceContents)
	if !ok {
		t.Fatalf("resources/read %s: %T, want text", uri, contents[0])
	}
	return text.Text, text.MIMEType
}

// TestStdioFilesReachTheClientWithoutPublicURL is issue 9's stdio
// criterion: the README's Claude Desktop setup (stdio, no PUBLIC_BASE_URL)
// gets a chart back inline and as a resource link it can read, and the file
// tools work and tell the truth.
func TestStdioFilesReachTheClientWithoutPublicURL(t *testing.T) {
	requireDocker(t)
	root := brokerRoot(t)
	c := StartStdio(t, root, nil)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	tpl, err := c.ListResourceTemplates(ctx, mcp.ListResourceTemplatesRequest{})
	if err != nil || len(tpl.ResourceTemplates) != 1 || tpl.ResourceTemplates[0].URITemplate.Raw() != "sandbox://{session_id}/{+path}" {
		t.Fatalf("resource templates: %+v %v", tpl, err)
	}

	code := `
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
plt.plot([1, 3, 2]); plt.title("chart"); plt.savefig("chart.png"); plt.close()
open("notes.txt", "w").write("a,b\n1,2\n")
print("saved")
`
	r, res := run(t, c, map[string]any{"language": "python", "code": code})
	if !r.Success || strings.TrimSpace(r.Stdout) != "saved" {
		t.Fatalf("run: %+v", r)
	}
	var files struct {
		Files []fileRef `json:"files"`
	}
	resultJSON(t, res, &files)
	refs := map[string]fileRef{}
	for _, f := range files.Files {
		refs[f.Name] = f
	}
	chart, notes := refs["chart.png"], refs["notes.txt"]
	wantURI := "sandbox://" + r.SessionID + "/chart.png"
	if chart.URI != wantURI || chart.MIME != "image/png" || chart.URL != "" || notes.URI != "sandbox://"+r.SessionID+"/notes.txt" {
		t.Fatalf("files without a public URL: %+v", files.Files)
	}

	// The chart comes back inline and as a resource link to that URI; with
	// no public URL there is no https link, and nothing failed for it.
	var inline []byte
	var links []mcp.ResourceLink
	var embedded []mcp.TextResourceContents
	for _, ct := range res.Content {
		switch v := ct.(type) {
		case mcp.ImageContent:
			if v.MIMEType == "image/png" {
				if inline, err = base64.StdEncoding.DecodeString(v.Data); err != nil {
					t.Fatal(err)
				}
			}
		case mcp.ResourceLink:
			links = append(links, v)
		case mcp.EmbeddedResource:
			if tr, ok := v.Resource.(mcp.TextResourceContents); ok {
				embedded = append(embedded, tr)
			}
		}
	}
	if len(inline) < 100 || string(inline[:8]) != "\x89PNG\r\n\x1a\n" {
		t.Fatalf("no inline PNG in %d contents", len(res.Content))
	}
	var chartLink *mcp.ResourceLink
	for i, l := range links {
		if !strings.HasPrefix(l.URI, "sandbox://") {
			t.Errorf("link without a public URL: %+v", l)
		}
		if l.URI == wantURI {
			chartLink = &links[i]
		}
	}
	if chartLink == nil || chartLink.MIMEType != "image/png" || chartLink.Name != "chart.png" || chartLink.Size == nil || *chartLink.Size != int64(len(inline)) {
		t.Fatalf("chart resource link: %+v in %+v", chartLink, links)
	}
	if len(embedded) != 1 || embedded[0].URI != notes.URI || embedded[0].Text != "a,b\n1,2\n" || !strings.HasPrefix(embedded[0].MIMEType, "text/plain") {
		t.Fatalf("small text file not embedded exactly: %+v", embedded)
	}

	// resources/read returns the very bytes on disk, as a PNG blob.
	onDisk, err := filepath.Glob(filepath.Join(root, "workspaces", "*", "chart.png"))
	if err != nil || len(onDisk) != 1 {
		t.Fatalf("chart on disk: %v %v", onDisk, err)
	}
	data, mime := readBlob(t, c, chartLink.URI)
	if mime != "image/png" || string(data) != string(inline) || string(data) != string(readAll(t, onDisk[0])) {
		t.Fatalf("resources/read: %s, %d bytes; inline %d bytes", mime, len(data), len(inline))
	}
	if text, mime := readText(t, c, notes.URI); text != "a,b\n1,2\n" || !strings.HasPrefix(mime, "text/plain") {
		t.Fatalf("notes.txt: %q %s", text, mime)
	}

	// list_artifacts lists it; read_artifact reads it.
	var list struct {
		Files []fileRef `json:"files"`
	}
	resultJSON(t, callTool(t, c, "list_artifacts", map[string]any{"session_id": r.SessionID}), &list)
	if len(list.Files) != 2 || list.Files[0] != chart || list.Files[1] != notes {
		t.Fatalf("list_artifacts: %+v", list.Files)
	}
	ra := callTool(t, c, "read_artifact", map[string]any{"session_id": r.SessionID, "path": "chart.png"})
	var read struct {
		Encoding string `json:"encoding"`
		URI      string `json:"uri"`
		URL      string `json:"url"`
	}
	resultJSON(t, ra, &read)
	if ra.IsError || read.Encoding != "image" || read.URI != wantURI || read.URL != "" {
		t.Fatalf("read_artifact: %+v", read)
	}

	// upload_file succeeds once, its retry is FILE_EXISTS because the file
	// really is there, and overwrite replaces it.
	up := callTool(t, c, "upload_file", map[string]any{"session_id": r.SessionID, "path": "in/data.csv", "content": "x,y\n"})
	var upOut struct {
		Path string `json:"path"`
		Size int    `json:"size"`
		URI  string `json:"uri"`
		URL  string `json:"url"`
	}
	resultJSON(t, up, &upOut)
	if up.IsError || upOut.Size != 4 || upOut.URI != "sandbox://"+r.SessionID+"/in/data.csv" || upOut.URL != "" {
		t.Fatalf("upload_file: %+v", upOut)
	}
	mustToolError(t, callTool(t, c, "upload_file", map[string]any{"session_id": r.SessionID, "path": "in/data.csv", "content": "again"}), "FILE_EXISTS")
	if res := callTool(t, c, "upload_file", map[string]any{"session_id": r.SessionID, "path": "in/data.csv", "content": "x,y\n1,2\n", "overwrite": true}); res.IsError {
		t.Fatalf("overwrite: %+v", res.Content)
	}
	if text, _ := readText(t, c, upOut.URI); text != "x,y\n1,2\n" {
		t.Fatalf("uploaded file reads back as %q", text)
	}

	// The audit log tells the same story: the first upload succeeded.
	c.Close()
	uploads := auditOutcomes(t, root, "upload_file")
	if strings.Join(uploads, ",") != "success,failure:FILE_EXISTS,success" {
		t.Fatalf("upload_file audit outcomes: %v", uploads)
	}
	if reads := auditOutcomes(t, root, "resources/read"); strings.Join(reads, ",") != "success,success,success" {
		t.Fatalf("resources/read audit outcomes: %v", reads)
	}
}

// auditOutcomes lists the outcome rows of tool, in order, as "outcome" or
// "outcome:ERROR_CODE".
func auditOutcomes(t *testing.T, root, tool string) []string {
	t.Helper()
	out := runBroker(t, root, "audit", "export", "--format", "jsonl")
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var r struct {
			Phase, Tool, Outcome string
			ErrorCode            string `json:"error_code"`
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("export line %q: %v", line, err)
		}
		if r.Tool != tool || r.Phase != "outcome" {
			continue
		}
		if r.ErrorCode != "" {
			r.Outcome += ":" + r.ErrorCode
		}
		got = append(got, r.Outcome)
	}
	return got
}

// TestFileResourcesBelongToTheirPrincipal: over HTTP, a resource URI is
// only readable by the principal whose session it names; another principal
// gets the answer a missing session gets, and hostile URIs are refused
// without touching any file.
func TestFileResourcesBelongToTheirPrincipal(t *testing.T) {
	requireDocker(t)
	tokens, tok := writeTokens(t, map[string]string{"alice": "pro", "bob": "pro"})
	b := StartHTTP(t, BrokerOpts{Env: map[string]string{"MCP_TOKENS_FILE": tokens, "SANDBOX_POOL_SIZE": "1"}})
	alice, bob := b.Client(t, tok["alice"]), b.Client(t, tok["bob"])

	var up struct {
		URI string `json:"uri"`
		URL string `json:"url"`
	}
	resultJSON(t, callTool(t, alice, "upload_file", map[string]any{"session_id": "shared-name", "path": "secret.txt", "content": "alice's secret\n"}), &up)
	if up.URI != "sandbox://shared-name/secret.txt" || !strings.HasPrefix(up.URL, b.URL+"/files/") {
		t.Fatalf("upload over HTTP: %+v", up)
	}
	if text, _ := readText(t, alice, up.URI); text != "alice's secret\n" {
		t.Fatalf("alice reads %q", text)
	}

	refused := func(c *client.Client, who, uri, code string) {
		t.Helper()
		contents, err := readResource(t, c, uri)
		if err == nil {
			t.Errorf("%s read %q: %+v", who, uri, contents)
			return
		}
		msg := err.Error()
		if !strings.Contains(msg, code) || strings.Contains(msg, "alice") || strings.Contains(msg, b.Root) {
			t.Errorf("%s read %q: %q, want %s without owner or host path", who, uri, msg, code)
		}
	}
	// The read passes the output redactor like any tool result.
	pat := "ghp_" + strings.Repeat("Q", 36)
	callTool(t, alice, "upload_file", map[string]any{"session_id": "shared-name", "path": "leak.txt", "content": "token=" + pat + "\n"})
	if text, _ := readText(t, alice, "sandbox://shared-name/leak.txt"); strings.Contains(text, pat) || !strings.Contains(text, "[REDACTED]") {
		t.Fatalf("resources/read is not redacted: %q", text)
	}

	// Bob naming alice's session gets what a missing session gets.
	refused(bob, "bob", up.URI, "SANDBOX_NOT_FOUND")
	refused(bob, "bob", "sandbox://never-existed/secret.txt", "SANDBOX_NOT_FOUND")
	// Bob's own session of the same name is his alone.
	callTool(t, bob, "upload_file", map[string]any{"session_id": "shared-name", "path": "secret.txt", "content": "bob's\n"})
	if text, _ := readText(t, bob, up.URI); text != "bob's\n" {
		t.Fatalf("bob reads %q from his own session", text)
	}
	if text, _ := readText(t, alice, up.URI); text != "alice's secret\n" {
		t.Fatalf("alice's file changed: %q", text)
	}

	// Hostile URIs from the owner herself.
	r, _ := run(t, alice, map[string]any{"session_id": "shared-name", "language": "bash",
		"code": "ln -s /etc/passwd passwd.txt; ln -s secret.txt alias.txt; ln -s .. up; mkfifo pipe.txt; head -c 11M /dev/zero > big.bin; echo ok"})
	if strings.TrimSpace(r.Stdout) != "ok" {
		t.Fatalf("setup: %+v", r)
	}
	for uri, code := range map[string]string{
		"sandbox://shared-name/passwd.txt":                              "FILE_NOT_FOUND", // symlink out of the workspace
		"sandbox://shared-name/alias.txt":                               "FILE_NOT_FOUND", // symlink inside it
		"sandbox://shared-name/up/etc/passwd":                           "FILE_NOT_FOUND", // through a directory symlink
		"sandbox://shared-name/pipe.txt":                                "FILE_NOT_FOUND", // FIFO
		"sandbox://shared-name/big.bin":                                 "FILE_SIZE_EXCEEDED",
		"sandbox://shared-name/../shared-name/secret.txt":               "PATH_TRAVERSAL",
		"sandbox://shared-name/%2e%2e/%2e%2e/etc/passwd":                "PATH_TRAVERSAL",
		"sandbox://shared-name/..%2F..%2Fetc%2Fpasswd":                  "PATH_TRAVERSAL",
		"sandbox://shared-name//etc/passwd":                             "PATH_TRAVERSAL",
		"sandbox:///etc/passwd":                                         "INVALID_INPUT",
		"sandbox://shared-name/secret.txt%00.png":                       "INVALID_INPUT",
		"sandbox://shared-name/secret.txt?x=1":                          "INVALID_INPUT",
		"sandbox://" + url.PathEscape("../shared-name") + "/secret.txt": "INVALID_INPUT",
	} {
		refused(alice, "alice", uri, code)
	}
	// URIs the template does not match: mcp-go answers "not found" before
	// the broker sees them.
	for _, uri := range []string{"file:///etc/passwd", "sandbox://shared-name/secret.txt\x00", "SANDBOX://shared-name/secret.txt"} {
		refused(alice, "alice", uri, "not found")
	}

	// Bob's refused reads are audited as his, with the code he saw.
	alice.Close()
	bob.Close()
	b.Stop(t)
	var bobs []string
	for _, line := range strings.Split(strings.TrimSpace(runBroker(t, b.Root, "audit", "export", "--format", "jsonl")), "\n") {
		var r struct {
			Phase, Principal, Tool, Outcome string
			ErrorCode                       string `json:"error_code"`
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatal(err)
		}
		if r.Principal == "bob" && r.Tool == "resources/read" && r.Phase == "outcome" {
			bobs = append(bobs, r.Outcome+":"+r.ErrorCode)
		}
	}
	if strings.Join(bobs, ",") != "failure:SANDBOX_NOT_FOUND,failure:SANDBOX_NOT_FOUND,success:" {
		t.Fatalf("bob's resources/read audit rows: %v", bobs)
	}
}
