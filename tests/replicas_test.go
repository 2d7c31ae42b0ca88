package tests

import (
	"database/sql"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mark3labs/mcp-go/client"
	"github.com/mark3labs/mcp-go/mcp"

	"github.com/sandbox-broker/sandbox-broker/services/statedb"
	"github.com/sandbox-broker/sandbox-broker/services/statedb/statedbtest"
)

// Broker replicas: several broker processes on one DATABASE_URL. They run
// on this one host and share its SANDBOX_ROOT (the process backend's
// workspaces, the audit keys and checkpoint file), as replicas on one
// Docker host would; across hosts the workspaces need a shared backend.

// replicaHMACKey is the audit HMAC key every replica must share: they
// chain onto each other's rows.
const replicaHMACKey = "replica-hmac-key-0123456789abcdef0123456789"

// startReplicas starts n brokers one after another on one root and one
// database (in turn: the first creates the keys the others load).
func startReplicas(t *testing.T, n int, root, dbURL string, env map[string]string) []*Broker {
	t.Helper()
	e := map[string]string{"DATABASE_URL": dbURL, "AUDIT_HMAC_KEY": replicaHMACKey, "SANDBOX_ROOT_OVERLAY": "off"}
	for k, v := range env {
		e[k] = v
	}
	var out []*Broker
	for range n {
		out = append(out, StartHTTP(t, BrokerOpts{Root: root, Token: testToken, Env: e}))
	}
	return out
}

// roundRobin is a reverse proxy that sends each request to the next
// replica in turn, counting what each one served.
type roundRobin struct {
	next   atomic.Int64
	served []atomic.Int64
}

func newRoundRobin(t *testing.T, brokers []*Broker) (*roundRobin, string) {
	t.Helper()
	rr := &roundRobin{served: make([]atomic.Int64, len(brokers))}
	proxies := make([]*httputil.ReverseProxy, len(brokers))
	for i, b := range brokers {
		u, err := url.Parse(b.URL)
		if err != nil {
			t.Fatal(err)
		}
		proxies[i] = httputil.NewSingleHostReverseProxy(u)
		proxies[i].FlushInterval = -1 // SSE responses stream through
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := int(rr.next.Add(1)-1) % len(proxies)
		rr.served[i].Add(1)
		proxies[i].ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return rr, srv.URL
}

// verifyReplicaAudit runs `audit verify` on the shared database with the
// root's checkpoint file.
func verifyReplicaAudit(t *testing.T, root, dbURL string) string {
	t.Helper()
	cmd := exec.Command(brokerBin, "audit", "verify")
	cmd.Env = brokerEnv(root, "", map[string]string{"DATABASE_URL": dbURL, "AUDIT_HMAC_KEY": replicaHMACKey})
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "OK") {
		t.Fatalf("audit verify on the shared database: %v: %s", err, out)
	}
	return string(out)
}

// auditCounts checks no call was audited twice (one intent and at most one
// outcome per call ID) and returns how many calls of tool were audited
// before they ran (intent rows: a call runs only once its intent is
// written; its outcome row may be lost to a store that fails after).
func auditCounts(t *testing.T, dbURL, tool string) int {
	t.Helper()
	db, err := sql.Open("pgx", dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var dup int
	if err := db.QueryRow(`SELECT count(*) FROM (SELECT call_id, phase FROM audit GROUP BY call_id, phase HAVING count(*) > 1) AS d`).Scan(&dup); err != nil || dup != 0 {
		t.Fatalf("calls audited twice: %d (%v)", dup, err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM audit WHERE tool = $1 AND phase = 'intent'`, tool).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// One MCP client, one MCP session, served alternately by two replicas:
// the session ID and its owner, the sandbox session and its files, and
// the audit chain are all shared.
func TestReplicasServeOneClientAlternately(t *testing.T) {
	requireBwrap(t)
	dbURL := statedbtest.PostgresURL(t)
	root := brokerRoot(t)
	brokers := startReplicas(t, 2, root, dbURL, map[string]string{"SANDBOX_BACKEND": "process", "RATE_LIMIT_PER_MINUTE": "100000"})
	rr, base := newRoundRobin(t, brokers)
	c := (&Broker{URL: base}).Client(t, testToken)

	first, _ := run(t, c, map[string]any{"language": "bash", "code": "echo kept > f && cat f"})
	if !first.Success || first.Stdout != "kept\n" || first.SessionID == "" {
		t.Fatalf("first run: %+v", first)
	}
	for i := range 4 {
		r, _ := run(t, c, map[string]any{"session_id": first.SessionID, "language": "bash", "code": "cat f && echo more >> f"})
		if !r.Success || !strings.HasPrefix(r.Stdout, "kept\n") || strings.Count(r.Stdout, "\n") != i+1 {
			t.Fatalf("run %d in the session: %+v", i, r)
		}
	}
	for i := range rr.served {
		if n := rr.served[i].Load(); n < 3 {
			t.Fatalf("replica %d served %d requests; the proxy should alternate", i, n)
		}
	}
	for _, b := range brokers {
		b.Stop(t)
	}
	if n := auditCounts(t, dbURL, "run_code"); n != 5 {
		t.Fatalf("%d run_code calls audited, want 5", n)
	}
	verifyReplicaAudit(t, root, dbURL)
}

// 50 calls at once, spread over two replicas, against a limit of 37 a
// minute: exactly 37 are allowed.
func TestReplicasHoldQuotaExactly(t *testing.T) {
	dbURL := statedbtest.PostgresURL(t)
	root := brokerRoot(t)
	tokens, tok := writeTokens(t, map[string]string{"racer": "free"})
	brokers := startReplicas(t, 2, root, dbURL, map[string]string{"SANDBOX_BACKEND": "none", "MCP_TOKENS_FILE": tokens, "RATE_LIMIT_PER_MINUTE": "37"})
	_, base := newRoundRobin(t, brokers)
	var clients []*client.Client
	for range 10 {
		clients = append(clients, (&Broker{URL: base}).Client(t, tok["racer"]))
	}
	// The limit is per UTC minute: start well inside one.
	if s := time.Now().Second(); s > 50 {
		time.Sleep(time.Duration(61-s) * time.Second)
	}
	var allowed, limited atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 50 {
		c := clients[i%len(clients)]
		wg.Go(func() {
			<-start
			res := callTool(t, c, "get_usage", nil)
			if !res.IsError {
				allowed.Add(1)
				return
			}
			var e toolError
			resultJSON(t, res, &e)
			if e.Error != "RATE_LIMIT_EXCEEDED" || !e.Retryable {
				t.Errorf("refusal: %+v", e)
			}
			limited.Add(1)
		})
	}
	close(start)
	wg.Wait()
	if allowed.Load() != 37 || limited.Load() != 13 {
		t.Fatalf("allowed %d, limited %d of 50 calls over two replicas; want exactly 37 and 13", allowed.Load(), limited.Load())
	}
}

// kill -9 of one replica while both are busy: every call a client saw
// succeed is in the audit log, the chain verifies, and the other replica
// serves on.
func TestReplicaKilledMidCallKeepsAuditChain(t *testing.T) {
	dbURL := statedbtest.PostgresURL(t)
	root := brokerRoot(t)
	brokers := startReplicas(t, 2, root, dbURL, map[string]string{"SANDBOX_BACKEND": "none", "RATE_LIMIT_PER_MINUTE": "100000"})
	var ok atomic.Int64
	var clients []*client.Client
	for i := range 8 {
		clients = append(clients, brokers[i%2].Client(t, testToken))
	}
	stop := callLoop(clients, succeeded(&ok))
	eventually(t, 60*time.Second, "calls under way on both replicas", func() bool { return ok.Load() >= 300 })
	brokers[0].Kill()
	after := ok.Load()
	eventually(t, 30*time.Second, "the surviving replica serving on", func() bool { return ok.Load() >= after+100 })
	stop()
	brokers[1].Stop(t)
	if n := auditCounts(t, dbURL, "get_usage"); int64(n) < ok.Load() {
		t.Fatalf("%d successful calls answered, %d audited", ok.Load(), n)
	}
	t.Log(verifyReplicaAudit(t, root, dbURL))
}

// PostgreSQL restarting under a busy broker: calls that meet it fail with a
// clear, retryable UNAVAILABLE (as a tool error, or the transport's 503),
// none is audited twice, and the broker serves again once it is back.
func TestPostgresRestartMidCall(t *testing.T) {
	srv := statedbtest.Cluster(t)
	dbURL := statedbtest.NewDatabase(t, srv.URL)
	root := brokerRoot(t)
	b := startReplicas(t, 1, root, dbURL, map[string]string{"SANDBOX_BACKEND": "none", "RATE_LIMIT_PER_MINUTE": "100000"})[0]
	var ok, unavailable atomic.Int64
	var bad sync.Map
	var clients []*client.Client
	for range 4 {
		clients = append(clients, b.Client(t, testToken))
	}
	stop := callLoop(clients, func(res *mcp.CallToolResult, err error) {
		switch {
		case err != nil && strings.Contains(err.Error(), "unavailable; retry shortly"):
			unavailable.Add(1)
		case err != nil:
			bad.Store(err.Error(), true)
		case !res.IsError:
			ok.Add(1)
		default:
			var e struct {
				Error     string `json:"error"`
				Retryable bool   `json:"retryable"`
			}
			_ = json.Unmarshal([]byte(res.Content[0].(mcp.TextContent).Text), &e)
			if e.Error == "UNAVAILABLE" && e.Retryable {
				unavailable.Add(1)
			} else {
				bad.Store(res.Content[0].(mcp.TextContent).Text, true)
			}
		}
	})
	eventually(t, 60*time.Second, "calls under way", func() bool { return ok.Load() >= 100 })
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	after := ok.Load()
	eventually(t, 60*time.Second, "calls succeeding after the restart", func() bool { return ok.Load() >= after+100 })
	stop()
	bad.Range(func(k, _ any) bool {
		t.Errorf("unclear failure during the restart: %v", k)
		return true
	})
	t.Logf("%d calls succeeded, %d met the restart as UNAVAILABLE", ok.Load(), unavailable.Load())
	b.Stop(t)
	if n := auditCounts(t, dbURL, "get_usage"); int64(n) < ok.Load() {
		t.Fatalf("%d successful calls answered, %d audited", ok.Load(), n)
	}
	verifyReplicaAudit(t, root, dbURL)
}

// One MCP client's session on CodeSandbox, served alternately by two
// replicas: the replica that did not fork the session's VM finds it
// through the shared csb_sessions row and joins it, rather than forking a
// second one. The session's host workspace, the source of truth the VM is
// synced with, is under SANDBOX_ROOT, which these replicas share (see
// startReplicas).
func TestReplicasShareHostedSession(t *testing.T) {
	dbURL := statedbtest.PostgresURL(t)
	root := brokerRoot(t)
	fake, env := hostedFake(t)
	env["RATE_LIMIT_PER_MINUTE"] = "100000"
	brokers := startReplicas(t, 2, root, dbURL, env)
	rr, base := newRoundRobin(t, brokers)
	c := (&Broker{URL: base}).Client(t, testToken)

	// The session starts on one replica without a VM (a file upload
	// forks none); its runs then alternate between the replicas.
	var up struct {
		SessionID string `json:"session_id"`
	}
	resultJSON(t, callTool(t, c, "upload_file", map[string]any{"path": "f", "content": "kept\n"}), &up)
	for i := range 5 {
		r, _ := hostedRunCode(t, c, map[string]any{"session_id": up.SessionID, "language": "bash", "code": "cat f && echo more >> f"})
		if !r.Success || r.Backend != "codesandbox" || r.Stdout != "kept\n"+strings.Repeat("more\n", i) {
			t.Fatalf("run %d in the session: %+v", i, r)
		}
	}
	for i := range rr.served {
		if n := rr.served[i].Load(); n < 3 {
			t.Fatalf("replica %d served %d requests; the proxy should alternate", i, n)
		}
	}
	// One VM: forked by one replica, and started once more while running
	// by the other (which joined it rather than forking).
	var forks int
	for _, r := range fake.Requests() {
		if r.Method == http.MethodPost && r.Path == "/sandbox/"+runnerTpl+"/fork" {
			forks++
		}
	}
	vms := map[string]bool{}
	for _, pc := range fake.PitcherCalls() {
		vms[pc.SandboxID] = true
	}
	if forks != 1 || len(vms) != 1 {
		t.Fatalf("%d forks, agent calls to %d VMs; want one VM for the session", forks, len(vms))
	}
	vm := slices.Collect(maps.Keys(vms))[0]
	if st, _ := fake.Sandbox(vm); !slices.Equal(st.Bootups, []string{"FORK", "RUNNING"}) {
		t.Fatalf("VM %s bootups %v, want a fork and one join by the other replica", vm, st.Bootups)
	}
	db, err := sql.Open("pgx", dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var rows int
	var rowVM string
	if err := db.QueryRow(`SELECT count(*), coalesce(min(sandbox_id), '') FROM csb_sessions`).Scan(&rows, &rowVM); err != nil || rows != 1 || rowVM != vm {
		t.Fatalf("csb_sessions in the shared database: %d rows naming %q (%v); want one naming %s", rows, rowVM, err, vm)
	}
	for _, b := range brokers {
		b.Stop(t)
	}
	// The orphan sweeps are the leader's: each listed its VMs once, at start.
	listings := map[string]int{}
	for _, r := range fake.Requests() {
		if r.Method == http.MethodGet && r.Path == "/sandbox" {
			listings[r.Query.Get("tags")]++
		}
	}
	if len(listings) == 0 {
		t.Fatal("no sweep listed the tagged VMs")
	}
	for tag, n := range listings {
		if n != 1 {
			t.Errorf("VMs tagged %q listed %d times by two replicas; the leader alone sweeps", tag, n)
		}
	}
	if n := auditCounts(t, dbURL, "run_code"); n != 5 {
		t.Fatalf("%d run_code calls audited, want 5", n)
	}
	if n := auditCounts(t, dbURL, "upload_file"); n != 1 {
		t.Fatalf("%d upload_file calls audited, want 1", n)
	}
	verifyReplicaAudit(t, root, dbURL)
}

// replicaURL is dbURL with the replica's name as the connections'
// application_name, by which pg_stat_activity tells the replicas apart.
func replicaURL(t *testing.T, dbURL, name string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	return u.String()
}

// leaderHolders names the replicas holding the leader lock (by their
// connections' application_name).
func leaderHolders(t *testing.T, db *sql.DB) []string {
	t.Helper()
	// A bigint advisory key is kept as its high and low 32 bits.
	rows, err := db.Query(`SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.classid::int8 = $1 AND l.objid::int8 = $2
		AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
		statedb.LeaderLockKey>>32, statedb.LeaderLockKey&0xffffffff)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			t.Fatal(err)
		}
		out = append(out, name)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Two replicas on one database: one holds the leader lock and runs the
// leader-only loops (here the reaper of expired sessions: it reaps the
// follower's sessions too, and the follower reaps none); kill -9 of the
// leader frees its lock with its connection, and the other replica takes
// the lead and reaps.
func TestLeaderOnlyLoopsRunOnOneReplica(t *testing.T) {
	requireBwrap(t)
	dbURL := statedbtest.PostgresURL(t)
	root := brokerRoot(t)
	// An idle timeout of 10 s has the reaper look every second.
	env := map[string]string{"SANDBOX_BACKEND": "process", "RATE_LIMIT_PER_MINUTE": "100000", "SANDBOX_IDLE_TIMEOUT_MS": "10000"}
	names := []string{"replica0", "replica1"}
	var brokers []*Broker
	for _, name := range names {
		brokers = append(brokers, startReplicas(t, 1, root, replicaURL(t, dbURL, name), env)...)
	}
	db, err := sql.Open("pgx", dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	lead := -1
	eventually(t, 30*time.Second, "a replica taking the lead", func() bool {
		switch h := leaderHolders(t, db); len(h) {
		case 0:
			return false
		case 1:
			lead = slices.Index(names, h[0])
			return lead >= 0
		default:
			t.Fatalf("the leader lock held by %v", h)
			return false
		}
	})
	follower := 1 - lead
	fc := brokers[follower].Client(t, testToken)

	// expire makes a session on the follower and ages it past
	// SANDBOX_MAX_AGE_S (a day by default), as two days passing would;
	// it waits for the reaper to delete its row.
	expire := func() {
		t.Helper()
		var up struct {
			SessionID string `json:"session_id"`
		}
		resultJSON(t, callTool(t, fc, "upload_file", map[string]any{"path": "f", "content": "x"}), &up)
		if res, err := db.Exec(`UPDATE sessions SET created_at = created_at - 2*86400 WHERE session_id = $1`, up.SessionID); err != nil {
			t.Fatal(err)
		} else if n, _ := res.RowsAffected(); n != 1 {
			t.Fatalf("session %s: %d rows", up.SessionID, n)
		}
		eventually(t, 30*time.Second, "the expired session reaped", func() bool {
			var n int
			if err := db.QueryRow(`SELECT count(*) FROM sessions WHERE session_id = $1`, up.SessionID).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 0
		})
	}
	// Which replica reaped a session shows only in its log (nobody here
	// closes a session, the other way to destroy one).
	reaped := func(b *Broker) int { return strings.Count(b.Logs(), `"session_destroyed"`) }
	for range 3 {
		expire()
	}
	if got := leaderHolders(t, db); !slices.Equal(got, names[lead:lead+1]) {
		t.Fatalf("the leader lock moved to %v while both replicas ran", got)
	}
	if l, f := reaped(brokers[lead]), reaped(brokers[follower]); l != 3 || f != 0 {
		t.Fatalf("the leader reaped %d sessions and the follower %d; want 3 and 0", l, f)
	}

	brokers[lead].Kill()
	eventually(t, 30*time.Second, "the surviving replica taking the lead", func() bool {
		return slices.Equal(leaderHolders(t, db), names[follower:follower+1])
	})
	expire()
	if n := reaped(brokers[follower]); n != 1 {
		t.Fatalf("the new leader reaped %d sessions, want 1", n)
	}
}
