// Package tests drives the real sandbox-broker binary through real MCP
// clients: mcp-go's client here, and the official TypeScript SDK under ts/.
package tests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/client/transport"
	"github.com/mark3labs/mcp-go/mcp"
)

// brokerBin is the binary under test, built once per run.
var brokerBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "sandbox-broker-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Readable by every uid: some tests run the broker as another user.
	if err := os.Chmod(dir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	brokerBin = filepath.Join(dir, "sandbox-broker")
	// With the agent built alone beside it, as `make build` leaves them.
	build := exec.Command("go", "build", "-o", dir+"/", "../cmd/sandbox-broker", "../cmd/sandbox-agent")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build broker:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// Broker is a running broker process.
type Broker struct {
	URL   string // http://127.0.0.1:port
	Token string
	Root  string
	cmd   *exec.Cmd
	logs  *syncBuffer
	done  chan struct{}
}

// BrokerOpts configure StartHTTP. Env is added to a minimal environment.
type BrokerOpts struct {
	Root  string // reuse a root to test restarts; default t.TempDir()
	Token string // MCP_API_TOKEN; "" = let the broker generate one
	Env   map[string]string
	Args  []string
	// NoFile, if set, is the broker's RLIMIT_NOFILE (soft and hard, via
	// prlimit), so fd-exhaustion tests stay small.
	NoFile int
	// ExtraFiles are inherited by the broker as descriptors 3, 4, …
	// (nil leaves that number closed), as a launching shell's would be.
	ExtraFiles []*os.File
	// UID, if set, runs the broker as that uid and gid instead of root.
	UID uint32
}

type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}

// brokerEnv is a broker's environment. It leaves SANDBOX_ROOT as it is
// (SANDBOX_ROOT_OVERLAY=off): an overlay left mounted over a t.TempDir
// would fail its removal. StartHTTP and StartStdio, which unmount it,
// turn it on.
func brokerEnv(root, token string, extra map[string]string) []string {
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "SANDBOX_ROOT=" + root, "LOG_LEVEL=debug", "SANDBOX_ROOT_OVERLAY=off"}
	if token != "" {
		env = append(env, "MCP_API_TOKEN="+token)
	}
	for k, v := range extra {
		env = append(env, k+"="+v)
	}
	return env
}

// brokerRoot is a fresh SANDBOX_ROOT. The process backend runs sandboxes
// as another uid, which must traverse to the root, so the temp dir and its
// parent get o+x (a deployment's SANDBOX_ROOT needs the same).
func brokerRoot(t testing.TB) string {
	dir := t.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// StartHTTP starts the broker on a free loopback port and waits until it
// reports the address it listens on.
func StartHTTP(t testing.TB, o BrokerOpts) *Broker {
	t.Helper()
	if o.Root == "" {
		o.Root = brokerRoot(t)
	}
	args := append([]string{"serve", "--transport", "http", "--addr", "127.0.0.1:0"}, o.Args...)
	cmd := exec.Command(brokerBin, args...)
	if o.NoFile > 0 { // prlimit execs the broker: the pid stays the same
		cmd = exec.Command("prlimit", append([]string{fmt.Sprintf("--nofile=%d:%d", o.NoFile, o.NoFile), "--", brokerBin}, args...)...)
	}
	cmd.Env = brokerEnv(o.Root, o.Token, withRootOverlay(t, o.Root, o.Env))
	cmd.ExtraFiles = o.ExtraFiles
	if o.UID != 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: o.UID, Gid: o.UID}}
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	b := &Broker{Root: o.Root, cmd: cmd, logs: &syncBuffer{}, done: make(chan struct{})}
	addrc := make(chan string, 1)
	go func() {
		defer close(b.done)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
		for sc.Scan() {
			line := sc.Text()
			b.logs.Write([]byte(line + "\n"))
			var ev struct {
				Message, Addr string
			}
			if json.Unmarshal([]byte(line), &ev) == nil && ev.Message == "http_listening" {
				addrc <- ev.Addr
			}
		}
		_ = cmd.Wait()
	}()
	t.Cleanup(func() {
		b.Stop(t)
		if t.Failed() { // what the broker said beyond debug, for CI logs
			var lines []string
			for _, l := range strings.Split(b.logs.String(), "\n") {
				if strings.Contains(l, `"level":"warn"`) || strings.Contains(l, `"level":"error"`) {
					lines = append(lines, l)
				}
			}
			t.Logf("broker warnings and errors:\n%s", strings.Join(lines[max(0, len(lines)-40):], "\n"))
		}
	})
	select {
	case addr := <-addrc:
		b.URL = "http://" + addr
	case <-b.done:
		t.Fatalf("broker exited before listening:\n%s", b.logs.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("broker did not listen within 30s:\n%s", b.logs.String())
	}
	b.Token = o.Token
	if _, tokensFile := o.Env["MCP_TOKENS_FILE"]; b.Token == "" && !tokensFile {
		raw, err := os.ReadFile(filepath.Join(o.Root, "api_token"))
		if err != nil {
			t.Fatalf("generated token: %v", err)
		}
		b.Token = strings.TrimSpace(string(raw))
	}
	return b
}

// Stop sends SIGTERM and waits for a clean exit (idempotent).
func (b *Broker) Stop(t testing.TB) {
	select {
	case <-b.done:
		return
	default:
	}
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.done:
	case <-time.After(20 * time.Second):
		_ = b.cmd.Process.Kill()
		<-b.done
		t.Errorf("broker did not stop on SIGTERM")
	}
}

// Kill ends the broker with SIGKILL (no shutdown of its own) and waits.
func (b *Broker) Kill() {
	_ = b.cmd.Process.Signal(syscall.SIGKILL)
	<-b.done
}

// callLoop keeps every client calling get_usage, one call at a time each,
// handing each outcome to seen (from several goroutines at once) until
// the returned stop, which waits for the calls under way.
func callLoop(clients []*client.Client, seen func(*mcp.CallToolResult, error)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for _, c := range clients {
		wg.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				var req mcp.CallToolRequest
				req.Params.Name = "get_usage"
				res, err := c.CallTool(ctx, req)
				cancel()
				seen(res, err)
			}
		})
	}
	return func() { close(done); wg.Wait() }
}

// succeeded is a callLoop outcome handler counting the calls that worked.
func succeeded(n *atomic.Int64) func(*mcp.CallToolResult, error) {
	return func(res *mcp.CallToolResult, err error) {
		if err == nil && !res.IsError {
			n.Add(1)
		}
	}
}

// Logs returns everything the broker wrote to stderr so far.
func (b *Broker) Logs() string { return b.logs.String() }

// Client returns an initialised mcp-go Streamable HTTP client for token.
func (b *Broker) Client(t testing.TB, token string) *client.Client {
	t.Helper()
	c, err := client.NewStreamableHttpClient(b.URL+"/mcp",
		transport.WithHTTPHeaders(map[string]string{"Authorization": "Bearer " + token}))
	if err != nil {
		t.Fatal(err)
	}
	initClient(t, c)
	return c
}

// StartStdio starts the broker on stdio and returns an initialised client.
func StartStdio(t testing.TB, root string, extra map[string]string) *client.Client {
	t.Helper()
	if root == "" {
		root = brokerRoot(t)
	}
	env := brokerEnv(root, "", withRootOverlay(t, root, extra))
	c, err := client.NewStdioMCPClient(brokerBin, env, "serve", "--transport", "stdio")
	if err != nil {
		t.Fatal(err)
	}
	initClient(t, c)
	return c
}

// withRootOverlay adds SANDBOX_ROOT_OVERLAY=auto to env (unless set), as
// in production, and unmounts the overlay the broker may leave over root
// once the test's other cleanups (stopping the broker) have run.
func withRootOverlay(t testing.TB, root string, env map[string]string) map[string]string {
	out := map[string]string{"SANDBOX_ROOT_OVERLAY": "auto"}
	for k, v := range env {
		out[k] = v
	}
	t.Cleanup(func() { _ = syscall.Unmount(root, syscall.MNT_DETACH) })
	return out
}

func initClient(t testing.TB, c *client.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	req := mcp.InitializeRequest{}
	req.Params.ProtocolVersion = mcp.LATEST_LEGACY_PROTOCOL_VERSION
	req.Params.ClientInfo = mcp.Implementation{Name: "sandbox-broker-tests", Version: "1"}
	if _, err := c.Initialize(ctx, req); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
}

// callTool calls a tool with a per-call timeout.
func callTool(t testing.TB, c *client.Client, name string, args any) *mcp.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var req mcp.CallToolRequest
	req.Params.Name = name
	req.Params.Arguments = args
	res, err := c.CallTool(ctx, req)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return res
}

// toolError is the structured error body every failed tool call carries.
type toolError struct {
	Error       string `json:"error"`
	Message     string `json:"message"`
	Retryable   bool   `json:"retryable"`
	RetryAfterS *int64 `json:"retry_after_s"`
}

// resultJSON decodes a result's text content into v.
func resultJSON(t testing.TB, res *mcp.CallToolResult, v any) {
	t.Helper()
	if len(res.Content) == 0 {
		t.Fatalf("result has no content")
	}
	tc, ok := res.Content[0].(mcp.TextContent)
	if !ok {
		t.Fatalf("first content is %T, want text", res.Content[0])
	}
	if err := json.Unmarshal([]byte(tc.Text), v); err != nil {
		t.Fatalf("decode %q: %v", tc.Text, err)
	}
}

// mustToolError asserts res is an error result with code.
func mustToolError(t testing.TB, res *mcp.CallToolResult, code string) toolError {
	t.Helper()
	if !res.IsError {
		t.Fatalf("want %s error, got success: %+v", code, res.Content)
	}
	var e toolError
	resultJSON(t, res, &e)
	if e.Error != code {
		t.Fatalf("error = %s (%q), want %s", e.Error, e.Message, code)
	}
	return e
}
