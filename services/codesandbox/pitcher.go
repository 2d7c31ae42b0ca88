package codesandbox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/coder/websocket"
	"github.com/rs/zerolog"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// ProtocolVersion is the Pitcher protocol the official SDK 2.4.2 speaks.
const ProtocolVersion = "0.367.10"

// Pitcher error codes used here (codesandbox-api.md §5.1).
const (
	PitcherNoAccess       = 2
	PitcherRateLimit      = 3
	PitcherInvalidPath    = 101
	PitcherRawFSError     = 102
	PitcherShellNotFound  = 204
	errnoENOENT           = 2
	errnoEEXIST           = 17
	defaultMaxMessage     = 32 << 20
	defaultCallTimeout    = 90 * time.Second
	defaultPingInterval   = 15 * time.Second
	defaultPongTimeout    = 45 * time.Second
	defaultMaxShellOutput = 1 << 20
)

// ErrPitcherClosed is returned by calls on a closed agent connection.
var ErrPitcherClosed = errors.New("pitcher connection closed")

// PitcherOptions configure an agent connection.
type PitcherOptions struct {
	// MaxMessageBytes bounds one incoming message (default 32 MiB).
	MaxMessageBytes int64
	// CallTimeout bounds one request/response (default 90s, the SDK's).
	CallTimeout time.Duration
	// PingInterval: after this long without an incoming message an empty
	// text frame is sent as ping; PongTimeout without any message closes
	// the connection (defaults 15s and 45s).
	PingInterval time.Duration
	PongTimeout  time.Duration
	Log          zerolog.Logger
}

// PitcherError is an agent's error response.
type PitcherError struct {
	Method  string
	Code    int
	Message string
	Errno   *int // set for PitcherRawFSError
}

func (e *PitcherError) Error() string {
	s := fmt.Sprintf("pitcher %s: error %d: %s", e.Method, e.Code, e.Message)
	if e.Errno != nil {
		s += fmt.Sprintf(" (errno %d)", *e.Errno)
	}
	return s
}

// Exists reports whether the error is "file exists" (e.g. mkdir over a file).
func (e *PitcherError) Exists() bool {
	return e.Code == PitcherRawFSError && e.Errno != nil && *e.Errno == errnoEEXIST
}

// NotFound reports whether the error is a missing file.
func (e *PitcherError) NotFound() bool {
	return e.Code == PitcherRawFSError && e.Errno != nil && *e.Errno == errnoENOENT
}

// SetupProgress is setup/get's result and setup/progress's params
// (pitcher-protocol/messages/setup.d.ts:9-13).
type SetupProgress struct {
	State string `msgpack:"state"` // IDLE | IN_PROGRESS | FINISHED | STOPPED
	Steps []struct {
		Name    string `msgpack:"name"`
		Command string `msgpack:"command"`
	} `msgpack:"steps"`
	CurrentStepIndex int `msgpack:"currentStepIndex"`
}

// JoinResult is client/join's result (the fields the broker uses).
type JoinResult struct {
	Client struct {
		ClientID string `msgpack:"clientId"`
		Username string `msgpack:"username"`
	} `msgpack:"client"`
	WorkspacePath   string `msgpack:"workspacePath"`
	Version         string `msgpack:"version"`
	ProtocolVersion string `msgpack:"protocolVersion"`
}

// Pitcher is one WebSocket connection to a VM's agent. Calls may run
// concurrently; responses are matched by id.
type Pitcher struct {
	conn *websocket.Conn
	o    PitcherOptions
	log  zerolog.Logger

	mu      sync.Mutex
	nextID  int
	pending map[int]*pendingCall
	shells  map[string]*shellRun
	err     error // why the connection ended

	// born and lastRecv measure silence on the monotonic clock: lastRecv
	// is the time since born of the last incoming frame. (Wall-clock
	// nanos would let a clock step drop a live connection or hide a dead
	// one for as long as the step.)
	born     time.Time
	lastRecv atomic.Int64
	done     chan struct{}
	stop     context.CancelFunc
	wg       sync.WaitGroup
	once     sync.Once
	// setupCh, until awaitSetup is done, receives setup/progress.
	setupCh chan SetupProgress

	Join  JoinResult
	Setup SetupProgress // as the VM reported it before the first use
}

type pendingCall struct {
	method string
	ch     chan inMsg
	// hook runs in the reader goroutine before any later message is
	// handled (shell/create registers its shell here, so no shell/out is
	// missed between the response and the caller seeing it).
	hook func(result msgpack.RawMessage)
}

type outMsg struct {
	ID     int    `msgpack:"id"`
	Method string `msgpack:"method"`
	Params any    `msgpack:"params"`
}

// inMsg is any message from the agent. Which keys are present decides
// what it is, as in the SDK's receiveMessage (dist/esm/index.js:8597-8634,
// predicates at 8109-8117, `"key" in payload`): no id but params is a
// notification; with an id, an error key makes it a rejection, else a
// result key a resolution, even when its value is null (shell/in's result
// is null: pitcher-protocol/messages/shell.d.ts:56-58). The wire's status
// is not read: the SDK ignores it too.
type inMsg struct {
	ID                                    *int
	Method                                string
	Params, Result, Error                 msgpack.RawMessage
	hasID, hasParams, hasResult, hasError bool
}

// decodeInMsg decodes a message keeping track of which keys it has
// (msgpack's nil decodes to an empty RawMessage, like an absent key).
func decodeInMsg(data []byte) (inMsg, error) {
	var raw map[string]msgpack.RawMessage
	if err := msgpack.Unmarshal(data, &raw); err != nil {
		return inMsg{}, err
	}
	var m inMsg
	var idRaw msgpack.RawMessage
	idRaw, m.hasID = raw["id"]
	m.Params, m.hasParams = raw["params"]
	m.Result, m.hasResult = raw["result"]
	m.Error, m.hasError = raw["error"]
	if len(idRaw) > 0 {
		var id int
		if err := msgpack.Unmarshal(idRaw, &id); err != nil {
			return inMsg{}, fmt.Errorf("id: %w", err)
		}
		m.ID = &id
	}
	if b := raw["method"]; len(b) > 0 {
		if err := msgpack.Unmarshal(b, &m.Method); err != nil {
			return inMsg{}, fmt.Errorf("method: %w", err)
		}
	}
	return m, nil
}

// isResponse reports whether m answers request *m.ID.
func (m *inMsg) isResponse() bool { return m.ID != nil && (m.hasError || m.hasResult) }

// isNotification reports whether m is a notification.
func (m *inMsg) isNotification() bool { return !m.hasID && m.hasParams }

// DialPitcher connects to {pitcherURL}/?token={token}, sends client/join
// and waits for the VM's setup to be under way, as the SDK does before it
// uses a VM (awaitSetup). See agentURL for the URLs it takes.
func DialPitcher(ctx context.Context, pitcherURL string, token Secret, o PitcherOptions) (*Pitcher, error) {
	if o.MaxMessageBytes <= 0 {
		o.MaxMessageBytes = defaultMaxMessage
	}
	if o.CallTimeout <= 0 {
		o.CallTimeout = defaultCallTimeout
	}
	if o.PingInterval <= 0 {
		o.PingInterval = defaultPingInterval
	}
	if o.PongTimeout <= 0 {
		o.PongTimeout = defaultPongTimeout
	}
	u, err := agentURL(pitcherURL, token)
	if err != nil {
		return nil, err
	}

	dctx, cancel := context.WithTimeout(ctx, o.CallTimeout)
	defer cancel()
	conn, resp, err := websocket.Dial(dctx, u.String(), &websocket.DialOptions{CompressionMode: websocket.CompressionDisabled})
	if err != nil {
		// A dial error may quote the URL, token included.
		cause := errors.New(redactToken(err.Error(), token))
		if ctx.Err() != nil {
			return nil, ctxError(ctx)
		}
		if resp != nil && (resp.StatusCode == 401 || resp.StatusCode == 403) {
			return nil, brokererr.Wrap(cause, brokererr.PermissionDenied, "the sandbox agent refused the connection")
		}
		return nil, brokererr.Wrap(cause, brokererr.Unavailable, "cannot reach the sandbox agent")
	}
	conn.SetReadLimit(o.MaxMessageBytes)
	lctx, stop := context.WithCancel(context.Background())
	p := &Pitcher{
		conn:    conn,
		o:       o,
		log:     o.Log.With().Str("component", "codesandbox_pitcher").Logger(),
		pending: map[int]*pendingCall{},
		shells:  map[string]*shellRun{},
		done:    make(chan struct{}),
		stop:    stop,
		// Watched from the start: the agent may report progress as soon
		// as the client has joined, before setup/get is even sent.
		setupCh: make(chan SetupProgress, 1),
		born:    time.Now(),
	}
	p.wg.Add(2)
	go p.readLoop(lctx)
	go p.heartbeat(lctx)

	if err := p.Call(ctx, "client/join", joinParams(), &p.Join); err != nil {
		_ = p.Close()
		return nil, err
	}
	if err := p.awaitSetup(ctx); err != nil {
		_ = p.Close()
		return nil, err
	}
	return p, nil
}

// awaitSetup is what the SDK does between client/join and handing out the
// VM (SandboxClient.create, dist/esm/index.js:11066-11082): setup/get, and
// unless that already lists steps, wait for the first setup/progress. The
// wait is bounded by CallTimeout. A progress notification that arrived
// since the connection opened counts too (the SDK listens only after
// setup/get's answer and would wait for the next one).
func (p *Pitcher) awaitSetup(ctx context.Context) error {
	ch := p.setupCh
	defer func() {
		p.mu.Lock()
		p.setupCh = nil
		p.mu.Unlock()
	}()
	if err := p.Call(ctx, "setup/get", struct{}{}, &p.Setup); err != nil {
		return err
	}
	if len(p.Setup.Steps) > 0 {
		return nil
	}
	t := time.NewTimer(p.o.CallTimeout)
	defer t.Stop()
	select {
	case p.Setup = <-ch:
		return nil
	case <-p.done:
		return fmt.Errorf("%w: setup/progress: %w", ErrPitcherClosed, p.Err())
	case <-ctx.Done():
		return p.ctxErr(ctx, "setup/progress")
	case <-t.C:
		return brokererr.New(brokererr.Unavailable, "the sandbox did not report its setup in time; try again")
	}
}

// agentURL is {pitcherURL}/?token={token}. pitcher_url is "WebSocket URL
// to connect to Pitcher" (types.gen.d.ts:841-843); the SDK dials it with
// the ws library, which takes http and https as ws and wss (bundled in
// dist/esm/node.js:4227-4231), and so does websocket.Dial. Clear text (ws,
// http) is for loopback only: the token is in the query string.
func agentURL(pitcherURL string, token Secret) (*url.URL, error) {
	u, err := url.Parse(pitcherURL)
	if err != nil || u.Host == "" || u.User != nil {
		return nil, brokererr.New(brokererr.Unavailable, "CodeSandbox returned an unusable agent URL")
	}
	switch {
	case u.Scheme == "wss" || u.Scheme == "https":
	case (u.Scheme == "ws" || u.Scheme == "http") && config.IsLoopbackHost(u.Hostname()):
	default:
		return nil, brokererr.New(brokererr.Unavailable, "CodeSandbox returned an agent URL that is not wss or https")
	}
	u.Path = strings.TrimRight(u.Path, "/") + "/"
	u.RawPath = ""
	u.RawQuery = url.Values{"token": {token.Reveal()}}.Encode()
	u.Fragment = ""
	return u, nil
}

// joinParams are client/join's params exactly as codesandbox-api.md §5.1
// documents the SDK's first join. Every connection is a first join: a
// reconnect goes through a new start call and a new DialPitcher.
func joinParams() map[string]any {
	return map[string]any{
		"clientInfo":    map[string]any{"protocolVersion": ProtocolVersion, "appId": "sdk"},
		"asyncProgress": true,
		"subscriptions": map[string]any{
			"client": map[string]bool{"status": true},
			"file":   map[string]bool{"status": true, "selection": true, "ot": true},
			"fs":     map[string]bool{"operations": true},
			"git":    map[string]bool{"status": true, "operations": true},
			"port":   map[string]bool{"status": true},
			"setup":  map[string]bool{"progress": true},
			"shell":  map[string]bool{"status": true},
			"system": map[string]bool{"metrics": true},
		},
	}
}

// Done is closed when the connection has ended.
func (p *Pitcher) Done() <-chan struct{} { return p.done }

// Err says why the connection ended (nil while open).
func (p *Pitcher) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Close ends the connection with a close handshake and waits for its
// goroutines. Pending calls fail with ErrPitcherClosed.
func (p *Pitcher) Close() error {
	p.shutdown(ErrPitcherClosed)
	err := p.conn.Close(websocket.StatusNormalClosure, "")
	p.stop()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// shutdown marks the connection ended once and fails everything waiting.
func (p *Pitcher) shutdown(why error) {
	p.once.Do(func() {
		p.mu.Lock()
		p.err = why
		pend := p.pending
		shells := p.shells
		p.pending = map[int]*pendingCall{}
		p.shells = map[string]*shellRun{}
		p.mu.Unlock()
		// Done first: a caller woken below with ErrPitcherClosed that asks
		// for a connection again must find this one ended.
		close(p.done)
		for _, pc := range pend {
			close(pc.ch)
		}
		lost := why
		if !errors.Is(lost, ErrPitcherClosed) {
			lost = fmt.Errorf("%w: %w", ErrPitcherClosed, why)
		}
		for _, s := range shells {
			s.fail(lost)
		}
	})
}

// Call sends one request and decodes its result into out (may be nil).
func (p *Pitcher) Call(ctx context.Context, method string, params, out any) error {
	return p.call(ctx, method, params, out, nil)
}

func (p *Pitcher) call(ctx context.Context, method string, params, out any, hook func(msgpack.RawMessage)) error {
	if params == nil {
		params = map[string]any{}
	}
	ctx, cancel := context.WithTimeout(ctx, p.o.CallTimeout)
	defer cancel()
	pc := &pendingCall{method: method, ch: make(chan inMsg, 1), hook: hook}
	p.mu.Lock()
	if p.err != nil {
		err := p.err
		p.mu.Unlock()
		return fmt.Errorf("%w: %w", ErrPitcherClosed, err)
	}
	id := p.nextID
	p.nextID++
	p.pending[id] = pc
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.pending, id)
		p.mu.Unlock()
	}()

	b, err := msgpack.Marshal(outMsg{ID: id, Method: method, Params: params})
	if err != nil {
		return fmt.Errorf("pitcher %s: encode: %w", method, err)
	}
	if err := p.conn.Write(ctx, websocket.MessageBinary, b); err != nil {
		if ctx.Err() != nil {
			return p.ctxErr(ctx, method)
		}
		p.shutdown(err)
		return fmt.Errorf("%w: %s: %w", ErrPitcherClosed, method, err)
	}
	select {
	case m, ok := <-pc.ch:
		if !ok {
			return fmt.Errorf("%w: %s: %w", ErrPitcherClosed, method, p.Err())
		}
		if m.hasError {
			return pitcherError(method, m)
		}
		if out != nil && len(m.Result) > 0 {
			if err := msgpack.Unmarshal(m.Result, out); err != nil {
				return fmt.Errorf("pitcher %s: decode result: %w", method, err)
			}
		}
		return nil
	case <-ctx.Done():
		return p.ctxErr(ctx, method)
	}
}

// redactToken removes the token, raw and query-escaped, from s.
func redactToken(s string, token Secret) string {
	t := token.Reveal()
	if t == "" {
		return s
	}
	s = strings.ReplaceAll(s, url.QueryEscape(t), "[redacted]")
	return strings.ReplaceAll(s, t, "[redacted]")
}

func (p *Pitcher) ctxErr(ctx context.Context, method string) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return brokererr.Wrap(fmt.Errorf("pitcher %s: %w", method, ctx.Err()), brokererr.SandboxTimeout, "the sandbox agent did not answer in time")
	}
	return ctx.Err()
}

func pitcherError(method string, m inMsg) error {
	e := &PitcherError{Method: method, Code: -1, Message: "malformed response"}
	var pe struct {
		Code    *int               `msgpack:"code"`
		Message string             `msgpack:"message"`
		Data    msgpack.RawMessage `msgpack:"data"`
	}
	if msgpack.Unmarshal(m.Error, &pe) != nil || pe.Code == nil {
		return e
	}
	e.Code = *pe.Code
	e.Message = cleanText(pe.Message, maxServerMessage)
	if len(pe.Data) > 0 {
		var d struct {
			Errno *int `msgpack:"errno"`
		}
		if msgpack.Unmarshal(pe.Data, &d) == nil {
			e.Errno = d.Errno
		}
	}
	return e
}

// readLoop is the only reader: it routes responses by id and dispatches
// notifications. Text frames are the agent's answer to our ping.
func (p *Pitcher) readLoop(ctx context.Context) {
	defer p.wg.Done()
	for {
		typ, data, err := p.conn.Read(ctx)
		if err != nil {
			p.shutdown(err)
			return
		}
		p.lastRecv.Store(int64(time.Since(p.born)))
		if typ != websocket.MessageBinary {
			continue
		}
		m, err := decodeInMsg(data)
		if err != nil {
			p.log.Warn().Err(err).Int("bytes", len(data)).Msg("pitcher_bad_message")
			continue
		}
		switch {
		case m.isResponse():
			p.mu.Lock()
			pc := p.pending[*m.ID]
			delete(p.pending, *m.ID)
			p.mu.Unlock()
			if pc == nil {
				continue // its caller gave up
			}
			if pc.hook != nil && !m.hasError {
				pc.hook(m.Result)
			}
			pc.ch <- m
		case m.isNotification():
			if !p.notify(m.Method, m.Params) {
				_ = p.conn.CloseNow()
				return
			}
		default:
			p.log.Warn().Str("method", cleanText(m.Method, 64)).Msg("pitcher_unidentified_message")
		}
	}
}

// notify handles one notification; false ends the connection.
func (p *Pitcher) notify(method string, params msgpack.RawMessage) bool {
	switch method {
	case "shell/out":
		var n struct {
			ShellID string `msgpack:"shellId"`
			Out     string `msgpack:"out"`
		}
		if msgpack.Unmarshal(params, &n) == nil {
			if s := p.shell(n.ShellID); s != nil {
				s.add(n.Out)
			}
		}
	case "shell/exit":
		var n struct {
			ShellID  string `msgpack:"shellId"`
			ExitCode int    `msgpack:"exitCode"`
		}
		if msgpack.Unmarshal(params, &n) == nil {
			p.finishShell(n.ShellID, n.ExitCode)
		}
	case "shell/terminate":
		var n struct {
			ShellID string `msgpack:"shellId"`
		}
		if msgpack.Unmarshal(params, &n) == nil {
			p.finishShell(n.ShellID, -1)
		}
	case "setup/progress":
		var n SetupProgress
		if msgpack.Unmarshal(params, &n) == nil {
			p.mu.Lock()
			if p.setupCh != nil {
				select {
				case p.setupCh <- n:
				default: // one is enough
				}
			}
			p.mu.Unlock()
		}
	case "system/hibernate":
		// The VM is going to sleep: end this connection so the next
		// operation starts the VM again and joins afresh.
		p.log.Info().Msg("pitcher_hibernate")
		p.shutdown(errors.New("sandbox VM hibernated"))
		return false
	}
	return true
}

// heartbeat pings an idle connection and drops a silent one.
func (p *Pitcher) heartbeat(ctx context.Context) {
	defer p.wg.Done()
	t := time.NewTicker(max(p.o.PingInterval/2, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.done:
			return
		case <-t.C:
		}
		idle := time.Since(p.born) - time.Duration(p.lastRecv.Load())
		if idle >= p.o.PongTimeout {
			p.log.Warn().Int64("idle_ms", idle.Milliseconds()).Msg("pitcher_heartbeat_timeout")
			p.shutdown(errors.New("sandbox agent stopped answering"))
			_ = p.conn.CloseNow()
			return
		}
		if idle >= p.o.PingInterval {
			wctx, cancel := context.WithTimeout(ctx, p.o.PingInterval)
			_ = p.conn.Write(wctx, websocket.MessageText, nil)
			cancel()
		}
	}
}
