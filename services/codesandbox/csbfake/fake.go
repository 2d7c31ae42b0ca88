// Package csbfake is a strict in-memory stand-in for the CodeSandbox
// management API and the in-VM Pitcher agent, for tests. Its payloads
// follow the published types of @codesandbox/sdk 2.4.2
// (dist/esm/api-clients/client/types.gen.d.ts and
// dist/esm/pitcher-protocol/messages/*.d.ts; the contract tests in the
// parent package hold it to golden fixtures type-checked against them);
// codesandbox-api.md §10 is its checklist for behaviour: exact paths and
// methods, bearer auth, the {success, errors, data} envelope (except on
// GET /meta/info, which the spec answers bare), x-csb-* rate-limit headers
// on every response, refusal of unknown or mistyped fields, and a Pitcher
// WebSocket (msgpack) that needs the token from the start call. It records
// every request so tests can assert what was, or was not, sent.
package csbfake

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// UniversalTemplate is present in every fake, like the real default.
const UniversalTemplate = "pcz35m"

// Paths inside a fake VM (the start response reports them).
const (
	WorkspacePath     = "/project/sandbox"
	UserWorkspacePath = "/project/workspace"
	PitcherVersion    = "0.367.10"
)

const maxBody = 1 << 20

// Request is one recorded HTTP request. Token query parameters are removed
// and the Authorization header is never kept.
type Request struct {
	Method     string
	Path       string
	Query      url.Values
	Body       []byte
	Authorized bool
	Status     int
}

// PitcherCall is one recorded agent request, or with FromAgent a
// notification the agent sent (setup/progress, and the real shell's
// shell/out and shell/exit).
type PitcherCall struct {
	SandboxID string
	Method    string
	// Params as decoded generically (bin → []byte).
	Params    map[string]any
	FromAgent bool
}

// Fault makes the next N matching REST requests fail (after auth).
type Fault struct {
	Status int // 429, 5xx, any 4xx; 0 with Delay only delays
	N      int
	// Budget of a 429: "vms" (default; no reset header), "requests" or
	// "sandboxes" (with a reset header).
	Budget string
	// Reset of an hourly budget; zero means the end of the fake's window.
	Reset time.Time
	// NoErrors sends a 429 body without an errors array (issue #183).
	NoErrors bool
	// Method and Path restrict the fault ("" matches any).
	Method, Path string
	// Delay holds the request this long (or until the client gives up)
	// before answering.
	Delay time.Duration
	// release and held: see HoldNext.
	release <-chan struct{}
	held    chan struct{}
}

// Limits are the workspace's budgets.
type Limits struct {
	RequestsHourly  int
	SandboxesHourly int
	ConcurrentVMs   int
}

// Server is the fake.
type Server struct {
	t      testing.TB
	dir    string // VMs' file systems
	nfs    int
	key    string
	srv    *httptest.Server
	ctx    context.Context
	cancel context.CancelFunc
	mux    *http.ServeMux
	wsWG   sync.WaitGroup
	// shellWG tracks real shells, which outlive their connection.
	shellWG sync.WaitGroup

	mu          sync.Mutex
	reqs        []Request
	reqsGen     int // bumped by ResetRequests: a request open across it keeps no index
	calls       []PitcherCall
	faults      []*Fault
	sandboxes   map[string]*sandbox
	limits      Limits
	window      time.Time
	reqUsed     int
	sbUsed      int
	silentPings bool
	pings       int
	noStatus    bool          // responses without the status key
	agentScheme string        // of pitcher_url: "ws" (default) or "http"
	setupHold   chan struct{} // while open, VM setup does not start (HoldSetup)
	realShell   bool          // WithRealShell
	capDrop     bool          // WithUnprivilegedShell
	restDelay   time.Duration // WithLatency
	agentDelay  time.Duration
	// changed is closed and replaced whenever state may have changed, so
	// Await wakes on events instead of polling.
	changed chan struct{}
}

// New starts a fake that accepts apiKey; it is closed when the test ends.
func New(t testing.TB, apiKey string, opts ...Option) *Server {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		t:           t,
		key:         apiKey,
		ctx:         ctx,
		cancel:      cancel,
		sandboxes:   map[string]*sandbox{},
		limits:      Limits{RequestsHourly: 10000, SandboxesHourly: 200, ConcurrentVMs: 10},
		window:      time.Now().Truncate(time.Second),
		changed:     make(chan struct{}),
		agentScheme: "ws",
	}
	s.dir = t.TempDir()
	for _, o := range opts {
		o(s)
	}
	s.sandboxes[UniversalTemplate] = s.newSandbox(UniversalTemplate, "Universal", true, nil)
	s.routes()
	s.srv = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.Close)
	return s
}

// bumpLocked wakes Await callers; the caller holds s.mu.
func (s *Server) bumpLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// Await returns nil once cond holds, checking it again after every
// request, agent message, ping and connection change, and with the real
// shell (whose commands change files without telling the fake) every
// awaitTick too; ctx bounds the wait. cond may call the Server's accessors.
func (s *Server) Await(ctx context.Context, cond func() bool) error {
	var tick <-chan time.Time
	if s.realShell {
		t := time.NewTicker(awaitTick)
		defer t.Stop()
		tick = t.C
	}
	for {
		s.mu.Lock()
		ch := s.changed
		s.mu.Unlock()
		if cond() {
			return nil
		}
		select {
		case <-ch:
		case <-tick:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

const awaitTick = 20 * time.Millisecond

// Close stops the fake, dropping agent connections first.
func (s *Server) Close() {
	s.mu.Lock()
	for _, sb := range s.sandboxes {
		for _, sh := range sb.shells {
			sh.kill()
		}
	}
	s.mu.Unlock()
	s.cancel()
	s.wsWG.Wait()
	s.shellWG.Wait()
	s.srv.Close()
}

// DropConnections closes the agent connections of sandbox id as a network
// failure would: the VM and what runs in it carry on. It reports how many
// it closed.
func (s *Server) DropConnections(id string) int {
	s.mu.Lock()
	sb := s.sandboxes[id]
	var conns []*agentConn
	if sb != nil {
		conns = slices.Collect(maps.Keys(sb.conns))
	}
	s.mu.Unlock()
	closeConns(conns, false)
	return len(conns)
}

// URL is the management API base URL.
func (s *Server) URL() string { return s.srv.URL }

// Requests returns the REST and WebSocket-upgrade requests so far.
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.reqs)
}

// ResetRequests forgets the recorded requests and agent calls.
func (s *Server) ResetRequests() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reqs, s.calls = nil, nil
	s.reqsGen++
}

// PitcherCalls returns the agent requests so far.
func (s *Server) PitcherCalls() []PitcherCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls)
}

// FailNext makes the next n REST requests answer status (a 429 reports
// the concurrent-VM budget, which has no reset).
func (s *Server) FailNext(status, n int) { s.Inject(Fault{Status: status, N: n}) }

// Inject adds a fault.
func (s *Server) Inject(f Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f.Budget == "" {
		f.Budget = "vms"
	}
	s.faults = append(s.faults, &f)
}

// HoldNext holds the next request to method and path (either "" for any)
// until release is called, then answers it as usual; held is closed once
// that request is being held. Tests order requests across clients with
// it.
func (s *Server) HoldNext(method, path string) (held <-chan struct{}, release func()) {
	rel, h := make(chan struct{}), make(chan struct{})
	s.Inject(Fault{N: 1, Method: method, Path: path, release: rel, held: h})
	var once sync.Once
	return h, func() { once.Do(func() { close(rel) }) }
}

// ClearFaults drops every pending fault.
func (s *Server) ClearFaults() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = nil
}

// SetLimits changes the workspace's budgets.
func (s *Server) SetLimits(l Limits) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.limits = l
}

// SetSilentPings stops the agent from answering heartbeat pings.
func (s *Server) SetSilentPings(silent bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.silentPings = silent
}

// Pings is how many heartbeat pings agents received.
func (s *Server) Pings() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pings
}

// AddTemplate adds a template sandbox with files; port > 0 gives forks a
// dev task (runAtStart, preview on port) whose shell has some output.
func (s *Server) AddTemplate(id string, files map[string][]byte, port int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb := s.newSandbox(id, "Template "+id, true, nil)
	for p, b := range files {
		sb.fs.write(sb.fs.abs(p), b, true)
	}
	sb.devPort = port
	s.sandboxes[id] = sb
}

// SandboxState is a snapshot of one fake sandbox.
type SandboxState struct {
	ID             string
	Title          string
	Privacy        int
	PrivatePreview bool
	Tags           []string
	Path           string
	Running        bool
	Deleted        bool
	Tier           string
	HibernationSec int
	Bootups        []string // bootup_type of every start, in order
	Files          map[string][]byte
	PreviewTokens  int
	Connections    int
}

// Sandbox returns a snapshot of sandbox id.
func (s *Server) Sandbox(id string) (SandboxState, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, ok := s.sandboxes[id]
	if !ok {
		return SandboxState{}, false
	}
	return SandboxState{
		ID: sb.id, Title: sb.title, Privacy: sb.privacy, PrivatePreview: sb.privatePreview,
		Tags: slices.Clone(sb.tags), Path: sb.path, Running: sb.running, Deleted: sb.deleted,
		Tier: sb.tier, HibernationSec: sb.hibernationSec, Bootups: slices.Clone(sb.bootups),
		Files: sb.fs.files(), PreviewTokens: len(sb.previewTokens), Connections: len(sb.conns),
	}, true
}

// SetFile writes a file into a sandbox's VM (absolute, or relative to
// the workspace).
func (s *Server) SetFile(id, p string, content []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sb := s.sandboxes[id]; sb != nil {
		sb.fs.write(sb.fs.abs(p), content, true)
	}
}

// AppendDevLog adds a chunk to the dev task's shell buffer.
func (s *Server) AppendDevLog(id, chunk string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sb := s.sandboxes[id]; sb != nil {
		sb.devLog = append(sb.devLog, chunk)
	}
}

// HibernateVM hibernates a running VM from the server side, as the idle
// timeout would: agents get system/hibernate and are disconnected.
func (s *Server) HibernateVM(id string) bool {
	s.mu.Lock()
	sb := s.sandboxes[id]
	if sb == nil || !sb.running {
		s.mu.Unlock()
		return false
	}
	conns := sb.stop("hibernate")
	s.mu.Unlock()
	closeConns(conns, true)
	return true
}

// sandbox is one fake sandbox and its VM.
type sandbox struct {
	id, title, description string
	privacy                int
	privatePreview         bool
	isFrozen               bool
	path                   string
	tags                   []string
	created, updated       time.Time
	template               bool
	deleted                bool

	running        bool
	lastStop       string // "", "hibernate", "shutdown"
	tier           string
	hibernationSec int
	bootups        []string
	tokens         []string // valid pitcher tokens
	previewTokens  []string
	conns          map[*agentConn]struct{}

	fs         *vmFS
	devPort    int
	devLog     []string
	setupTasks []string // setup task commands (SetSetupTasks)
	setupRan   bool     // since the last clean boot
	shells     map[string]*shell
	nshell     int
}

// newSandbox makes a sandbox whose VM file system is a copy of src's (a
// fresh one when src is nil), in a directory of its own. The caller holds
// s.mu.
func (s *Server) newSandbox(id, title string, template bool, src *vmFS) *sandbox {
	now := time.Now().UTC().Truncate(time.Second)
	s.nfs++
	dir := filepath.Join(s.dir, strconv.Itoa(s.nfs)+"-"+id)
	var vfs *vmFS
	var err error
	if src != nil {
		vfs, err = src.clone(dir)
	} else {
		vfs, err = newFS(dir)
	}
	if err != nil {
		s.t.Errorf("csbfake: VM file system: %v", err)
		vfs, _ = newFS(filepath.Join(s.dir, "broken-"+randHex(4)))
	}
	s.t.Cleanup(vfs.close)
	return &sandbox{
		id: id, title: title, template: template, created: now, updated: now, path: "/",
		tags: []string{}, conns: map[*agentConn]struct{}{}, fs: vfs, shells: map[string]*shell{},
	}
}

// stop ends the VM and returns its connections for the caller to close
// outside the lock.
func (sb *sandbox) stop(how string) []*agentConn {
	sb.running = false
	sb.lastStop = how
	sb.tokens = nil
	conns := slices.Collect(maps.Keys(sb.conns))
	sb.conns = map[*agentConn]struct{}{}
	for _, sh := range sb.shells {
		sh.kill()
	}
	return conns
}

func (sb *sandbox) apiView() map[string]any {
	return map[string]any{
		"id": sb.id, "title": sb.title, "description": nullable(sb.description), "privacy": sb.privacy,
		"is_frozen": sb.isFrozen, "created_at": sb.created.Format(time.RFC3339), "updated_at": sb.updated.Format(time.RFC3339),
		"tags": sb.tags, "settings": map[string]any{"use_pint": false},
	}
}

func nullable(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// ---- HTTP plumbing ----

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	q := r.URL.Query()
	q.Del("token")
	q.Del("preview_token")
	rec := Request{Method: r.Method, Path: r.URL.Path, Query: q, Body: body}
	authorized := s.authorized(r)
	rec.Authorized = authorized
	s.mu.Lock()
	idx, gen := len(s.reqs), s.reqsGen
	s.reqs = append(s.reqs, rec)
	s.mu.Unlock()
	setStatus := func(code int) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if gen == s.reqsGen { // the agent's websocket may outlive a reset
			s.reqs[idx].Status = code
		}
		s.bumpLocked()
	}

	// The agent endpoint authenticates with its own token, not the key.
	if strings.HasPrefix(r.URL.Path, "/pitcher/") {
		setStatus(s.servePitcher(w, r))
		return
	}
	sw := &statusWriter{ResponseWriter: w}
	defer func() { setStatus(sw.status) }()
	if err != nil || len(body) > maxBody {
		s.headers(sw, nil)
		writeError(sw, http.StatusRequestEntityTooLarge, "Request body too large")
		return
	}
	if !authorized {
		s.headers(sw, nil)
		writeError(sw, http.StatusUnauthorized, "Unauthorized")
		return
	}
	if s.fault(sw, r) {
		return
	}
	s.mu.Lock()
	s.rollWindow()
	s.reqUsed++
	over := s.reqUsed > s.limits.RequestsHourly
	s.mu.Unlock()
	if over {
		s.tooMany(sw, &Fault{Budget: "requests"})
		return
	}
	if d, _ := s.latency(); d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		}
	}
	s.headers(sw, nil)
	r.Body = io.NopCloser(bytes.NewReader(body))
	s.mux.ServeHTTP(sw, r)
}

// allowed answers a request whose path exists only with other methods:
// 405 with Allow; false when the path is unknown.
func (s *Server) allowed(w http.ResponseWriter, r *http.Request) bool {
	var allow []string
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		if m == r.Method {
			continue
		}
		r2 := r.Clone(r.Context())
		r2.Method = m
		if _, pat := s.mux.Handler(r2); pat != "" && pat != "/" {
			allow = append(allow, m)
		}
	}
	if len(allow) == 0 {
		return false
	}
	w.Header().Set("Allow", strings.Join(allow, ", "))
	writeError(w, http.StatusMethodNotAllowed, "Method not allowed")
	return true
}

func (s *Server) authorized(r *http.Request) bool {
	h := r.Header.Get("Authorization")
	tok, ok := strings.CutPrefix(h, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(tok), []byte(s.key)) == 1
}

// fault answers r from the first matching fault, if any.
func (s *Server) fault(w http.ResponseWriter, r *http.Request) bool {
	s.mu.Lock()
	var f *Fault
	for i, c := range s.faults {
		if (c.Method == "" || c.Method == r.Method) && (c.Path == "" || c.Path == r.URL.Path) {
			f = c
			if c.N--; c.N <= 0 {
				s.faults = slices.Delete(s.faults, i, i+1)
			}
			break
		}
	}
	s.mu.Unlock()
	if f == nil {
		return false
	}
	if f.Delay > 0 {
		t := time.NewTimer(f.Delay)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return true
		}
	}
	if f.release != nil {
		close(f.held)
		select {
		case <-f.release:
		case <-r.Context().Done():
			return true
		case <-s.ctx.Done():
			return true
		}
	}
	switch {
	case f.Status == 0:
		return false
	case f.Status == http.StatusTooManyRequests:
		s.tooMany(w, f)
	case f.Status == http.StatusBadGateway:
		s.headers(w, nil)
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(f.Status)
		_, _ = io.WriteString(w, "<html><body><h1>502 Bad Gateway</h1></body></html>\n")
	case f.Status == http.StatusServiceUnavailable:
		s.headers(w, nil)
		writeError(w, f.Status, "The sandbox is currently overloaded, please try again later")
	default:
		s.headers(w, nil)
		writeError(w, f.Status, http.StatusText(f.Status))
	}
	return true
}

func (s *Server) tooMany(w http.ResponseWriter, f *Fault) {
	s.headers(w, f)
	if f.NoErrors {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = io.WriteString(w, `{"success":false}`)
		return
	}
	writeError(w, http.StatusTooManyRequests, "Rate limit exceeded")
}

func (s *Server) rollWindow() {
	if time.Since(s.window) >= time.Hour {
		s.window = time.Now().Truncate(time.Second)
		s.reqUsed, s.sbUsed = 0, 0
	}
}

// headers sets the x-csb-* budget headers; f, a 429, exhausts one budget.
// Resets are Unix seconds, the type /meta/info uses [INF].
func (s *Server) headers(w http.ResponseWriter, f *Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rollWindow()
	reset := s.window.Add(time.Hour)
	running := s.runningCount()
	reqRem, sbRem, vmRem := s.limits.RequestsHourly-s.reqUsed, s.limits.SandboxesHourly-s.sbUsed, s.limits.ConcurrentVMs-running
	reqReset, sbReset := reset, reset
	if f != nil {
		r := reset
		if !f.Reset.IsZero() {
			r = f.Reset
		}
		switch f.Budget {
		case "requests":
			reqRem, reqReset = 0, r
		case "sandboxes":
			sbRem, sbReset = 0, r
		default:
			vmRem = 0
		}
	}
	h := w.Header()
	set := func(k string, v int) { h.Set(k, strconv.Itoa(max(v, 0))) }
	set("x-csb-rate-hourly-remaining", reqRem)
	set("x-csb-rate-hourly-used", s.limits.RequestsHourly-reqRem)
	h.Set("x-csb-rate-hourly-reset", strconv.FormatInt(reqReset.Unix(), 10))
	set("x-csb-sandbox-hourly-remaining", sbRem)
	set("x-csb-sandbox-hourly-used", s.limits.SandboxesHourly-sbRem)
	h.Set("x-csb-sandbox-hourly-reset", strconv.FormatInt(sbReset.Unix(), 10))
	set("x-csb-vms-remaining", vmRem)
	set("x-csb-vms-used", s.limits.ConcurrentVMs-vmRem)
}

func (s *Server) runningCount() int {
	n := 0
	for _, sb := range s.sandboxes {
		if sb.running {
			n++
		}
	}
	return n
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeData(w http.ResponseWriter, status int, data any) {
	writeJSON(w, status, map[string]any{"success": true, "errors": []any{}, "data": data})
}

func writeError(w http.ResponseWriter, status int, msgs ...string) {
	writeJSON(w, status, map[string]any{"success": false, "errors": msgs})
}

// decodeBody decodes a JSON body strictly: JSON content type, no unknown
// fields, no trailing data. An empty body is {} (every field is optional
// on the endpoints the fake serves). It writes the error response itself.
func decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	body, _ := io.ReadAll(r.Body)
	if len(bytes.TrimSpace(body)) == 0 {
		return true
	}
	if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		writeError(w, http.StatusUnsupportedMediaType, "Content-Type must be application/json")
		return false
	}
	// encoding/json matches field names case-insensitively; the real API
	// does not, so "Privacy" or "Start_Options" must be refused too.
	if err := exactKeys(body, reflect.TypeOf(v)); err != nil {
		writeError(w, http.StatusUnprocessableEntity, err.Error())
		return false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var syn *json.SyntaxError
		if errors.As(err, &syn) || errors.Is(err, io.ErrUnexpectedEOF) {
			writeError(w, http.StatusBadRequest, "Malformed JSON body")
			return false
		}
		writeError(w, http.StatusUnprocessableEntity, strings.TrimPrefix(err.Error(), "json: "))
		return false
	}
	if dec.More() {
		writeError(w, http.StatusBadRequest, "Malformed JSON body")
		return false
	}
	return true
}

// exactKeys checks that every key of the JSON object raw (and of nested
// objects that map to structs) is exactly a json tag name of t. Values
// that are not objects are left to the decoder.
func exactKeys(raw []byte, t reflect.Type) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return nil
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal(raw, &obj) != nil {
		return nil // not an object: the decoder reports it
	}
	fields := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" {
			fields[name] = f.Type
		}
	}
	for k, v := range obj {
		ft, ok := fields[k]
		if !ok {
			return fmt.Errorf("unknown field %q", k)
		}
		if err := exactKeys(v, ft); err != nil {
			return fmt.Errorf("%s: %w", k, err)
		}
	}
	return nil
}

func randID(n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// ---- REST endpoints ----

func (s *Server) routes() {
	m := http.NewServeMux()
	// Only the list takes query parameters; it checks its own.
	m.HandleFunc("GET /meta/info", noQuery(s.metaInfo))
	m.HandleFunc("GET /sandbox", s.listSandboxes)
	m.HandleFunc("GET /sandbox/{id}", noQuery(s.getSandbox))
	m.HandleFunc("POST /sandbox/{id}/fork", noQuery(s.fork))
	m.HandleFunc("POST /sandbox/{id}/tokens", noQuery(s.createPreviewToken))
	m.HandleFunc("POST /vm/{id}/start", noQuery(s.start))
	m.HandleFunc("POST /vm/{id}/hibernate", noQuery(s.stopVM("hibernate")))
	m.HandleFunc("POST /vm/{id}/shutdown", noQuery(s.stopVM("shutdown")))
	m.HandleFunc("DELETE /vm/{id}", noQuery(s.deleteVM))
	m.HandleFunc("GET /vm/running", noQuery(s.runningVMs))
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if !s.allowed(w, r) {
			writeError(w, http.StatusNotFound, "Not found")
		}
	})
	s.mux = m
}

// noQuery refuses query parameters on endpoints that define none.
func noQuery(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.URL.RawQuery != "" {
			writeError(w, http.StatusUnprocessableEntity, "unexpected query parameters")
			return
		}
		h(w, r)
	}
}

// metaInfo answers a bare MetaInformation: the spec's 200 for /meta/info
// is not enveloped (types.gen.d.ts:955-959).
func (s *Server) metaInfo(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	reset := s.window.Add(time.Hour).Unix()
	writeJSON(w, http.StatusOK, map[string]any{
		"api":  map[string]any{"name": "CodeSandbox API", "latest_version": "2023-07-01"},
		"auth": map[string]any{"scopes": []string{"sandbox:read", "sandbox:create", "vm:manage", "preview_token:manage", "sandbox:edit_code"}, "team": "00000000-0000-4000-8000-000000000001", "version": "2023-07-01"},
		"rate_limits": map[string]any{
			"concurrent_vms":   map[string]any{"limit": s.limits.ConcurrentVMs, "remaining": s.limits.ConcurrentVMs - s.runningCount()},
			"requests_hourly":  map[string]any{"limit": s.limits.RequestsHourly, "remaining": s.limits.RequestsHourly - s.reqUsed, "reset": reset},
			"sandboxes_hourly": map[string]any{"limit": s.limits.SandboxesHourly, "remaining": s.limits.SandboxesHourly - s.sbUsed, "reset": reset},
		},
	})
}

var listParams = map[string]bool{"tags": true, "order_by": true, "direction": true, "page_size": true, "page": true, "status": true}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for k := range q {
		if !listParams[k] {
			writeError(w, http.StatusUnprocessableEntity, "unknown query parameter "+k)
			return
		}
	}
	pageSize, page := 20, 1
	if v := q.Get("page_size"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 50 {
			writeError(w, http.StatusUnprocessableEntity, "page_size must be 1-50")
			return
		}
		pageSize = n
	}
	if v := q.Get("page"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			writeError(w, http.StatusUnprocessableEntity, "page must be >= 1")
			return
		}
		page = n
	}
	if v := q.Get("order_by"); v != "" && v != "inserted_at" && v != "updated_at" {
		writeError(w, http.StatusUnprocessableEntity, "order_by must be inserted_at or updated_at")
		return
	}
	if v := q.Get("direction"); v != "" && v != "asc" && v != "desc" {
		writeError(w, http.StatusUnprocessableEntity, "direction must be asc or desc")
		return
	}
	if v := q.Get("status"); v != "" && v != "running" {
		writeError(w, http.StatusUnprocessableEntity, "status must be running")
		return
	}
	var tags []string
	if v := q.Get("tags"); v != "" {
		tags = strings.Split(v, ",")
	}
	s.mu.Lock()
	var all []*sandbox
	for _, sb := range s.sandboxes {
		if sb.template || sb.deleted || (q.Get("status") == "running" && !sb.running) {
			continue
		}
		if len(tags) > 0 && !slices.ContainsFunc(tags, func(t string) bool { return slices.Contains(sb.tags, t) }) {
			continue
		}
		all = append(all, sb)
	}
	slices.SortFunc(all, func(a, b *sandbox) int {
		if c := a.created.Compare(b.created); c != 0 {
			return c
		}
		return strings.Compare(a.id, b.id)
	})
	if q.Get("direction") != "asc" {
		slices.Reverse(all)
	}
	var views []map[string]any
	for i := (page - 1) * pageSize; i < len(all) && i < page*pageSize; i++ {
		views = append(views, all[i].apiView())
	}
	s.mu.Unlock()
	var next any
	if page*pageSize < len(all) {
		next = page + 1
	}
	if views == nil {
		views = []map[string]any{}
	}
	writeData(w, http.StatusOK, map[string]any{
		"sandboxes":  views,
		"pagination": map[string]any{"current_page": page, "next_page": next, "total_records": len(all)},
	})
}

// lookup returns a live sandbox or writes 404.
func (s *Server) lookup(w http.ResponseWriter, id string) *sandbox {
	sb := s.sandboxes[id]
	if sb == nil || sb.deleted {
		writeError(w, http.StatusNotFound, "Sandbox not found")
		return nil
	}
	return sb
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sb := s.lookup(w, r.PathValue("id")); sb != nil {
		writeData(w, http.StatusOK, sb.apiView())
	}
}

type wakeupReq struct {
	HTTP      *bool `json:"http"`
	WebSocket *bool `json:"websocket"`
}

type startReq struct {
	Tier                      *string    `json:"tier"`
	HibernationTimeoutSeconds *int       `json:"hibernation_timeout_seconds"`
	AutomaticWakeupConfig     *wakeupReq `json:"automatic_wakeup_config"`
	IPCountry                 *string    `json:"ipcountry"`
}

type forkReq struct {
	Title          *string   `json:"title"`
	Description    *string   `json:"description"`
	Privacy        *int      `json:"privacy"`
	PrivatePreview *bool     `json:"private_preview"`
	IsFrozen       *bool     `json:"is_frozen"`
	Path           *string   `json:"path"`
	Tags           []string  `json:"tags"`
	StartOptions   *startReq `json:"start_options"`
}

var (
	tiers       = []string{"Pico", "Nano", "Micro", "Small", "Medium", "Large", "XLarge"}
	countryRe   = regexp.MustCompile(`^[A-Z]{2}$`)
	rfc3339Secs = time.RFC3339
)

func (sr *startReq) validate() string {
	if sr == nil {
		return ""
	}
	if sr.Tier != nil && !slices.Contains(tiers, *sr.Tier) {
		return "tier must be one of " + strings.Join(tiers, ", ")
	}
	if h := sr.HibernationTimeoutSeconds; h != nil && (*h < 1 || *h > 86400) {
		return "hibernation_timeout_seconds must be 1-86400"
	}
	if c := sr.IPCountry; c != nil && !countryRe.MatchString(*c) {
		return "ipcountry must match ^[A-Z]{2}$"
	}
	return ""
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request) {
	var req forkReq
	if !decodeBody(w, r, &req) {
		return
	}
	switch {
	case req.Title != nil && len(*req.Title) > 255:
		writeError(w, http.StatusUnprocessableEntity, "title is longer than 255 characters")
		return
	case req.Description != nil && len(*req.Description) > 255:
		writeError(w, http.StatusUnprocessableEntity, "description is longer than 255 characters")
		return
	case req.Privacy != nil && (*req.Privacy < 0 || *req.Privacy > 2):
		writeError(w, http.StatusUnprocessableEntity, "privacy must be 0, 1 or 2")
		return
	}
	if msg := req.StartOptions.validate(); msg != "" {
		writeError(w, http.StatusUnprocessableEntity, "start_options: "+msg)
		return
	}
	s.mu.Lock()
	src := s.lookup(w, r.PathValue("id"))
	if src == nil {
		s.mu.Unlock()
		return
	}
	s.sbUsed++
	if s.sbUsed > s.limits.SandboxesHourly {
		s.mu.Unlock()
		s.tooMany(w, &Fault{Budget: "sandboxes"})
		return
	}
	if req.StartOptions != nil && s.runningCount() >= s.limits.ConcurrentVMs {
		s.mu.Unlock()
		s.tooMany(w, &Fault{Budget: "vms"})
		return
	}
	id := randID(6)
	for s.sandboxes[id] != nil {
		id = randID(6)
	}
	sb := s.newSandbox(id, src.title+" (forked)", false, src.fs)
	sb.privacy, sb.description, sb.isFrozen = src.privacy, src.description, src.isFrozen
	if req.Title != nil {
		sb.title = *req.Title
	}
	if req.Description != nil {
		sb.description = *req.Description
	}
	if req.Privacy != nil {
		sb.privacy = *req.Privacy
	}
	if req.PrivatePreview != nil {
		sb.privatePreview = *req.PrivatePreview
	}
	if req.IsFrozen != nil {
		sb.isFrozen = *req.IsFrozen
	}
	if req.Path != nil {
		sb.path = *req.Path
	}
	if req.Tags != nil {
		sb.tags = slices.Clone(req.Tags)
	}
	sb.devPort = src.devPort
	sb.setupTasks = slices.Clone(src.setupTasks)
	s.sandboxes[id] = sb
	data := map[string]any{"id": id, "alias": id, "title": sb.title}
	if req.StartOptions != nil {
		data["start_response"] = s.boot(sb, req.StartOptions, "FORK")
	}
	s.mu.Unlock()
	writeData(w, http.StatusCreated, data)
}

// boot starts sb's VM (the caller holds s.mu) and returns VMStartResponse.
func (s *Server) boot(sb *sandbox, o *startReq, bootup string) map[string]any {
	if !sb.running {
		sb.running = true
		if bootup != "RESUME" { // a memory snapshot keeps its setup state
			sb.setupRan = false
		}
		sb.tier, sb.hibernationSec = "Pico", 300
		if o != nil && o.Tier != nil {
			sb.tier = *o.Tier
		}
		if o != nil && o.HibernationTimeoutSeconds != nil {
			sb.hibernationSec = *o.HibernationTimeoutSeconds
		}
	}
	sb.bootups = append(sb.bootups, bootup)
	token := "pt_" + randHex(16)
	sb.tokens = append(sb.tokens, token)
	u, _ := url.Parse(s.srv.URL)
	return map[string]any{
		"id": sb.id, "bootup_type": bootup, "cluster": "fake-eu-1",
		"pitcher_url":     s.agentScheme + "://" + u.Host + "/pitcher/" + sb.id,
		"pitcher_token":   token,
		"reconnect_token": "rt_" + randHex(16),
		"pitcher_version": PitcherVersion, "latest_pitcher_version": PitcherVersion, "pitcher_manager_version": "0.1.0",
		"workspace_path": WorkspacePath, "user_workspace_path": UserWorkspacePath,
		"use_pint": false,
	}
}

func (s *Server) start(w http.ResponseWriter, r *http.Request) {
	var req startReq
	if !decodeBody(w, r, &req) {
		return
	}
	if msg := req.validate(); msg != "" {
		writeError(w, http.StatusUnprocessableEntity, msg)
		return
	}
	s.mu.Lock()
	sb := s.lookup(w, r.PathValue("id"))
	if sb == nil {
		s.mu.Unlock()
		return
	}
	bootup := "RUNNING"
	if !sb.running {
		if s.runningCount() >= s.limits.ConcurrentVMs {
			s.mu.Unlock()
			s.tooMany(w, &Fault{Budget: "vms"})
			return
		}
		switch sb.lastStop {
		case "hibernate":
			bootup = "RESUME"
		case "shutdown":
			bootup = "CLEAN"
		default:
			bootup = "FORK"
		}
	}
	data := s.boot(sb, &req, bootup)
	s.mu.Unlock()
	writeData(w, http.StatusOK, data)
}

func (s *Server) stopVM(how string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req struct{}
		if !decodeBody(w, r, &req) {
			return
		}
		s.mu.Lock()
		sb := s.lookup(w, r.PathValue("id"))
		if sb == nil {
			s.mu.Unlock()
			return
		}
		if !sb.running {
			s.mu.Unlock()
			writeError(w, http.StatusNotFound, "VM is not running")
			return
		}
		conns := sb.stop(how)
		s.mu.Unlock()
		closeConns(conns, how == "hibernate")
		writeData(w, http.StatusOK, map[string]any{})
	}
}

func (s *Server) deleteVM(w http.ResponseWriter, r *http.Request) {
	if body, _ := io.ReadAll(r.Body); len(body) > 0 {
		writeError(w, http.StatusBadRequest, "DELETE takes no body")
		return
	}
	s.mu.Lock()
	sb := s.lookup(w, r.PathValue("id"))
	if sb == nil {
		s.mu.Unlock()
		return
	}
	if sb.template {
		s.mu.Unlock()
		writeError(w, http.StatusForbidden, "Unauthorized")
		return
	}
	conns := sb.stop("shutdown")
	sb.deleted = true
	s.mu.Unlock()
	closeConns(conns, false)
	writeData(w, http.StatusOK, map[string]any{})
}

func (s *Server) runningVMs(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Times are strings of Unix seconds or milliseconds (types.gen.d.ts:198-199,
	// read by the SDK's parseTimestamp): both forms are sent.
	vms := []map[string]any{}
	for _, sb := range s.sandboxes {
		if sb.running {
			vms = append(vms, map[string]any{
				"id": sb.id, "last_active_at": strconv.FormatInt(sb.updated.Unix(), 10),
				"session_started_at": strconv.FormatInt(sb.updated.UnixMilli(), 10),
				"specs":              map[string]any{"cpu": 1, "memory": 2048, "storage": 20480}, "credit_basis": "5",
			})
		}
	}
	writeData(w, http.StatusOK, map[string]any{
		"concurrent_vm_count": len(vms), "concurrent_vm_limit": s.limits.ConcurrentVMs, "vms": vms,
	})
}

func (s *Server) createPreviewToken(w http.ResponseWriter, r *http.Request) {
	var req struct {
		ExpiresAt *string `json:"expires_at"`
	}
	if !decodeBody(w, r, &req) {
		return
	}
	var expires any
	if req.ExpiresAt != nil {
		t, err := time.Parse(rfc3339Secs, *req.ExpiresAt)
		if err != nil {
			writeError(w, http.StatusUnprocessableEntity, "expires_at must be an RFC 3339 date-time")
			return
		}
		if !t.After(time.Now()) {
			writeError(w, http.StatusUnprocessableEntity, "expires_at must be in the future")
			return
		}
		expires = t.UTC().Format(time.RFC3339)
	}
	s.mu.Lock()
	sb := s.lookup(w, r.PathValue("id"))
	if sb == nil {
		s.mu.Unlock()
		return
	}
	tok := "prv_" + randHex(20)
	sb.previewTokens = append(sb.previewTokens, tok)
	s.mu.Unlock()
	writeData(w, http.StatusCreated, map[string]any{
		"sandbox_id": sb.id,
		"token": map[string]any{
			"token": tok, "token_id": "prv_id_" + randHex(6), "token_prefix": tok[:8],
			"expires_at": expires, "last_used_at": nil,
		},
	})
}

// PreviewTokenValid reports whether tok is a preview token of sandbox id.
func (s *Server) PreviewTokenValid(id, tok string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb := s.sandboxes[id]
	if sb == nil {
		return false
	}
	ok := false
	for _, t := range sb.previewTokens {
		if subtle.ConstantTimeCompare([]byte(t), []byte(tok)) == 1 {
			ok = true
		}
	}
	return ok
}

func (s *Server) String() string { return fmt.Sprintf("csbfake(%s)", s.srv.URL) }
