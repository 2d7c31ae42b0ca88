package codesandbox

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
)

// startVM forks a running sandbox from tpl and returns its start response.
func startVM(t *testing.T, f *csbfake.Server, tpl string) *StartResponse {
	t.Helper()
	c := newClient(t, f, nil, nil)
	fr, err := c.Fork(ctx(t), tpl, ForkRequest{StartOptions: &StartOptions{Tier: "Pico"}})
	if err != nil {
		t.Fatal(err)
	}
	return fr.StartResponse
}

func dial(t *testing.T, sr *StartResponse, mod func(*PitcherOptions)) *Pitcher {
	t.Helper()
	var o PitcherOptions
	if mod != nil {
		mod(&o)
	}
	p, err := DialPitcher(ctx(t), sr.PitcherURL, sr.PitcherToken, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func methods(f *csbfake.Server, id string) []string {
	var m []string
	for _, c := range f.PitcherCalls() {
		if c.SandboxID == id {
			m = append(m, c.Method)
		}
	}
	return m
}

func TestPitcherJoinReadWrite(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, nil)
	if p.Join.WorkspacePath != csbfake.UserWorkspacePath || p.Join.Client.ClientID == "" {
		t.Fatalf("join: %+v", p.Join)
	}
	cx := ctx(t)
	if err := p.Mkdir(cx, "/project/workspace/a/b", true); err != nil {
		t.Fatal(err)
	}
	content := []byte("hello\x00\xffworld")
	if err := p.WriteFile(cx, "/project/workspace/a/b/f.bin", content); err != nil {
		t.Fatal(err)
	}
	got, err := p.ReadFile(cx, "/project/workspace/a/b/f.bin")
	if err != nil || !bytes.Equal(got, content) {
		t.Fatalf("read: %q %v", got, err)
	}
	st, err := p.Stat(cx, "/project/workspace/a/b/f.bin")
	if err != nil || st.Type != 0 || st.Size != int64(len(content)) {
		t.Fatalf("stat: %+v %v", st, err)
	}
	if st, _ := f.Sandbox(sr.ID); !bytes.Equal(st.Files["/project/workspace/a/b/f.bin"], content) {
		t.Fatal("fake did not get the file")
	}
	_, err = p.ReadFile(cx, "/project/workspace/nope")
	var pe *PitcherError
	if !errors.As(err, &pe) || !pe.NotFound() {
		t.Fatalf("missing file: %v", err)
	}
	if m := methods(f, sr.ID); m[0] != "client/join" {
		t.Fatalf("first call %q", m[0])
	}
}

func TestPitcherShellExitCodes(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, nil)
	cx := ctx(t)
	ws := csbfake.UserWorkspacePath
	cases := []struct {
		cmd  string
		out  string
		code int
	}{
		{"echo hello 'quoted world'", "hello quoted world\n", 0},
		{"curl http://evil", "bash: line 1: curl: command not found\n", 127},
		{"cat missing.txt", "cat: missing.txt: No such file or directory\n", 1},
	}
	for _, c := range cases {
		res, err := p.Run(cx, c.cmd, ws, 0)
		if err != nil || string(res.Output) != c.out || res.ExitCode != c.code || res.Truncated {
			t.Errorf("%s: %+v (%q) %v", c.cmd, res, res.Output, err)
		}
	}
	res, err := p.Run(cx, "npm run build", ws, 0)
	if err != nil || res.ExitCode != 1 || !bytes.Contains(res.Output, []byte("Could not read package.json")) {
		t.Fatalf("build without package.json: %+v %v", res, err)
	}
	// Output has neither ANSI codes, CRLF nor the agent's own lines.
	for _, b := range []string{"\x1b", "\r", "[CODESANDBOX]"} {
		if bytes.Contains(res.Output, []byte(b)) {
			t.Fatalf("output contains %q: %q", b, res.Output)
		}
	}
}

func TestPitcherOutputBounded(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	big := bytes.Repeat([]byte("0123456789abcdef"), 16<<10) // 256 KiB
	big = append(big, []byte("THE END\n")...)
	f.SetFile(sr.ID, "big.txt", big)
	p := dial(t, sr, nil)
	res, err := p.Run(ctx(t), "cat big.txt", csbfake.UserWorkspacePath, 1000)
	if err != nil || res.ExitCode != 0 {
		t.Fatal(res, err)
	}
	if len(res.Output) > 1000 || !res.Truncated || !bytes.HasSuffix(big, res.Output) || !bytes.HasSuffix(res.Output, []byte("THE END\n")) {
		t.Fatalf("output %d bytes, truncated=%v, tail %q", len(res.Output), res.Truncated, tail(res.Output, 20))
	}
}

func TestPitcherRunHonoursContext(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, nil)
	cx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	res, err := p.Run(cx, "sleep 60", csbfake.UserWorkspacePath, 0)
	wantCode(t, err, brokererr.SandboxTimeout)
	if res == nil || res.ExitCode != -1 || time.Since(start) > 10*time.Second {
		t.Fatalf("result %+v after %v", res, time.Since(start))
	}
	m := methods(f, sr.ID)
	if m[len(m)-1] != "shell/terminate" {
		t.Fatalf("shell not terminated: %v", m)
	}
	// The connection is still usable.
	if res, err := p.Run(ctx(t), "echo ok", "", 0); err != nil || string(res.Output) != "ok\n" {
		t.Fatal(res, err)
	}
}

func TestPitcherRefusesBadToken(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	const bad = "pt_not_the_token_1234"
	_, err := DialPitcher(ctx(t), sr.PitcherURL, bad, PitcherOptions{})
	wantCode(t, err, brokererr.PermissionDenied)
	if strings.Contains(err.Error(), bad) || strings.Contains(errors.Unwrap(err).Error(), bad) {
		t.Fatalf("token in error: %v / %v", err, errors.Unwrap(err))
	}
	// Plain ws to a non-loopback host is refused before dialling.
	if _, err := DialPitcher(ctx(t), "ws://agent.example.com", "x", PitcherOptions{}); err == nil {
		t.Fatal("ws:// to a remote host accepted")
	}
}

func TestPitcherHeartbeat(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, func(o *PitcherOptions) {
		o.PingInterval = 20 * time.Millisecond
		o.PongTimeout = 300 * time.Millisecond
	})
	await(t, f, "three pings", func() bool { return f.Pings() >= 3 })
	select {
	case <-p.Done():
		t.Fatalf("answered pings closed the connection: %v", p.Err())
	default:
	}
	f.SetSilentPings(true)
	select {
	case <-p.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a silent agent was not dropped")
	}
	if err := p.Call(ctx(t), "port/list", nil, nil); !errors.Is(err, ErrPitcherClosed) {
		t.Fatalf("call on a dropped connection: %v", err)
	}
}

func TestPitcherHibernateEndsConnection(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, nil)
	if !f.HibernateVM(sr.ID) {
		t.Fatal("HibernateVM")
	}
	select {
	case <-p.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("connection survived hibernation")
	}
	if p.Err() == nil || !strings.Contains(p.Err().Error(), "hibernated") {
		t.Fatalf("Err: %v", p.Err())
	}
}

func TestPitcherMessageLimit(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	f.SetFile(sr.ID, "big", bytes.Repeat([]byte("x"), 64<<10))
	p := dial(t, sr, func(o *PitcherOptions) { o.MaxMessageBytes = 16 << 10 })
	if _, err := p.ReadFile(ctx(t), "big"); err == nil {
		t.Fatal("oversize message accepted")
	}
	select {
	case <-p.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("connection not closed after an oversize message")
	}
}

func TestPitcherClose(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, nil)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	<-p.Done()
	if err := p.Call(ctx(t), "port/list", nil, nil); !errors.Is(err, ErrPitcherClosed) {
		t.Fatalf("after Close: %v", err)
	}
	await(t, f, "the fake to see the close", func() bool {
		st, _ := f.Sandbox(sr.ID)
		return st.Connections == 0
	})
}

func TestTailBuffer(t *testing.T) {
	tb := tailBuffer{max: 5}
	for _, s := range []string{"ab", "cd", "efg", "h"} {
		tb.write([]byte(s))
	}
	if string(tb.b) != "defgh" || tb.dropped != 3 {
		t.Fatalf("%q %d", tb.b, tb.dropped)
	}
	tb.write([]byte("0123456789"))
	if string(tb.b) != "56789" || tb.dropped != 13 {
		t.Fatalf("%q %d", tb.b, tb.dropped)
	}
}

func TestStripANSI(t *testing.T) {
	in := "\x1b[1;32mgreen\x1b[0m \x1b]0;title\x07plain\x1b]8;;x\x1b\\ \x1b(Bdone\x1b["
	if got := string(StripANSI([]byte(in))); got != "green plain done" {
		t.Fatalf("%q", got)
	}
}

func TestPitcherJoinParamsAsDocumented(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	dial(t, sr, nil)
	calls := f.PitcherCalls()
	if len(calls) == 0 || calls[0].Method != "client/join" {
		t.Fatalf("calls: %+v", calls)
	}
	p := calls[0].Params
	ci, _ := p["clientInfo"].(map[string]any)
	if ci["protocolVersion"] != ProtocolVersion || ci["appId"] != "sdk" || p["asyncProgress"] != true {
		t.Fatalf("join params: %v", p)
	}
	subs, _ := p["subscriptions"].(map[string]any)
	want := map[string][]string{
		"client": {"status"}, "file": {"status", "selection", "ot"}, "fs": {"operations"}, "git": {"status", "operations"},
		"port": {"status"}, "setup": {"progress"}, "shell": {"status"}, "system": {"metrics"},
	}
	if len(subs) != len(want) {
		t.Fatalf("subscriptions: %v", subs)
	}
	for ns, keys := range want {
		m, _ := subs[ns].(map[string]any)
		if len(m) != len(keys) {
			t.Fatalf("subscriptions[%s]: %v", ns, m)
		}
		for _, k := range keys {
			if m[k] != true {
				t.Fatalf("subscriptions[%s][%s]: %v", ns, k, m)
			}
		}
	}
}

func TestPitcherCommandShape(t *testing.T) {
	f := newFake(t)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, nil)
	if _, err := p.Run(ctx(t), "echo 'a b'", "/project/workspace", 0); err != nil {
		t.Fatal(err)
	}
	if err := p.WriteFile(ctx(t), "/project/workspace/x", []byte("1")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.ListPorts(ctx(t)); err != nil {
		t.Fatal(err)
	}
	byMethod := map[string]map[string]any{}
	for _, c := range f.PitcherCalls() {
		byMethod[c.Method] = c.Params
	}
	sh := byMethod["shell/create"]
	size, _ := sh["size"].(map[string]any)
	if sh["command"] != `bash -c 'echo '\''a b'\'''` || sh["cwd"] != "/project/workspace" || sh["type"] != "TERMINAL" ||
		sh["isSystemShell"] != true || size == nil {
		t.Fatalf("shell/create params: %v", sh)
	}
	w := byMethod["fs/writeFile"]
	if c, ok := w["content"].([]byte); !ok || string(c) != "1" || w["path"] != "/project/workspace/x" || w["create"] != true || w["overwrite"] != true {
		t.Fatalf("fs/writeFile params (content must be msgpack bin): %v", w)
	}
	if pl, ok := byMethod["port/list"]; !ok || len(pl) != 0 {
		t.Fatalf("port/list params: %v", pl)
	}
}

// The SDK routes a response on its result or error key and never reads
// status (dist/esm/index.js:8611-8634); an agent that leaves status out
// must still be answered.
func TestPitcherRoutesResponsesWithoutStatus(t *testing.T) {
	f := newFake(t)
	f.SetResponseStatus(false)
	sr := startVM(t, f, UniversalTemplate)
	p := dial(t, sr, func(o *PitcherOptions) { o.CallTimeout = 3 * time.Second })
	cx := ctx(t)
	if err := p.WriteFile(cx, "/project/workspace/x.txt", []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if b, err := p.ReadFile(cx, "/project/workspace/x.txt"); err != nil || string(b) != "hello" {
		t.Fatalf("%q %v", b, err)
	}
	_, err := p.ReadFile(cx, "/project/workspace/missing")
	var pe *PitcherError
	if !errors.As(err, &pe) || !pe.NotFound() {
		t.Fatalf("error response not routed: %v", err)
	}
}

// After client/join the SDK calls setup/get and, unless that lists steps,
// waits for the first setup/progress before it uses the VM
// (dist/esm/index.js:11066-11082). Nothing is written before then.
func TestPitcherWaitsForSetupProgress(t *testing.T) {
	f := newFake(t)
	release := f.HoldSetup()
	sr := startVM(t, f, UniversalTemplate)
	type dialed struct {
		p   *Pitcher
		err error
	}
	done := make(chan dialed, 1)
	go func() {
		p, err := DialPitcher(ctx(t), sr.PitcherURL, sr.PitcherToken, PitcherOptions{})
		done <- dialed{p, err}
	}()
	await(t, f, "setup/get", func() bool { return slices.Contains(methods(f, sr.ID), "setup/get") })
	release()
	d := <-done
	if d.err != nil {
		t.Fatal(d.err)
	}
	t.Cleanup(func() { _ = d.p.Close() })
	if d.p.Setup.State != "FINISHED" {
		t.Fatalf("setup: %+v", d.p.Setup)
	}
	if err := d.p.WriteFile(ctx(t), "a.txt", []byte("a")); err != nil {
		t.Fatal(err)
	}
	want := []string{"client/join", "setup/get", "setup/progress", "fs/writeFile"}
	if got := methods(f, sr.ID); !slices.Equal(got, want) {
		t.Fatalf("order: %v, want %v", got, want)
	}
}

func TestPitcherSetupThatNeverStartsFailsTheDial(t *testing.T) {
	f := newFake(t)
	defer f.HoldSetup()()
	sr := startVM(t, f, UniversalTemplate)
	_, err := DialPitcher(ctx(t), sr.PitcherURL, sr.PitcherToken, PitcherOptions{CallTimeout: 300 * time.Millisecond})
	if e := wantCode(t, err, brokererr.Unavailable); !e.Retryable {
		t.Fatalf("not retryable: %+v", e)
	}
	if got := methods(f, sr.ID); !slices.Equal(got, []string{"client/join", "setup/get"}) {
		t.Fatalf("calls: %v", got)
	}
}

// A VM whose setup already lists steps is usable at once.
func TestPitcherSetupWithStepsNeedsNoProgress(t *testing.T) {
	f := newFake(t)
	f.AddTemplate("tplsetup", nil, 0)
	f.SetSetupTasks("tplsetup", "npm ci")
	sr := startVM(t, f, "tplsetup")
	first := dial(t, sr, nil) // starts the VM's setup
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	defer f.HoldSetup()() // no progress for the next client
	p := dial(t, sr, func(o *PitcherOptions) { o.CallTimeout = 2 * time.Second })
	if len(p.Setup.Steps) != 1 || p.Setup.Steps[0].Command != "npm ci" {
		t.Fatalf("setup: %+v", p.Setup)
	}
}

// pitcher_url may be https (or http on loopback): the SDK's ws library
// dials those as wss and ws.
func TestPitcherURLSchemes(t *testing.T) {
	for raw, ok := range map[string]bool{
		"wss://abc123-57468.csb.app":        true,
		"https://abc123-57468.csb.app":      true,
		"https://abc123-57468.csb.app/x/":   true,
		"ws://127.0.0.1:8080/pitcher/abc":   true,
		"http://127.0.0.1:8080/pitcher/abc": true,
		"http://localhost:8080":             true,
		"ws://abc123-57468.csb.app":         false,
		"http://abc123-57468.csb.app":       false,
		"ftp://abc123-57468.csb.app":        false,
		"https://user:pw@abc.csb.app":       false,
		"https:///nohost":                   false,
	} {
		u, err := agentURL(raw, "tok/en")
		if (err == nil) != ok {
			t.Errorf("%s: %v", raw, err)
			continue
		}
		if ok && (u.Query().Get("token") != "tok/en" || !strings.HasSuffix(u.Path, "/")) {
			t.Errorf("%s: %s", raw, u)
		}
	}
	f := newFake(t)
	f.SetAgentScheme("http")
	sr := startVM(t, f, UniversalTemplate)
	if !strings.HasPrefix(sr.PitcherURL, "http://") {
		t.Fatalf("fake pitcher_url %s", sr.PitcherURL)
	}
	p := dial(t, sr, nil)
	if err := p.WriteFile(ctx(t), "a", []byte("a")); err != nil {
		t.Fatal(err)
	}
}

// A call the connection's end fails has Done closed by the time it
// returns: a caller that sees ErrPitcherClosed and asks for a connection
// again must not be handed the same dead one (a hosted session's run right
// after its VM hibernated failed that way).
func TestPitcherDoneBeforeCallsFail(t *testing.T) {
	f := newFake(t)
	for i := range 20 {
		sr := startVM(t, f, UniversalTemplate)
		p := dial(t, sr, nil)
		f.SetLatency(0, time.Minute) // the call below stays pending
		errc := make(chan error, 1)
		go func() { errc <- p.Call(ctx(t), "port/list", nil, nil) }()
		await(t, f, "the call to be pending", func() bool { return p.pendingCalls() == 1 })
		if !f.HibernateVM(sr.ID) {
			t.Fatal("HibernateVM")
		}
		err := <-errc
		if !errors.Is(err, ErrPitcherClosed) {
			t.Fatalf("call under hibernation: %v", err)
		}
		select {
		case <-p.Done():
		default:
			t.Fatalf("try %d: the call failed with %v while Done was still open", i, err)
		}
		f.SetLatency(0, 0)
	}
}

func (p *Pitcher) pendingCalls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.pending)
}
