package csbfake

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/vmihailenco/msgpack/v5"
)

const key = "csb_v1_fake_test_key"

type envelope struct {
	Success bool            `json:"success"`
	Errors  []any           `json:"errors"`
	Data    json.RawMessage `json:"data"`
}

// do sends a raw request; body "" sends none.
func do(t *testing.T, s *Server, method, path, auth, body string) (int, http.Header, envelope, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, s.URL()+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var env envelope
	_ = json.Unmarshal(raw, &env)
	return resp.StatusCode, resp.Header, env, raw
}

func bearer() string { return "Bearer " + key }

func TestAuthRequired(t *testing.T) {
	s := New(t, key)
	for _, auth := range []string{"", "Bearer wrong", "Basic " + key, "bearer " + key} {
		code, h, env, _ := do(t, s, "GET", "/meta/info", auth, "")
		if code != http.StatusUnauthorized || env.Success || len(env.Errors) == 0 {
			t.Errorf("auth %q: %d %+v", auth, code, env)
		}
		if h.Get("x-csb-rate-hourly-remaining") == "" {
			t.Errorf("auth %q: no rate-limit headers on the error", auth)
		}
	}
	reqs := s.Requests()
	if len(reqs) != 4 || reqs[0].Authorized || reqs[0].Status != 401 {
		t.Fatalf("requests: %+v", reqs)
	}
	// A bare MetaInformation, not an envelope (types.gen.d.ts:955-959).
	code, _, _, raw := do(t, s, "GET", "/meta/info", bearer(), "")
	if code != 200 || !bytes.HasPrefix(raw, []byte(`{"api":`)) || !bytes.Contains(raw, []byte(`"team"`)) {
		t.Fatalf("authorized: %d %s", code, raw)
	}
	if r := s.Requests()[4]; !r.Authorized || r.Status != 200 {
		t.Fatalf("record: %+v", r)
	}
}

func TestHeadersOnEveryResponse(t *testing.T) {
	s := New(t, key)
	_, h, _, _ := do(t, s, "GET", "/sandbox/nosuch", bearer(), "")
	for _, k := range []string{"x-csb-sandbox-hourly-remaining", "x-csb-sandbox-hourly-reset", "x-csb-sandbox-hourly-used",
		"x-csb-rate-hourly-remaining", "x-csb-rate-hourly-reset", "x-csb-rate-hourly-used", "x-csb-vms-remaining", "x-csb-vms-used"} {
		if h.Get(k) == "" {
			t.Errorf("missing %s", k)
		}
	}
}

func TestStrictPathsAndMethods(t *testing.T) {
	s := New(t, key)
	cases := []struct {
		method, path string
		code         int
		allow        string
	}{
		{"GET", "/sandboxes", 404, ""},
		{"GET", "/vm/abc/stop", 404, ""},
		{"POST", "/sandbox/abc/forks", 404, ""},
		{"POST", "/meta/info", 405, "GET"},
		{"GET", "/sandbox/" + UniversalTemplate + "/fork", 405, "POST"},
		{"PUT", "/vm/abc/start", 405, "POST"},
		{"GET", "/vm/abc", 405, "DELETE"},
		{"POST", "/vm/abc", 405, "DELETE"},
	}
	for _, c := range cases {
		code, h, env, _ := do(t, s, c.method, c.path, bearer(), "")
		if code != c.code || h.Get("Allow") != c.allow || env.Success || len(env.Errors) == 0 {
			t.Errorf("%s %s: %d Allow=%q %+v (want %d %q)", c.method, c.path, code, h.Get("Allow"), env, c.code, c.allow)
		}
	}
	// Query parameters exist only on the list.
	id, _ := fork(t, s, `{}`)
	for _, q := range []string{"/meta/info?x=1", "/sandbox/" + id + "?fields=all", "/vm/running?all=1"} {
		if code, _, _, _ := do(t, s, "GET", q, bearer(), ""); code != 422 {
			t.Errorf("GET %s: %d", q, code)
		}
	}
	if code, _, _, _ := do(t, s, "POST", "/vm/"+id+"/start?tier=Pico", bearer(), `{}`); code != 422 {
		t.Errorf("start with a query: %d", code)
	}
	if st, _ := s.Sandbox(id); st.Running {
		t.Fatal("a refused start started the VM")
	}
}

func TestFieldNamesAreCaseSensitive(t *testing.T) {
	s := New(t, key)
	for _, body := range []string{
		`{"Privacy":2}`,
		`{"privacy":2,"Private_Preview":true}`,
		`{"Start_Options":{}}`,
		`{"start_options":{"Tier":"Pico"}}`,
		`{"start_options":{"automatic_wakeup_config":{"HTTP":true}}}`,
	} {
		code, _, env, _ := do(t, s, "POST", "/sandbox/"+UniversalTemplate+"/fork", bearer(), body)
		if code != 422 || env.Success {
			t.Errorf("%s: %d", body, code)
		}
	}
	id, _ := fork(t, s, `{}`)
	if code, _, _, _ := do(t, s, "POST", "/sandbox/"+id+"/tokens", bearer(), `{"expiresAt":"2099-01-01T00:00:00Z"}`); code != 422 {
		t.Errorf("camelCase expires_at: %d", code)
	}
	if code, _, _, _ := do(t, s, "POST", "/vm/"+id+"/start", bearer(), `{"Hibernation_Timeout_Seconds":60}`); code != 422 {
		t.Errorf("start with a case variant: %d", code)
	}
	// The exact names still work.
	fork(t, s, `{"privacy":2,"private_preview":true,"start_options":{"tier":"Pico","automatic_wakeup_config":{"http":true,"websocket":false}}}`)
}

func TestAwaitWakesOnChange(t *testing.T) {
	s := New(t, key)
	id, _ := fork(t, s, `{}`)
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		done <- s.Await(ctx, func() bool { st, _ := s.Sandbox(id); return st.Running })
	}()
	startVM(t, s, id)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Await(ctx, func() bool { return false }); err == nil {
		t.Fatal("Await ignored its context")
	}
}

func fork(t *testing.T, s *Server, body string) (string, map[string]any) {
	t.Helper()
	code, _, env, raw := do(t, s, "POST", "/sandbox/"+UniversalTemplate+"/fork", bearer(), body)
	if code != 201 || !env.Success {
		t.Fatalf("fork: %d %s", code, raw)
	}
	var d map[string]any
	if err := json.Unmarshal(env.Data, &d); err != nil {
		t.Fatal(err)
	}
	return d["id"].(string), d
}

func TestForkStrictBody(t *testing.T) {
	s := New(t, key)
	bad := map[string]int{
		`{"privacy":2,"colour":"red"}`:                                          422,
		`{"privacy":"2"}`:                                                       422,
		`{"start_option":{"tier":"Pico"}}`:                                      422,
		`{"start_options":{"tier":"Tiny"}}`:                                     422,
		`{"start_options":{"hibernation_timeout_seconds":0}}`:                   422,
		`{"start_options":{"ipcountry":"nl"}}`:                                  422,
		`{"start_options":{"automatic_wakeup_config":{"http":true,"ws":true}}}`: 422,
		`{"privacy":7}`:                                                         422,
		`{"privacy":2`:                                                          400,
		`{"privacy":2} {}`:                                                      400,
	}
	for body, want := range bad {
		code, _, env, _ := do(t, s, "POST", "/sandbox/"+UniversalTemplate+"/fork", bearer(), body)
		if code != want || env.Success || len(env.Errors) == 0 {
			t.Errorf("%s: %d (want %d) %+v", body, code, want, env)
		}
	}
	if st, _ := s.Sandbox(UniversalTemplate); st.ID == "" {
		t.Fatal("template missing")
	}
	code, _, _, _ := do(t, s, "POST", "/sandbox/nosuch/fork", bearer(), `{}`)
	if code != 404 {
		t.Fatalf("fork of a missing sandbox: %d", code)
	}

	id, d := fork(t, s, `{"privacy":2,"private_preview":true,"tags":["x"],"start_options":{"tier":"Pico","hibernation_timeout_seconds":60}}`)
	sr, ok := d["start_response"].(map[string]any)
	if !ok || sr["bootup_type"] != "FORK" || sr["pitcher_token"] == "" || !strings.HasPrefix(sr["pitcher_url"].(string), "ws://") {
		t.Fatalf("start_response: %+v", d)
	}
	st, _ := s.Sandbox(id)
	if !st.Running || st.Privacy != 2 || !st.PrivatePreview || st.Tier != "Pico" || st.HibernationSec != 60 || st.Tags[0] != "x" {
		t.Fatalf("state: %+v", st)
	}
	// The Sandbox schema has no run state.
	_, _, env, _ := do(t, s, "GET", "/sandbox/"+id, bearer(), "")
	var sb map[string]any
	_ = json.Unmarshal(env.Data, &sb)
	for _, k := range []string{"running", "status", "state"} {
		if _, ok := sb[k]; ok {
			t.Errorf("sandbox has %q", k)
		}
	}
	if sb["id"] != id || sb["privacy"] != float64(2) {
		t.Fatalf("sandbox: %+v", sb)
	}
	// Without start_options nothing starts.
	id2, d2 := fork(t, s, `{}`)
	if _, ok := d2["start_response"]; ok {
		t.Fatal("start_response without start_options")
	}
	if st, _ := s.Sandbox(id2); st.Running {
		t.Fatal("fork without start_options is running")
	}
}

func startVM(t *testing.T, s *Server, id string) map[string]any {
	t.Helper()
	code, _, env, raw := do(t, s, "POST", "/vm/"+id+"/start", bearer(), `{}`)
	if code != 200 {
		t.Fatalf("start: %d %s", code, raw)
	}
	var d map[string]any
	_ = json.Unmarshal(env.Data, &d)
	return d
}

func TestLifecycle(t *testing.T) {
	s := New(t, key)
	id, _ := fork(t, s, `{}`)
	if d := startVM(t, s, id); d["bootup_type"] != "FORK" {
		t.Fatalf("first start: %v", d["bootup_type"])
	}
	if d := startVM(t, s, id); d["bootup_type"] != "RUNNING" {
		t.Fatalf("start while running: %v", d["bootup_type"])
	}
	_, _, env, _ := do(t, s, "GET", "/vm/running", bearer(), "")
	if !bytes.Contains(env.Data, []byte(id)) {
		t.Fatalf("running: %s", env.Data)
	}
	if code, _, _, _ := do(t, s, "POST", "/vm/"+id+"/hibernate", bearer(), `{"now":true}`); code != 422 {
		t.Fatalf("hibernate with an unknown field: %d", code)
	}
	if code, _, _, _ := do(t, s, "POST", "/vm/"+id+"/hibernate", bearer(), `{}`); code != 200 {
		t.Fatalf("hibernate: %d", code)
	}
	if code, _, _, _ := do(t, s, "POST", "/vm/"+id+"/hibernate", bearer(), `{}`); code != 404 {
		t.Fatalf("hibernate when not running: %d", code)
	}
	if d := startVM(t, s, id); d["bootup_type"] != "RESUME" {
		t.Fatalf("after hibernate: %v", d["bootup_type"])
	}
	if code, _, _, _ := do(t, s, "POST", "/vm/"+id+"/shutdown", bearer(), `{}`); code != 200 {
		t.Fatalf("shutdown: %d", code)
	}
	if code, _, _, _ := do(t, s, "POST", "/vm/"+id+"/shutdown", bearer(), `{}`); code != 404 {
		t.Fatalf("shutdown when not running: %d", code)
	}
	if d := startVM(t, s, id); d["bootup_type"] != "CLEAN" {
		t.Fatalf("after shutdown: %v", d["bootup_type"])
	}
	if code, _, _, _ := do(t, s, "DELETE", "/vm/"+UniversalTemplate, bearer(), ""); code != 403 {
		t.Fatalf("delete a template: %d", code)
	}
	if code, _, _, _ := do(t, s, "DELETE", "/vm/"+id, bearer(), ""); code != 200 {
		t.Fatalf("delete: %d", code)
	}
	if code, _, _, _ := do(t, s, "GET", "/sandbox/"+id, bearer(), ""); code != 404 {
		t.Fatalf("get after delete: %d", code)
	}
	if code, _, _, _ := do(t, s, "DELETE", "/vm/"+id, bearer(), ""); code != 404 {
		t.Fatalf("delete twice: %d", code)
	}
	st, _ := s.Sandbox(id)
	if !st.Deleted || st.Running || strings.Join(st.Bootups, ",") != "FORK,RUNNING,RESUME,CLEAN" {
		t.Fatalf("state: %+v", st)
	}
}

func TestListPagination(t *testing.T) {
	s := New(t, key)
	for range 3 {
		fork(t, s, `{"tags":["mine"]}`)
	}
	fork(t, s, `{"tags":["other"]}`)
	var d struct {
		Sandboxes  []map[string]any `json:"sandboxes"`
		Pagination struct {
			CurrentPage  int  `json:"current_page"`
			NextPage     *int `json:"next_page"`
			TotalRecords int  `json:"total_records"`
		} `json:"pagination"`
	}
	_, _, env, _ := do(t, s, "GET", "/sandbox?tags=mine&page_size=2", bearer(), "")
	_ = json.Unmarshal(env.Data, &d)
	if len(d.Sandboxes) != 2 || d.Pagination.NextPage == nil || *d.Pagination.NextPage != 2 || d.Pagination.TotalRecords != 3 {
		t.Fatalf("page 1: %+v", d)
	}
	d.Pagination.NextPage = nil
	_, _, env, _ = do(t, s, "GET", "/sandbox?tags=mine&page_size=2&page=2", bearer(), "")
	if !bytes.Contains(env.Data, []byte(`"next_page":null`)) {
		t.Fatalf("last page must have next_page null: %s", env.Data)
	}
	for _, q := range []string{"page_size=0", "page_size=51", "page=0", "order_by=name", "direction=up", "status=stopped", "colour=red"} {
		if code, _, _, _ := do(t, s, "GET", "/sandbox?"+q, bearer(), ""); code != 422 {
			t.Errorf("%s: %d", q, code)
		}
	}
}

func TestFaultsAndRateLimits(t *testing.T) {
	s := New(t, key)
	s.FailNext(429, 1)
	code, h, env, _ := do(t, s, "GET", "/meta/info", bearer(), "")
	if code != 429 || len(env.Errors) == 0 || h.Get("x-csb-vms-remaining") != "0" {
		t.Fatalf("429: %d %v %v", code, env, h)
	}
	reset := time.Now().Add(20 * time.Minute).Truncate(time.Second)
	s.Inject(Fault{Status: 429, N: 1, Budget: "requests", Reset: reset, NoErrors: true})
	code, h, _, raw := do(t, s, "GET", "/meta/info", bearer(), "")
	if code != 429 || h.Get("x-csb-rate-hourly-remaining") != "0" || h.Get("x-csb-rate-hourly-reset") != itoa(reset.Unix()) || bytes.Contains(raw, []byte("errors")) {
		t.Fatalf("429 without errors: %d %s %v", code, raw, h)
	}
	s.Inject(Fault{Status: 502, N: 1, Path: "/vm/running"})
	if code, _, _, _ := do(t, s, "GET", "/meta/info", bearer(), ""); code != 200 {
		t.Fatalf("a path-restricted fault hit another path: %d", code)
	}
	code, _, _, raw = do(t, s, "GET", "/vm/running", bearer(), "")
	if code != 502 || !bytes.Contains(raw, []byte("Bad Gateway")) {
		t.Fatalf("502: %d %s", code, raw)
	}
	if code, _, _, _ := do(t, s, "GET", "/vm/running", bearer(), ""); code != 200 {
		t.Fatalf("fault not used up: %d", code)
	}

	// Real budgets: the concurrent-VM limit refuses a start.
	s.SetLimits(Limits{RequestsHourly: 1000, SandboxesHourly: 1000, ConcurrentVMs: 1})
	a, _ := fork(t, s, `{}`)
	b, _ := fork(t, s, `{}`)
	startVM(t, s, a)
	code, h, _, _ = do(t, s, "POST", "/vm/"+b+"/start", bearer(), `{}`)
	if code != 429 || h.Get("x-csb-vms-remaining") != "0" {
		t.Fatalf("VM limit: %d %v", code, h)
	}
	// And the request budget.
	s.SetLimits(Limits{RequestsHourly: 0, SandboxesHourly: 1000, ConcurrentVMs: 1})
	code, h, _, _ = do(t, s, "GET", "/meta/info", bearer(), "")
	if code != 429 || h.Get("x-csb-rate-hourly-remaining") != "0" {
		t.Fatalf("request limit: %d %v", code, h)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

func TestDelayHonoursClientCancel(t *testing.T) {
	s := New(t, key)
	s.Inject(Fault{N: 1, Delay: time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", s.URL()+"/meta/info", nil)
	req.Header.Set("Authorization", bearer())
	start := time.Now()
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("delayed request answered")
	}
	if time.Since(start) > 10*time.Second {
		t.Fatal("delay ignored the client's cancel")
	}
}

// TestHoldNext: the held request is answered, as usual, only once
// released; others pass meanwhile.
func TestHoldNext(t *testing.T) {
	s := New(t, key)
	held, release := s.HoldNext("GET", "/meta/info")
	defer release()
	answered := make(chan *http.Response, 1)
	go func() {
		req, _ := http.NewRequest("GET", s.URL()+"/meta/info", nil)
		req.Header.Set("Authorization", bearer())
		resp, _ := http.DefaultClient.Do(req)
		answered <- resp
	}()
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the request was not held")
	}
	if code, _, _, _ := do(t, s, "GET", "/meta/info", bearer(), ""); code != http.StatusOK {
		t.Fatalf("the next request: %d", code)
	}
	select {
	case <-answered:
		t.Fatal("the held request was answered before its release")
	default:
	}
	release()
	resp := <-answered
	if resp == nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("the held request after its release: %+v", resp)
	}
	resp.Body.Close()
}

// ---- Pitcher ----

type agent struct {
	t  *testing.T
	c  *websocket.Conn
	id int
}

func dialAgent(t *testing.T, s *Server, sandboxID string, token string) (*agent, *http.Response, error) {
	t.Helper()
	u, _ := url.Parse(s.URL())
	ws := "ws://" + u.Host + "/pitcher/" + sandboxID + "/?token=" + url.QueryEscape(token)
	c, resp, err := websocket.Dial(context.Background(), ws, nil)
	if err != nil {
		return nil, resp, err
	}
	c.SetReadLimit(64 << 20)
	t.Cleanup(func() { _ = c.CloseNow() })
	return &agent{t: t, c: c}, resp, nil
}

// call sends a request and returns its response, collecting
// notifications that arrive before it.
func (a *agent) call(method string, params any) (map[string]any, []map[string]any) {
	a.t.Helper()
	id := a.id
	a.id++
	b, _ := msgpack.Marshal(map[string]any{"id": id, "method": method, "params": params})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.c.Write(ctx, websocket.MessageBinary, b); err != nil {
		a.t.Fatal(err)
	}
	var notes []map[string]any
	for {
		m := a.read(ctx)
		if rid, ok := m["id"]; ok && toInt(rid) == id {
			return m, notes
		}
		notes = append(notes, m)
	}
}

func (a *agent) read(ctx context.Context) map[string]any {
	a.t.Helper()
	for {
		typ, data, err := a.c.Read(ctx)
		if err != nil {
			a.t.Fatalf("read: %v", err)
		}
		if typ != websocket.MessageBinary {
			continue
		}
		var m map[string]any
		if err := msgpack.Unmarshal(data, &m); err != nil {
			a.t.Fatal(err)
		}
		return m
	}
}

// until reads notifications until one has method.
func (a *agent) until(method string) []map[string]any {
	a.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []map[string]any
	for {
		m := a.read(ctx)
		got = append(got, m)
		if m["method"] == method {
			return got
		}
	}
}

func toInt(v any) int {
	switch n := v.(type) {
	case int8:
		return int(n)
	case int16:
		return int(n)
	case int32:
		return int(n)
	case int64:
		return int(n)
	case uint8:
		return int(n)
	case uint16:
		return int(n)
	case uint32:
		return int(n)
	case uint64:
		return int(n)
	}
	return -1
}

func joinParams() map[string]any {
	return map[string]any{"clientInfo": map[string]any{"protocolVersion": "0.367.10", "appId": "sdk"}, "asyncProgress": false,
		"subscriptions": map[string]any{"shell": map[string]any{"status": true}}}
}

func TestPitcherToken(t *testing.T) {
	s := New(t, key)
	id, d := fork(t, s, `{"start_options":{}}`)
	tok := d["start_response"].(map[string]any)["pitcher_token"].(string)
	for _, bad := range []string{"", "pt_wrong", key} {
		if _, resp, err := dialAgent(t, s, id, bad); err == nil || resp == nil || resp.StatusCode != 401 {
			t.Errorf("token %q accepted", bad)
		}
	}
	a, _, err := dialAgent(t, s, id, tok)
	if err != nil {
		t.Fatal(err)
	}
	// The token is kept out of the record.
	for _, r := range s.Requests() {
		if r.Query.Has("token") || strings.Contains(r.Path, tok) {
			t.Fatalf("token recorded: %+v", r)
		}
	}
	resp, _ := a.call("fs/readFile", map[string]any{"path": "x"})
	if toInt(resp["status"]) != 1 || toInt(resp["error"].(map[string]any)["code"]) != codeNoAccess {
		t.Fatalf("call before join: %v", resp)
	}
	resp, _ = a.call("client/join", joinParams())
	if toInt(resp["status"]) != 0 || resp["method"] != "client/join" {
		t.Fatalf("join: %v", resp)
	}
	// A VM that stops takes its tokens with it.
	do(t, s, "POST", "/vm/"+id+"/shutdown", bearer(), `{}`)
	if _, resp, err := dialAgent(t, s, id, tok); err == nil || resp.StatusCode != 401 {
		t.Fatal("old token accepted after shutdown")
	}
}

func joined(t *testing.T, s *Server, files map[string][]byte, port int) (*agent, string) {
	t.Helper()
	s.AddTemplate("tpl", files, port)
	code, _, env, raw := do(t, s, "POST", "/sandbox/tpl/fork", bearer(), `{"start_options":{"tier":"Pico"}}`)
	if code != 201 {
		t.Fatalf("fork: %s", raw)
	}
	var d struct {
		ID string `json:"id"`
		SR struct {
			Token string `json:"pitcher_token"`
		} `json:"start_response"`
	}
	_ = json.Unmarshal(env.Data, &d)
	a, _, err := dialAgent(t, s, d.ID, d.SR.Token)
	if err != nil {
		t.Fatal(err)
	}
	if r, _ := a.call("client/join", joinParams()); toInt(r["status"]) != 0 {
		t.Fatalf("join: %v", r)
	}
	return a, d.ID
}

func TestPitcherFS(t *testing.T) {
	s := New(t, key)
	a, id := joined(t, s, map[string][]byte{"README.md": []byte("hi")}, 0)
	if r, _ := a.call("fs/readFile", map[string]any{"path": "/project/workspace/README.md"}); toInt(r["status"]) != 0 ||
		string(r["result"].(map[string]any)["content"].([]byte)) != "hi" {
		t.Fatalf("template file: %v", r)
	}
	r, _ := a.call("fs/writeFile", map[string]any{"path": "src/a.js", "content": []byte("x"), "create": true, "overwrite": true})
	if toInt(r["status"]) != 1 || toInt(r["error"].(map[string]any)["data"].(map[string]any)["errno"]) != errENOENT {
		t.Fatalf("write without parent: %v", r)
	}
	if r, _ := a.call("fs/mkdir", map[string]any{"path": "/project/workspace/src", "recursive": true}); toInt(r["status"]) != 0 {
		t.Fatalf("mkdir: %v", r)
	}
	if r, _ := a.call("fs/writeFile", map[string]any{"path": "src/a.js", "content": []byte("x"), "create": true, "overwrite": true}); toInt(r["status"]) != 0 {
		t.Fatalf("write: %v", r)
	}
	if r, _ := a.call("fs/writeFile", map[string]any{"path": "src/a.js", "content": []byte("y"), "overwrite": false}); toInt(r["status"]) != 1 {
		t.Fatalf("overwrite=false over a file: %v", r)
	}
	if r, _ := a.call("fs/writeFile", map[string]any{"path": "src/b.js", "contents": []byte("x")}); toInt(r["status"]) != 1 {
		t.Fatalf("wrong field name accepted: %v", r)
	}
	if r, _ := a.call("fs/stat", map[string]any{"path": "src"}); toInt(r["result"].(map[string]any)["type"]) != 1 {
		t.Fatalf("stat dir: %v", r)
	}
	if st, _ := s.Sandbox(id); string(st.Files["/project/workspace/src/a.js"]) != "x" {
		t.Fatalf("files: %v", st.Files)
	}
	if r, _ := a.call("no/such", map[string]any{}); toInt(r["status"]) != 1 {
		t.Fatalf("unknown method: %v", r)
	}
}

func shellRun(t *testing.T, a *agent, cmd string) (string, int, []map[string]any) {
	t.Helper()
	r, early := a.call("shell/create", map[string]any{"command": cmd, "cwd": "/project/workspace", "size": map[string]any{"cols": 128, "rows": 24}, "type": "TERMINAL", "isSystemShell": true})
	if toInt(r["status"]) != 0 {
		t.Fatalf("shell/create: %v", r)
	}
	id := r["result"].(map[string]any)["shellId"]
	notes := append(early, a.until("shell/exit")...)
	var out strings.Builder
	code := -1
	for _, n := range notes {
		p, _ := n["params"].(map[string]any)
		if p["shellId"] != id {
			continue
		}
		switch n["method"] {
		case "shell/out":
			out.WriteString(p["out"].(string))
		case "shell/exit":
			code = toInt(p["exitCode"])
		}
	}
	return out.String(), code, notes
}

func TestPitcherShell(t *testing.T) {
	s := New(t, key)
	a, id := joined(t, s, nil, 5173)
	out, code, notes := shellRun(t, a, `bash -c 'echo "it'\''s"  here'`)
	if code != 0 || !strings.Contains(out, "it's here\r\n") || !strings.Contains(out, "[CODESANDBOX]") || !strings.Contains(out, "\x1b[") {
		t.Fatalf("echo: %d %q", code, out)
	}
	if len(notes) < 4 {
		t.Fatalf("output not split into chunks: %d notifications", len(notes))
	}
	if _, code, _ := shellRun(t, a, "rm -rf /"); code != 127 {
		t.Fatalf("unknown command: %d", code)
	}
	if out, code, _ := shellRun(t, a, "npm run build"); code != 1 || !strings.Contains(out, "ENOENT") {
		t.Fatalf("build without package.json: %d %q", code, out)
	}
	s.SetFile(id, "package.json", []byte(`{"scripts":{"build":"vite build"}}`))
	s.SetFile(id, "src/main.js", []byte("console.log(1)"))
	out, code, _ = shellRun(t, a, "npm run build")
	if code != 0 || !strings.Contains(out, "vite build") {
		t.Fatalf("build: %d %q", code, out)
	}
	st, _ := s.Sandbox(id)
	if !strings.Contains(string(st.Files["/project/workspace/dist/index.html"]), "console.log(1)") {
		t.Fatalf("dist: %q", st.Files["/project/workspace/dist/index.html"])
	}
	if out, _, _ := shellRun(t, a, "ls"); !strings.Contains(out, "dist\r\npackage.json\r\nsrc") {
		t.Fatalf("ls: %q", out)
	}
	if out, code, _ := shellRun(t, a, "cat nope"); code != 1 || !strings.Contains(out, "No such file") {
		t.Fatalf("cat: %d %q", code, out)
	}
	// Ports and the dev task.
	r, _ := a.call("port/list", map[string]any{})
	if l := r["result"].(map[string]any)["list"].([]any); len(l) != 1 || toInt(l[0].(map[string]any)["port"]) != 5173 {
		t.Fatalf("ports: %v", r)
	}
	s.AppendDevLog(id, "GET / 200\r\n")
	r, _ = a.call("shell/open", map[string]any{"shellId": devShellID, "size": map[string]any{"cols": 128, "rows": 24}})
	if buf := r["result"].(map[string]any)["buffer"].([]any); !strings.Contains(buf[len(buf)-1].(string), "GET / 200") {
		t.Fatalf("dev buffer: %v", buf)
	}
	// A terminated shell never exits on its own.
	r, _ = a.call("shell/create", map[string]any{"command": "sleep 30"})
	sh := r["result"].(map[string]any)["shellId"]
	r, _ = a.call("shell/terminate", map[string]any{"shellId": sh})
	if r["result"].(map[string]any)["status"] != "KILLED" {
		t.Fatalf("terminate: %v", r)
	}
	if r, _ := a.call("shell/open", map[string]any{"shellId": "sh_nope", "size": map[string]any{"cols": 1, "rows": 1}}); toInt(r["error"].(map[string]any)["code"]) != codeShellNotFound {
		t.Fatalf("missing shell: %v", r)
	}
}

func TestPitcherHibernate(t *testing.T) {
	s := New(t, key)
	a, id := joined(t, s, nil, 0)
	if !s.HibernateVM(id) {
		t.Fatal("HibernateVM")
	}
	got := a.until("system/hibernate")
	if got[len(got)-1]["method"] != "system/hibernate" {
		t.Fatal("no system/hibernate")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, _, err := a.c.Read(ctx); err == nil {
		t.Fatal("connection still open after hibernation")
	}
	if st, _ := s.Sandbox(id); st.Running || st.Connections != 0 {
		t.Fatalf("state: %+v", st)
	}
}

func TestShellWords(t *testing.T) {
	cases := map[string][]string{
		`echo a  b`:               {"echo", "a", "b"},
		`bash -c 'npm run build'`: {"bash", "-c", "npm run build"},
		`'it'\''s'`:               {"it's"},
		`"a \"b\" c"`:             {`a "b" c`},
		`a\ b`:                    {"a b"},
		``:                        nil,
	}
	for in, want := range cases {
		got, err := ShellWords(in)
		if err != nil || strings.Join(got, "|") != strings.Join(want, "|") || len(got) != len(want) {
			t.Errorf("%q: %q %v", in, got, err)
		}
	}
	for _, in := range []string{`a; b`, `a && b`, `a | b`, `'open`, `"open`, `$(x)`, "`x`", `"$HOME"`, `a\`} {
		if _, err := ShellWords(in); err == nil {
			t.Errorf("%q accepted", in)
		}
	}
}

func FuzzShellWords(f *testing.F) {
	for _, s := range []string{`bash -c 'echo '\''x'\'''`, `"a\"b"`, `a\ b c`, `;`, ``} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		words, err := ShellWords(s)
		if err != nil {
			return
		}
		// Every word re-quoted splits back to itself.
		var q []string
		for _, w := range words {
			q = append(q, "'"+strings.ReplaceAll(w, "'", `'\''`)+"'")
		}
		again, err := ShellWords(strings.Join(q, " "))
		if err != nil || len(again) != len(words) {
			t.Fatalf("%q → %q → %q %v", s, words, again, err)
		}
		for i := range words {
			if again[i] != words[i] {
				t.Fatalf("%q: word %d %q != %q", s, i, again[i], words[i])
			}
		}
	})
}
