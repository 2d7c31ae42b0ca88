package tests

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/client/transport"
	"github.com/mark3labs/mcp-go/mcp"
)

// rawRequest sends a request line and headers byte for byte (no client-side
// cleaning) and reads the response.
func rawRequest(t testing.TB, b *Broker, method, target string, headers ...string) *http.Response {
	t.Helper()
	resp, _ := rawRequestTo(t, strings.TrimPrefix(b.URL, "http://"), "127.0.0.1", method, target, headers...)
	return resp
}

// rawRequestTo is rawRequest to any address with any Host header; it
// returns the response and its body (up to 1 MiB).
func rawRequestTo(t testing.TB, addr, host, method, target string, headers ...string) (*http.Response, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n%s\r\n", method, target, host, strings.Join(append(headers, ""), "\r\n"))
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%s %s (Host %s): %v", method, target, host, err)
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	return resp, string(body)
}

// TestNonCanonicalPathsRefused: the broker refuses a request path that
// is not canonical before any routing, instead of the ServeMux answering
// 307 with a cleaned Location (issue 15: //files/…, /./files/…, /x/../files/…).
func TestNonCanonicalPathsRefused(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none"}})
	const ws = "0123456789abcdef0123456789abcdef"
	q := "?exp=9999999999&kid=k1&sig=AAAA"
	auth := "Authorization: Bearer " + testToken
	for _, target := range []string{
		"//files/" + ws + "/out.txt" + q,
		"/./files/" + ws + "/out.txt" + q,
		"/x/../files/" + ws + "/out.txt" + q,
		"/x/%2e%2e/files/" + ws + "/out.txt" + q,
		"/%2e/files/" + ws + "/out.txt" + q,
		"/files/" + ws + "/../" + ws + "/out.txt" + q,
		"//preview/" + ws + "/index.html",
		"/preview/" + ws + "/../../mcp",
		"/preview/./" + ws + "/",
		"//mcp",
		"/./mcp",
		"/mcp/.",
		"/x/../mcp",
		"//healthz",
		"/healthz/.",
		"/metrics/..",
		"/x//",
	} {
		for _, method := range []string{http.MethodGet, http.MethodPost} {
			resp := rawRequest(t, b, method, target, auth, "Content-Length: 0")
			if resp.StatusCode != http.StatusForbidden || resp.Header.Get("Location") != "" {
				t.Errorf("%s %s: %d (Location %q), want 403", method, target, resp.StatusCode, resp.Header.Get("Location"))
			}
		}
	}
	// Canonical paths are routed as before.
	for target, want := range map[string]int{
		"/healthz":                        http.StatusOK,
		"/nope/":                          http.StatusNotFound,
		"/files/" + ws + "/out.txt" + q:   http.StatusForbidden, // the handler's own refusal
		"/files/" + ws + "/a%2Fb.txt" + q: http.StatusForbidden,
	} {
		if resp := rawRequest(t, b, http.MethodGet, target); resp.StatusCode != want {
			t.Errorf("GET %s: %d, want %d", target, resp.StatusCode, want)
		}
	}
}

// slowAttack keeps workers unauthenticated connections open against the
// broker, each from one of sources: half send the head of a POST /mcp with
// Content-Length: 1000 and then trickle its body, half trickle the head
// itself. A worker whose connection the broker answers or closes opens a
// new one. It is the red team's repro of issue 15 at a bounded scale.
type slowAttack struct {
	dials, heads, answered atomic.Int64
	steps                  atomic.Int64 // bytes trickled plus connections ended
	wg                     sync.WaitGroup
}

func startSlowAttack(ctx context.Context, addr string, sources []string, perSource int) *slowAttack {
	a := &slowAttack{}
	for i, src := range sources {
		for j := 0; j < perSource; j++ {
			a.wg.Add(1)
			go func(src string, slowHead bool) {
				defer a.wg.Done()
				d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 2 * time.Second}
				for ctx.Err() == nil {
					if c, err := d.DialContext(ctx, "tcp", addr); err == nil {
						a.dials.Add(1)
						a.trickle(ctx, c, slowHead)
						c.Close()
						a.steps.Add(1)
					}
					// Pace reconnects so the load stays bounded on 2 cores.
					select {
					case <-ctx.Done():
					case <-time.After(100 * time.Millisecond):
					}
				}
			}(src, (i+j)%2 == 0)
		}
	}
	return a
}

func (a *slowAttack) trickle(ctx context.Context, c net.Conn, slowHead bool) {
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	head := "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
	rest := strings.Repeat("x", 1000)
	first := head
	if slowHead {
		first, rest = "POST /mcp HTTP/1.1\r\n", head[len("POST /mcp HTTP/1.1\r\n"):]+rest
	}
	if _, err := io.WriteString(c, first); err != nil {
		return
	}
	a.heads.Add(1)
	buf := make([]byte, 512)
	for i := 0; i < len(rest); i++ {
		// One byte each time the broker stays silent for 300 ms.
		_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		n, err := c.Read(buf)
		if n > 0 {
			a.answered.Add(1)
			return
		}
		if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
			return // closed by the broker
		}
		if _, err := c.Write([]byte{rest[i]}); err != nil {
			return
		}
		a.steps.Add(1)
	}
}

// TestSlowUnauthenticatedBodiesDoNotStarveClients: while hundreds of
// unauthenticated connections trickle request bodies and heads, an
// authenticated client still initializes, calls a tool and reads /healthz
// (issue 15: ~24k such connections pinned the broker at its fd limit).
// The broker runs with RLIMIT_NOFILE 256 and the attack holds 300
// connections, so without connection limits it runs out of descriptors.
func TestSlowUnauthenticatedBodiesDoNotStarveClients(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, NoFile: 256, Env: map[string]string{
		"SANDBOX_BACKEND": "none", "MCP_MAX_UNAUTH_CONNS_PER_ADDR": "16"}})
	attackCtx, stopAttack := context.WithCancel(context.Background())
	sources := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	const perSource = 100
	a := startSlowAttack(attackCtx, strings.TrimPrefix(b.URL, "http://"), sources, perSource)
	defer func() { stopAttack(); a.wg.Wait() }()
	// Under way once every worker has sent a request head, and the workers
	// have together trickled a byte or lost a connection three times each.
	workers := int64(len(sources) * perSource)
	for deadline := time.Now().Add(15 * time.Second); a.heads.Load() < workers || a.steps.Load() < 3*workers; {
		if time.Now().After(deadline) {
			t.Fatalf("attack did not start: %d heads sent, %d steps", a.heads.Load(), a.steps.Load())
		}
		time.Sleep(20 * time.Millisecond) // polling counters, not synchronising
	}

	// The authenticated client gets a generous deadline for all of it.
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	healthz := func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.URL+"/healthz", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("/healthz during the attack: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("/healthz during the attack: %d", resp.StatusCode)
		}
	}
	healthz()
	c, err := client.NewStreamableHttpClient(b.URL+"/mcp", transport.WithHTTPHeaders(map[string]string{"Authorization": "Bearer " + testToken}))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	init := mcp.InitializeRequest{}
	init.Params.ProtocolVersion = mcp.LATEST_LEGACY_PROTOCOL_VERSION
	init.Params.ClientInfo = mcp.Implementation{Name: "slow-body-test", Version: "1"}
	if _, err := c.Initialize(ctx, init); err != nil {
		t.Fatalf("initialize during the attack: %v", err)
	}
	// Keep using the broker for a couple of seconds as the attack goes on,
	// a call every 200 ms (well inside the per-minute rate limit).
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	rounds := 0
	for ; rounds < 10; rounds++ {
		<-tick.C
		var call mcp.CallToolRequest
		call.Params.Name = "get_usage"
		res, err := c.CallTool(ctx, call)
		if err != nil || res.IsError {
			t.Fatalf("get_usage during the attack (round %d): %v %+v", rounds, err, res)
		}
		healthz()
	}
	stopAttack()
	a.wg.Wait()

	if a.answered.Load() == 0 {
		t.Error("the broker never answered an attacking connection: was the attack refused at all?")
	}
	// Refusals are logged, but throttled: 4,000 of them wrote 506 KB.
	logs := b.Logs()
	if n := strings.Count(logs, `"auth_rejected"`); n > 150 {
		t.Errorf("%d auth_rejected log lines for %d attacking connections: not throttled", n, a.dials.Load())
	}
	if !strings.Contains(logs, `"reason":"address_limit"`) {
		t.Error("no connection was closed for its address's limit")
	}
	t.Logf("attack: %d connections, %d request heads, %d answered; client: %d rounds", a.dials.Load(), a.heads.Load(), a.answered.Load(), rounds)
}

// TestRequestBodiesAreBounded: a body that never finishes costs at most
// MCP_BODY_TIMEOUT_S for an authenticated client, and nothing for anyone
// else: refusals and bodiless endpoints answer and close without reading it.
func TestRequestBodiesAreBounded(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none", "MCP_BODY_TIMEOUT_S": "1"}})
	cases := []struct {
		name, head string
		want       int
	}{
		{"authenticated slow body", "POST /mcp HTTP/1.1\r\nAuthorization: Bearer " + testToken + "\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\n", http.StatusRequestTimeout},
		{"unauthenticated body", "POST /mcp HTTP/1.1\r\n", http.StatusUnauthorized},
		{"wrong token", "POST /mcp HTTP/1.1\r\nAuthorization: Bearer wrong-token-0123456789\r\n", http.StatusUnauthorized},
		{"healthz with a body", "GET /healthz HTTP/1.1\r\n", http.StatusOK},
		{"unknown path with a body", "PUT /nope HTTP/1.1\r\n", http.StatusNotFound},
		{"bad host with a body", "POST /mcp HTTP/1.1\r\nX-Host: x\r\n", http.StatusForbidden},
		{"non-canonical path with a body", "POST //mcp HTTP/1.1\r\n", http.StatusForbidden},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := net.Dial("tcp", strings.TrimPrefix(b.URL, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			host := "127.0.0.1"
			if strings.Contains(tc.head, "X-Host") {
				host = "evil.example"
			}
			// The head promises 1000 bytes; only 10 ever come.
			fmt.Fprintf(c, "%sHost: %s\r\nContent-Length: 1000\r\n\r\n{\"jsonrpc\"", tc.head, host)
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("no response while the body is pending: %v", err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d, want %d", resp.StatusCode, tc.want)
			}
			// Then the broker closes the connection rather than wait for the rest.
			if _, err := br.ReadByte(); err != io.EOF && !isReset(err) {
				t.Fatalf("connection still open after the response: %v", err)
			}
		})
	}
}

func isReset(err error) bool {
	return err != nil && strings.Contains(err.Error(), "connection reset")
}

// TestUnauthenticatedRateIsPerAddress: past the burst, requests without a
// valid token from one address get 429 (and are not logged one by one);
// other addresses and authenticated requests are unaffected.
func TestUnauthenticatedRateIsPerAddress(t *testing.T) {
	b := StartHTTP(t, BrokerOpts{Token: testToken, Env: map[string]string{"SANDBOX_BACKEND": "none"}})
	from := func(src, token string) int {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		hc := &http.Client{Transport: &http.Transport{DialContext: d.DialContext}, Timeout: 10 * time.Second}
		defer hc.CloseIdleConnections()
		req, _ := http.NewRequest(http.MethodGet, b.URL+"/metrics", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusTooManyRequests && resp.Header.Get("Retry-After") == "" {
			t.Error("429 without Retry-After")
		}
		return resp.StatusCode
	}
	codes := map[int]int{}
	for i := 0; i < 120; i++ {
		codes[from("127.0.0.7", "")]++
	}
	if codes[http.StatusTooManyRequests] == 0 || codes[http.StatusUnauthorized] == 0 || len(codes) != 2 {
		t.Fatalf("120 unauthenticated requests from one address: %v, want 401s then 429s", codes)
	}
	if code := from("127.0.0.8", ""); code != http.StatusUnauthorized {
		t.Errorf("another address: %d, want 401", code)
	}
	if code := from("127.0.0.7", testToken); code != http.StatusOK {
		t.Errorf("authenticated from the limited address: %d, want 200", code)
	}
	if n := strings.Count(b.Logs(), `"auth_rejected"`); n > 60 {
		t.Errorf("%d auth_rejected lines for 121 refusals: not throttled", n)
	}
}
