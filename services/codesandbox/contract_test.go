package codesandbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
)

// Contract tests: the client decodes payloads shaped exactly like the
// published types of @codesandbox/sdk 2.4.2 (the fixtures), and the fake
// sends nothing those types would not allow.

// replay is a management API that answers every request with one fixture.
func replay(t *testing.T, status int, name string) *Client {
	t.Helper()
	body := fixture(t, name)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}))
	t.Cleanup(srv.Close)
	c, err := New(Options{BaseURL: srv.URL, APIKey: testKey, MaxRetries: -1})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestClientDecodesSDKPayloads(t *testing.T) {
	cx := ctx(t)
	t.Run("MetaInformation is bare", func(t *testing.T) {
		mi, err := replay(t, 200, "MetaInformation.full.json").MetaInfo(cx)
		if err != nil || mi.API.LatestVersion != "2023-07-01" || mi.Auth.Team != "ws_1234567890" ||
			mi.RateLimits.RequestsHourly.Reset != "1767225600" || mi.RateLimits.ConcurrentVMs.Remaining != 9 {
			t.Fatalf("%+v %v", mi, err)
		}
		for _, n := range []string{"MetaInformation.sparse.json", "MetaInformation.nulls.json"} {
			if mi, err := replay(t, 200, n).MetaInfo(cx); err != nil || mi.API.Name != "CodeSandbox API" || mi.Auth.Team != "" {
				t.Fatalf("%s: %+v %v", n, mi, err)
			}
		}
	})
	t.Run("SandboxListResponse", func(t *testing.T) {
		l, err := replay(t, 200, "SandboxListResponse.full.json").ListSandboxes(cx, ListOptions{})
		if err != nil || len(l.Sandboxes) != 1 || l.Pagination.NextPage == nil || *l.Pagination.NextPage != 2 || l.Sandboxes[0].Tags[0] != "sandbox-broker" {
			t.Fatalf("%+v %v", l, err)
		}
		l, err = replay(t, 200, "SandboxListResponse.sparse.json").ListSandboxes(cx, ListOptions{})
		if err != nil || len(l.Sandboxes) != 2 || l.Pagination.NextPage != nil || l.Sandboxes[1].Title != nil || !l.Sandboxes[1].IsFrozen {
			t.Fatalf("%+v %v", l, err)
		}
	})
	t.Run("SandboxGetResponse", func(t *testing.T) {
		for _, n := range []string{"SandboxGetResponse.full.json", "SandboxGetResponse.sparse.json", "SandboxGetResponse.nulls.json"} {
			sb, err := replay(t, 200, n).GetSandbox(cx, "abc123")
			if err != nil || sb.ID != "abc123" || sb.CreatedAt.IsZero() || sb.Privacy != PrivacyPrivate {
				t.Fatalf("%s: %+v %v", n, sb, err)
			}
		}
	})
	t.Run("SandboxForkResponse", func(t *testing.T) {
		fr, err := replay(t, 201, "SandboxForkResponse.full.json").Fork(cx, UniversalTemplate, ForkRequest{})
		if err != nil || fr.ID != "abc123" || fr.StartResponse == nil || fr.StartResponse.PitcherToken.Reveal() != "pitcher-secret" ||
			fr.StartResponse.PintToken.Reveal() != "pint-secret" || fr.StartResponse.UserWorkspacePath != "/project/workspace" {
			t.Fatalf("%+v %v", fr, err)
		}
		if fr, err := replay(t, 201, "SandboxForkResponse.started.json").Fork(cx, UniversalTemplate, ForkRequest{}); err != nil ||
			fr.StartResponse == nil || fr.StartResponse.PintToken != "" || fr.StartResponse.PitcherURL != "wss://abc123-57468.csb.app" {
			t.Fatalf("started: %+v %v", fr, err)
		}
		for _, n := range []string{"SandboxForkResponse.sparse.json", "SandboxForkResponse.nulls.json"} {
			if fr, err := replay(t, 201, n).Fork(cx, UniversalTemplate, ForkRequest{}); err != nil || fr.StartResponse != nil {
				t.Fatalf("%s: %+v %v", n, fr, err)
			}
		}
	})
	t.Run("VmStartResponse", func(t *testing.T) {
		for n, boot := range map[string]string{"VmStartResponse.full.json": "RESUME", "VmStartResponse.sparse.json": "CLEAN"} {
			sr, err := replay(t, 200, n).Start(cx, "abc123", StartOptions{})
			if err != nil || sr.BootupType != boot || sr.PitcherToken.Reveal() != "pitcher-secret" || sr.ReconnectToken.Reveal() != "reconnect-secret" {
				t.Fatalf("%s: %+v %v", n, sr, err)
			}
		}
	})
	t.Run("VmListRunningVmsResponse timestamps are epoch strings", func(t *testing.T) {
		run, err := replay(t, 200, "VmListRunningVmsResponse.full.json").RunningVMs(cx)
		if err != nil || len(run.VMs) != 2 {
			t.Fatalf("%+v %v", run, err)
		}
		// "1767225600" is seconds, "1767225000123" milliseconds (parseTimestamp).
		if v := run.VMs[0]; v.LastActiveAt.Unix() != 1767225600 || v.SessionStartedAt.UnixMilli() != 1767225000123 || v.CreditBasis != "5" {
			t.Fatalf("vm 0: %+v", v)
		}
		if v := run.VMs[1]; !v.LastActiveAt.IsZero() || !v.SessionStartedAt.IsZero() {
			t.Fatalf(`"0" and "" must be no time: %+v`, v)
		}
		if run, err := replay(t, 200, "VmListRunningVmsResponse.sparse.json").RunningVMs(cx); err != nil || len(run.VMs) != 2 || !run.VMs[0].LastActiveAt.IsZero() {
			t.Fatalf("sparse: %+v %v", run, err)
		}
	})
	t.Run("VmHibernateResponse", func(t *testing.T) {
		for _, n := range []string{"VmHibernateResponse.full.json", "VmHibernateResponse.sparse.json"} {
			c := replay(t, 200, n)
			if err := c.Hibernate(cx, "abc123"); err != nil {
				t.Fatal(n, err)
			}
			if err := c.Delete(cx, "abc123"); err != nil {
				t.Fatal(n, err)
			}
		}
	})
	t.Run("PreviewTokenCreateResponse", func(t *testing.T) {
		tok, err := replay(t, 201, "PreviewTokenCreateResponse.full.json").CreatePreviewToken(cx, "abc123", time.Now().Add(time.Hour))
		if err != nil || tok.Token.Reveal() != "prv_abcdef0123456789" || tok.ExpiresAt == nil || tok.ExpiresAt.Unix() != 1767229200 {
			t.Fatalf("%+v %v", tok, err)
		}
		tok, err = replay(t, 201, "PreviewTokenCreateResponse.nulls.json").CreatePreviewToken(cx, "abc123", time.Now().Add(time.Hour))
		if err != nil || tok.ExpiresAt != nil || tok.LastUsedAt != nil {
			t.Fatalf("%+v %v", tok, err)
		}
	})
	t.Run("Response errors", func(t *testing.T) {
		_, err := replay(t, 404, "Response.errors.json").GetSandbox(cx, "abc123")
		wantCode(t, err, brokererr.SandboxNotFound)
		_, err = replay(t, 403, "Response.sparse.json").GetSandbox(cx, "abc123")
		wantCode(t, err, brokererr.PermissionDenied)
	})
}

// raw makes one request to the fake and returns status and body.
func raw(t *testing.T, base, method, path, body string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, _ := http.NewRequestWithContext(ctx(t), method, base+path, rd)
	req.Header.Set("Authorization", "Bearer "+testKey)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func TestFakeFollowsSDKTypes(t *testing.T) {
	f := newFake(t)
	u := f.URL()
	check := func(what string, wantStatus int, method, path, body string, fixtures ...string) []byte {
		t.Helper()
		st, b := raw(t, u, method, path, body)
		if st != wantStatus {
			t.Fatalf("%s: HTTP %d, want %d: %s", what, st, wantStatus, b)
		}
		conforms(t, what, b, fixtures...)
		return b
	}
	meta := []string{"MetaInformation.full.json", "MetaInformation.sparse.json", "MetaInformation.nulls.json"}
	fork := []string{"SandboxForkResponse.full.json", "SandboxForkResponse.sparse.json", "SandboxForkResponse.nulls.json", "SandboxForkResponse.started.json"}
	start := []string{"VmStartResponse.full.json", "VmStartResponse.sparse.json"}
	get := []string{"SandboxGetResponse.full.json", "SandboxGetResponse.sparse.json", "SandboxGetResponse.nulls.json"}
	list := []string{"SandboxListResponse.full.json", "SandboxListResponse.sparse.json"}
	running := []string{"VmListRunningVmsResponse.full.json", "VmListRunningVmsResponse.sparse.json"}
	empty := []string{"VmHibernateResponse.full.json", "VmHibernateResponse.sparse.json"}
	token := []string{"PreviewTokenCreateResponse.full.json", "PreviewTokenCreateResponse.nulls.json"}
	errs := []string{"Response.errors.json", "Response.sparse.json"}

	check("GET /meta/info", 200, "GET", "/meta/info", "", meta...)
	b := check("fork with start_options", 201, "POST", "/sandbox/"+UniversalTemplate+"/fork",
		`{"title":"t","privacy":2,"private_preview":true,"tags":["sandbox-broker"],"start_options":{"tier":"Pico"}}`, fork...)
	var fr struct{ Data struct{ ID string } }
	_ = json.Unmarshal(b, &fr)
	id := fr.Data.ID
	check("fork without start_options", 201, "POST", "/sandbox/"+UniversalTemplate+"/fork", `{"tags":["sandbox-broker"]}`, fork...)
	check("GET /sandbox/{id}", 200, "GET", "/sandbox/"+id, "", get...)
	check("GET /sandbox", 200, "GET", "/sandbox?tags=sandbox-broker&page_size=1", "", list...)
	check("GET /vm/running", 200, "GET", "/vm/running", "", running...)
	// Its times are epoch strings, read as the SDK's parseTimestamp reads them.
	run, err := newClient(t, f, nil, nil).RunningVMs(ctx(t))
	if err != nil || len(run.VMs) != 1 {
		t.Fatalf("running: %+v %v", run, err)
	}
	for _, ts := range []Timestamp{run.VMs[0].LastActiveAt, run.VMs[0].SessionStartedAt} {
		if d := time.Since(ts.Time); d < 0 || d > time.Minute {
			t.Fatalf("running VM time %v is not now", ts.Time)
		}
	}
	check("POST /vm/{id}/start (running)", 200, "POST", "/vm/"+id+"/start", `{}`, start...)
	check("POST /sandbox/{id}/tokens", 201, "POST", "/sandbox/"+id+"/tokens", `{"expires_at":"`+time.Now().Add(time.Hour).UTC().Format(time.RFC3339)+`"}`, token...)
	check("POST /sandbox/{id}/tokens without expiry", 201, "POST", "/sandbox/"+id+"/tokens", `{}`, token...)
	check("POST /vm/{id}/hibernate", 200, "POST", "/vm/"+id+"/hibernate", `{}`, empty...)
	check("POST /vm/{id}/start (resume)", 200, "POST", "/vm/"+id+"/start", `{}`, start...)
	check("POST /vm/{id}/shutdown", 200, "POST", "/vm/"+id+"/shutdown", `{}`, empty...)
	check("POST /vm/{id}/shutdown (not running)", 404, "POST", "/vm/"+id+"/shutdown", `{}`, errs...)
	check("DELETE /vm/{id}", 200, "DELETE", "/vm/"+id, "", empty...)
	check("GET /sandbox/{id} (deleted)", 404, "GET", "/sandbox/"+id, "", errs...)
	check("fork with a bad field", 422, "POST", "/sandbox/"+UniversalTemplate+"/fork", `{"Title":"x"}`, errs...)
}

// toMsgpack re-encodes a JSON fixture as the agent would send it: integers
// as msgpack integers, like @msgpack/msgpack does for JS numbers.
func toMsgpack(t *testing.T, name string) msgpack.RawMessage {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(fixture(t, name)))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatal(err)
	}
	var conv func(any) any
	conv = func(v any) any {
		switch v := v.(type) {
		case json.Number:
			if i, err := v.Int64(); err == nil {
				return i
			}
			f, _ := v.Float64()
			return f
		case map[string]any:
			for k, e := range v {
				v[k] = conv(e)
			}
		case []any:
			for i, e := range v {
				v[i] = conv(e)
			}
		}
		return v
	}
	b, err := msgpack.Marshal(conv(v))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestPitcherDecodesSDKPayloads(t *testing.T) {
	var join JoinResult
	if err := msgpack.Unmarshal(toMsgpack(t, "pitcher/client.ClientJoinMessage.full.json"), &join); err != nil ||
		join.Client.ClientID != "c_1" || join.WorkspacePath != "/project/workspace" || join.ProtocolVersion != "0.367.10" {
		t.Fatalf("join: %+v %v", join, err)
	}
	for name, steps := range map[string]int{
		"pitcher/setup.SetupGetMessage.idle.json": 0, "pitcher/setup.SetupGetMessage.running.json": 2, "pitcher/setup.SetupStatusNotification.json": 1,
	} {
		var sp SetupProgress
		if err := msgpack.Unmarshal(toMsgpack(t, name), &sp); err != nil || len(sp.Steps) != steps || sp.State == "" {
			t.Fatalf("%s: %+v %v", name, sp, err)
		}
	}
	for name, exit := range map[string]*int{"pitcher/shell.ShellCreate.terminal.json": nil, "pitcher/shell.ShellCreate.finished.json": new(0), "pitcher/shell.ShellOpen.command.json": nil} {
		var sh Shell
		if err := msgpack.Unmarshal(toMsgpack(t, name), &sh); err != nil || sh.ShellID == "" || (sh.ExitCode == nil) != (exit == nil) {
			t.Fatalf("%s: %+v %v", name, sh, err)
		}
	}
	var list struct {
		Shells []Shell `msgpack:"shells"`
	}
	if err := msgpack.Unmarshal(toMsgpack(t, "pitcher/shell.ShellList.json"), &list); err != nil || len(list.Shells) != 2 || *list.Shells[1].ExitCode != 130 {
		t.Fatalf("shell/list: %+v %v", list, err)
	}
	var st FileStat
	if err := msgpack.Unmarshal(toMsgpack(t, "pitcher/fs.FSStatMessage.json"), &st); err != nil || st.Size != 12 || st.Type != 0 {
		t.Fatalf("fs/stat: %+v %v", st, err)
	}
	var ports struct {
		List []Port `msgpack:"list"`
	}
	if err := msgpack.Unmarshal(toMsgpack(t, "pitcher/port.PortList.json"), &ports); err != nil || ports.List[0].Port != 5173 {
		t.Fatalf("port/list: %+v %v", ports, err)
	}
	var tasks struct {
		Tasks map[string]Task `msgpack:"tasks"`
	}
	if err := msgpack.Unmarshal(toMsgpack(t, "pitcher/task.TaskList.json"), &tasks); err != nil ||
		devShell(tasks.Tasks) != "sh_dev" || tasks.Tasks["build"].Shell != nil {
		t.Fatalf("task/list: %+v %v", tasks, err)
	}
	one := 1
	for name, errno := range map[string]*int{"pitcher/fs.FSReadFileMessage.error.json": new(2), "pitcher/fs.FSStatMessage.error.json": nil} {
		pe, ok := pitcherError("fs/readFile", inMsg{ID: &one, Error: toMsgpack(t, name), hasID: true, hasError: true}).(*PitcherError)
		if !ok || pe.Code != PitcherRawFSError || (pe.Errno == nil) != (errno == nil) || (errno != nil && *pe.Errno != *errno) {
			t.Fatalf("%s: %+v", name, pe)
		}
	}
}

// asJSON turns a generically decoded msgpack value into JSON.
func asJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestFakeAgentFollowsSDKTypes(t *testing.T) {
	f := newFake(t)
	f.AddTemplate(reactTpl, map[string][]byte{"README.md": []byte("template")}, 5173)
	f.SetSetupTasks(reactTpl, "npm ci")
	sr := startVM(t, f, reactTpl)
	p := dial(t, sr, nil)
	cx := ctx(t)
	call := func(method string, params any, fixtures ...string) map[string]any {
		t.Helper()
		var out map[string]any
		if err := p.Call(cx, method, params, &out); err != nil {
			t.Fatalf("%s: %v", method, err)
		}
		conforms(t, method, asJSON(t, out), fixtures...)
		return out
	}
	setup := []string{"pitcher/setup.SetupGetMessage.idle.json", "pitcher/setup.SetupGetMessage.running.json", "pitcher/setup.SetupStatusNotification.json"}
	call("client/join", joinParams(), "pitcher/client.ClientJoinMessage.full.json", "pitcher/client.ClientJoinMessage.sparse.json")
	call("setup/get", struct{}{}, setup...)
	n := 0
	for _, c := range f.PitcherCalls() {
		if c.FromAgent && c.Method == "setup/progress" {
			n++
			conforms(t, "setup/progress notification", asJSON(t, c.Params), setup...)
		}
	}
	if n == 0 {
		t.Fatal("no setup/progress seen")
	}
	call("fs/mkdir", map[string]any{"path": "/project/workspace/d", "recursive": true}, "pitcher/fs.FSMkdirMessage.json")
	call("fs/writeFile", map[string]any{"path": "/project/workspace/d/f", "content": []byte("x")}, "pitcher/fs.FSWriteFileMessage.json")
	call("fs/stat", map[string]any{"path": "/project/workspace/d/f"}, "pitcher/fs.FSStatMessage.json")
	sh := call("shell/create", map[string]any{"command": "true", "type": "TERMINAL", "isSystemShell": true, "size": defaultSize},
		"pitcher/shell.ShellCreate.terminal.json", "pitcher/shell.ShellCreate.finished.json")
	call("shell/list", struct{}{}, "pitcher/shell.ShellList.json")
	call("shell/open", map[string]any{"shellId": "sh_dev", "size": defaultSize}, "pitcher/shell.ShellOpen.command.json")
	call("shell/terminate", map[string]any{"shellId": sh["shellId"]}, "pitcher/shell.ShellTerminate.json", "pitcher/shell.ShellTerminate.exited.json")
	call("port/list", struct{}{}, "pitcher/port.PortList.json")
	call("task/list", struct{}{}, "pitcher/task.TaskList.json", "pitcher/task.TaskList.sparse.json")
	call("fs/readdir", map[string]any{"path": "/project/workspace"}, "pitcher/fs.FSReadDirMessage.json")
	call("fs/remove", map[string]any{"path": "/project/workspace/d", "recursive": true}, "pitcher/fs.FSRemoveMessage.json")
}

// TestFakeRealShellFollowsSDKTypes holds the fake's real shell (what the
// hosted sessions backend is tested on) to the same types: shell/in, and
// the notifications it streams.
func TestFakeRealShellFollowsSDKTypes(t *testing.T) {
	f := csbfake.New(t, testKey, csbfake.WithRealShell())
	p := dial(t, startVM(t, f, UniversalTemplate), nil)
	cx := ctx(t)
	var out strings.Builder
	sh, err := p.Stream(cx, "read line; echo \"got $line\"; exit 3", "", func(c string) { out.WriteString(c) })
	if err != nil {
		t.Fatal(err)
	}
	var res map[string]any
	if err := p.Call(cx, "shell/in", map[string]any{"shellId": sh.ID, "input": "hi\n", "size": defaultSize}, &res); err != nil {
		t.Fatalf("shell/in: %v", err)
	}
	conforms(t, "shell/in", asJSON(t, res), "pitcher/shell.ShellIn.json")
	<-sh.Done()
	if code, err := sh.Exit(); code != 3 || err != nil || !strings.Contains(out.String(), "got hi") {
		t.Fatalf("exit %d %v, output %q", code, err, out.String())
	}
	seen := map[string]int{}
	for _, c := range f.PitcherCalls() {
		switch {
		case !c.FromAgent:
		case c.Method == "shell/out":
			conforms(t, "shell/out", asJSON(t, c.Params), "pitcher/shell.ShellOutNotification.json")
		case c.Method == "shell/exit":
			conforms(t, "shell/exit", asJSON(t, c.Params), "pitcher/shell.ShellExitNotification.json")
		default:
			continue
		}
		seen[c.Method]++
	}
	if seen["shell/out"] == 0 || seen["shell/exit"] != 1 {
		t.Fatalf("notifications %v", seen)
	}
	// fs/remove follows FSRemoveParams: a directory needs recursive.
	if err := p.Mkdir(cx, "/project/workspace/d/e", true); err != nil {
		t.Fatal(err)
	}
	var pe *PitcherError
	if err := p.Remove(cx, "/project/workspace/d", false); !errors.As(err, &pe) || pe.Code != PitcherRawFSError {
		t.Fatalf("non-recursive remove of a directory: %v", err)
	}
	if err := p.Remove(cx, "/project/workspace/d", true); err != nil {
		t.Fatal(err)
	}
	if ents, err := p.ReadDir(cx, "/project/workspace"); err != nil || len(ents) != 0 {
		t.Fatalf("readdir after remove: %+v %v", ents, err)
	}
}
