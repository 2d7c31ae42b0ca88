package codesandbox

import (
	"bytes"
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
)

const reactTpl = "tplreact"

func newProvider(t *testing.T, f *csbfake.Server, log *logBuf, mod func(*ProviderOptions)) *Provider {
	t.Helper()
	f.AddTemplate(reactTpl, map[string][]byte{"README.md": []byte("template")}, 5173)
	o := ProviderOptions{
		API:       fastOptions(f, nil),
		Templates: map[string]Template{"react": {ID: reactTpl, Port: 5173}},
	}
	if log != nil {
		o.Log = fastOptions(f, log).Log
	}
	if mod != nil {
		mod(&o)
	}
	p, err := NewProvider(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close(context.Background()) })
	return p
}

var projectFiles = map[string][]byte{
	"package.json":  []byte(`{"name":"demo","scripts":{"build":"vite build","dev":"vite"}}`),
	"index.html":    []byte("<!doctype html><h1>demo</h1>\n"),
	"src/main.jsx":  []byte("console.log('hi')\n"),
	"src/ui/App.js": []byte("export default 1\n"),
}

func TestProviderEndToEnd(t *testing.T) {
	f := newFake(t)
	var log logBuf
	p := newProvider(t, f, &log, nil)
	cx := ctx(t)
	if p.Name() != "codesandbox" {
		t.Fatal(p.Name())
	}
	if err := p.Ping(cx); err != nil {
		t.Fatal(err)
	}

	sb, err := p.Create(cx, projects.CreateRequest{ProjectName: "demo app", Template: "react", Files: projectFiles})
	if err != nil {
		t.Fatal(err)
	}
	id := sb.ID()
	st, _ := f.Sandbox(id)
	if !st.Running || st.Privacy != PrivacyPrivate || !st.PrivatePreview || st.Tier != "Pico" || st.Title != "demo app" ||
		strings.Join(st.Tags, ",") != "sandbox-broker,sandbox-broker-template-react" {
		t.Fatalf("sandbox: %+v", st)
	}
	for rel, content := range projectFiles {
		if !bytes.Equal(st.Files[csbfake.UserWorkspacePath+"/"+rel], content) {
			t.Fatalf("%s not written", rel)
		}
	}
	// Fork with start options: one call, no separate start.
	if n := count(f, "POST", "/sandbox/"+reactTpl+"/fork"); n != 1 {
		t.Fatalf("forks: %d", n)
	}
	if n := count(f, "POST", "/vm/"+id+"/start"); n != 0 {
		t.Fatalf("starts: %d", n)
	}

	out, code, err := sb.Build(cx)
	if err != nil || code != 0 || !bytes.Contains(out, []byte("built dist/index.html")) || bytes.Contains(out, []byte("\x1b")) {
		t.Fatalf("build: %d %q %v", code, out, err)
	}
	dist, err := sb.ReadFile(cx, "dist/index.html", 1<<20)
	if err != nil || !bytes.Equal(dist, projectFiles["index.html"]) {
		t.Fatalf("dist: %q %v", dist, err)
	}

	u1, err := sb.PreviewURL(cx)
	if err != nil {
		t.Fatal(err)
	}
	pu, err := url.Parse(u1)
	if err != nil || pu.Scheme != "https" || pu.Host != id+"-5173.csb.app" || pu.Path != "/" {
		t.Fatalf("preview URL %q", u1)
	}
	tok := pu.Query().Get("preview_token")
	if tok == "" || !f.PreviewTokenValid(id, tok) {
		t.Fatalf("preview token %q not valid", tok)
	}
	var tokReq map[string]string
	for _, r := range f.Requests() {
		if r.Path == "/sandbox/"+id+"/tokens" {
			_ = json.Unmarshal(r.Body, &tokReq)
		}
	}
	exp, err := time.Parse(time.RFC3339, tokReq["expires_at"])
	if err != nil || time.Until(exp) > projects.TTL || time.Until(exp) < projects.TTL-time.Minute {
		t.Fatalf("token expiry %q", tokReq["expires_at"])
	}
	u2, err := sb.PreviewURL(cx)
	if err != nil || u2 != u1 || count(f, "POST", "/sandbox/"+id+"/tokens") != 1 {
		t.Fatalf("token not cached: %q vs %q", u2, u1)
	}

	f.AppendDevLog(id, "\x1b[2m12:00:00\x1b[22m page reload src/main.jsx\r\n")
	logs, err := sb.ConsoleLog(cx, 1<<10)
	if err != nil || !bytes.Contains(logs, []byte("ready on port 5173")) || !bytes.HasSuffix(logs, []byte("12:00:00 page reload src/main.jsx\n")) ||
		bytes.Contains(logs, []byte("[CODESANDBOX]")) || bytes.Contains(logs, []byte("\r")) {
		t.Fatalf("console log %q %v", logs, err)
	}
	if short, _ := sb.ConsoleLog(cx, 10); len(short) != 10 || !bytes.HasSuffix(logs, short) {
		t.Fatalf("tail: %q", short)
	}

	if err := p.Destroy(cx, id); err != nil {
		t.Fatal(err)
	}
	if st, _ := f.Sandbox(id); !st.Deleted || st.Running {
		t.Fatalf("after Destroy: %+v", st)
	}
	if count(f, "POST", "/vm/"+id+"/shutdown") != 1 || count(f, "DELETE", "/vm/"+id) != 1 {
		t.Fatal("Destroy must shut down then delete")
	}
	if err := p.Destroy(cx, id); err != nil {
		t.Fatalf("Destroy of a missing sandbox: %v", err)
	}
	if err := p.Destroy(cx, "../x"); err != nil {
		t.Fatalf("Destroy of an impossible ID: %v", err)
	}
	// The log has the lifecycle but nothing secret.
	if s := log.String(); !strings.Contains(s, `"message":"codesandbox_sandbox_created"`) || !strings.Contains(s, `"message":"codesandbox_request"`) {
		t.Fatalf("log lacks events: %s", s)
	}
	if s := log.String(); strings.Contains(s, testKey) || strings.Contains(s, tok) || strings.Contains(s, "pt_") {
		t.Fatalf("secret in log: %s", s)
	}
}

func TestProviderBuildFailure(t *testing.T) {
	f := newFake(t)
	p := newProvider(t, f, nil, nil)
	sb, err := p.Create(ctx(t), projects.CreateRequest{ProjectName: "x", Template: "react", Files: map[string][]byte{"index.html": []byte("x")}})
	if err != nil {
		t.Fatal(err)
	}
	out, code, err := sb.Build(ctx(t))
	if err != nil || code != 1 || !bytes.Contains(out, []byte("package.json")) {
		t.Fatalf("%d %q %v", code, out, err)
	}
}

func TestProviderReadFile(t *testing.T) {
	f := newFake(t)
	p := newProvider(t, f, nil, nil)
	cx := ctx(t)
	sb, err := p.Create(cx, projects.CreateRequest{ProjectName: "x", Template: "react", Files: projectFiles})
	if err != nil {
		t.Fatal(err)
	}
	if b, err := sb.ReadFile(cx, "src/main.jsx", 100); err != nil || string(b) != "console.log('hi')\n" {
		t.Fatalf("%q %v", b, err)
	}
	before := len(f.PitcherCalls())
	_, err = sb.ReadFile(cx, "package.json", 10)
	wantCode(t, err, brokererr.FileSizeExceeded)
	if calls := f.PitcherCalls()[before:]; len(calls) != 1 || calls[0].Method != "fs/stat" {
		t.Fatalf("an oversize file was transferred: %v", calls)
	}
	_, err = sb.ReadFile(cx, "nope.txt", 100)
	wantCode(t, err, brokererr.FileNotFound)
	_, err = sb.ReadFile(cx, "src", 100)
	wantCode(t, err, brokererr.InvalidInput)

	before = len(f.PitcherCalls())
	for _, bad := range []string{"../etc/passwd", "/etc/passwd", ".env", "a/.git/config", "node_modules/x"} {
		_, err := sb.ReadFile(cx, bad, 100)
		if c := brokererr.CodeOf(err); c != brokererr.PathTraversal && c != brokererr.InvalidInput {
			t.Fatalf("%s: %v", bad, err)
		}
		if err := sb.WriteFiles(cx, map[string][]byte{bad: []byte("x")}); brokererr.CodeOf(err) != brokererr.PathTraversal {
			t.Fatalf("write %s: %v", bad, err)
		}
	}
	if n := len(f.PitcherCalls()) - before; n != 0 {
		t.Fatalf("bad paths reached the agent: %d calls", n)
	}
}

func TestProviderCreateCleansUp(t *testing.T) {
	f := newFake(t)
	p := newProvider(t, f, nil, nil)
	// "a" is written as a file, so "a/b" cannot get its directory.
	_, err := p.Create(ctx(t), projects.CreateRequest{ProjectName: "x", Template: "react", Files: map[string][]byte{"a": []byte("1"), "a/b": []byte("2")}})
	wantCode(t, err, brokererr.FileExists)
	var id string
	for _, r := range f.Requests() {
		if r.Method == "DELETE" {
			id = strings.TrimPrefix(r.Path, "/vm/")
		}
	}
	if st, ok := f.Sandbox(id); !ok || !st.Deleted {
		t.Fatalf("half-made sandbox %q left behind", id)
	}
}

func TestProviderRefusals(t *testing.T) {
	f := newFake(t)
	p := newProvider(t, f, nil, nil)
	cx := ctx(t)
	f.ResetRequests()
	_, err := p.Create(cx, projects.CreateRequest{Template: "angular"})
	wantCode(t, err, brokererr.InvalidInput)
	_, err = p.Create(cx, projects.CreateRequest{Template: "react", Files: map[string][]byte{"../../x": nil}})
	wantCode(t, err, brokererr.PathTraversal)
	_, err = p.Open(cx, "Robert'); DROP")
	wantCode(t, err, brokererr.SandboxNotFound)
	if n := len(f.Requests()); n != 0 {
		t.Fatalf("refused calls reached the API: %d", n)
	}
	// A sandbox that exists but is not the broker's (no tag) is "not found".
	_, err = p.Open(cx, UniversalTemplate)
	wantCode(t, err, brokererr.SandboxNotFound)
	_, err = p.Open(cx, "zzzzzz")
	wantCode(t, err, brokererr.SandboxNotFound)

	if _, err := NewProvider(ProviderOptions{API: Options{APIKey: "k"}, Tier: "Huge"}); err == nil {
		t.Fatal("unknown tier accepted")
	}
	if _, err := NewProvider(ProviderOptions{API: Options{APIKey: "k"}, Templates: map[string]Template{"x": {ID: "../a", Port: 1}}}); err == nil {
		t.Fatal("bad template accepted")
	}
}

func TestProviderOpenAndReconnect(t *testing.T) {
	f := newFake(t)
	var log logBuf
	p := newProvider(t, f, &log, nil)
	cx := ctx(t)
	sb, err := p.Create(cx, projects.CreateRequest{ProjectName: "x", Template: "react", Files: projectFiles})
	if err != nil {
		t.Fatal(err)
	}
	id := sb.ID()

	// The VM hibernates under the cached connection: the next call starts
	// it again and joins afresh.
	if !f.HibernateVM(id) {
		t.Fatal("HibernateVM")
	}
	await(t, f, "the agent connection to drop", func() bool {
		st, _ := f.Sandbox(id)
		return st.Connections == 0
	})
	if err := sb.WriteFiles(cx, map[string][]byte{"src/new.js": []byte("1")}); err != nil {
		t.Fatal(err)
	}
	st, _ := f.Sandbox(id)
	if strings.Join(st.Bootups, ",") != "FORK,RESUME" || string(st.Files[csbfake.UserWorkspacePath+"/src/new.js"]) != "1" {
		t.Fatalf("after reconnect: %+v", st.Bootups)
	}
	joins := 0
	for _, c := range f.PitcherCalls() {
		if c.SandboxID == id && c.Method == "client/join" {
			joins++
		}
	}
	if joins != 2 {
		t.Fatalf("client/join calls: %d", joins)
	}
	// Agent events name their sandbox, and every event has one component.
	if s := log.String(); !strings.Contains(s, `"sandbox_id":"`+id+`","component":"codesandbox_pitcher"`) ||
		!strings.Contains(s, `"message":"pitcher_hibernate"`) {
		t.Fatalf("agent events: %s", s)
	}
	for _, line := range strings.Split(strings.TrimSpace(log.String()), "\n") {
		if strings.Count(line, `"component":`) != 1 {
			t.Fatalf("component keys in %s", line)
		}
	}

	// A fresh provider (a restarted broker) opens it by ID and knows its template.
	p2 := newProvider(t, f, nil, nil)
	sb2, err := p2.Open(cx, id)
	if err != nil {
		t.Fatal(err)
	}
	u, err := sb2.PreviewURL(cx)
	if err != nil || !strings.HasPrefix(u, "https://"+id+"-5173.csb.app/?preview_token=") {
		t.Fatalf("preview after Open: %q %v", u, err)
	}
	if b, err := sb2.ReadFile(cx, "src/new.js", 10); err != nil || string(b) != "1" {
		t.Fatalf("%q %v", b, err)
	}
}

func TestProviderPublicPreviews(t *testing.T) {
	f := newFake(t)
	p := newProvider(t, f, nil, func(o *ProviderOptions) { o.PublicPreviews = true })
	sb, err := p.Create(ctx(t), projects.CreateRequest{ProjectName: "x", Template: "react"})
	if err != nil {
		t.Fatal(err)
	}
	u, err := sb.PreviewURL(ctx(t))
	if err != nil || u != "https://"+sb.ID()+"-5173.csb.app/" {
		t.Fatalf("%q %v", u, err)
	}
	if st, _ := f.Sandbox(sb.ID()); st.PrivatePreview || st.PreviewTokens != 0 {
		t.Fatalf("state: %+v", st)
	}
}

func TestProviderPingAndClose(t *testing.T) {
	f := newFake(t)
	p := newProvider(t, f, nil, func(o *ProviderOptions) { o.API.APIKey = "csb_v1_wrong" })
	wantCode(t, p.Ping(ctx(t)), brokererr.PermissionDenied)

	p2 := newProvider(t, f, nil, nil)
	sb, err := p2.Create(ctx(t), projects.CreateRequest{ProjectName: "x", Template: "react"})
	if err != nil {
		t.Fatal(err)
	}
	if err := p2.Close(ctx(t)); err != nil {
		t.Fatal(err)
	}
	await(t, f, "connections to close", func() bool {
		st, _ := f.Sandbox(sb.ID())
		return st.Connections == 0
	})
	_, err = p2.Create(ctx(t), projects.CreateRequest{Template: "react"})
	wantCode(t, err, brokererr.Unavailable)
}

func TestPickPort(t *testing.T) {
	cases := []struct {
		ports []Port
		want  int
		got   int
	}{
		{nil, 5173, 5173},
		{[]Port{{Port: 3000}, {Port: 5173}}, 5173, 5173},
		{[]Port{{Port: 8080}, {Port: 3000}}, 5173, 3000},
		{[]Port{{Port: agentPort}, {Port: 0}, {Port: 70000}}, 3000, 3000},
	}
	for _, c := range cases {
		if got := pickPort(c.ports, c.want); got != c.got {
			t.Errorf("%v want %d: %d", c.ports, c.want, got)
		}
	}
}
