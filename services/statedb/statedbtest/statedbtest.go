// Package statedbtest gives tests both stores: a SQLite file and a fresh
// database on a real PostgreSQL server. The server is the one named by
// SANDBOX_TEST_DATABASE_URL (.ci/run starts it with tests/pg/cluster.sh);
// without it a test skips, or fails when CI=true. Cluster starts a private
// server for tests that restart it.
package statedbtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // registers driver "pgx"
)

// EnvURL names the server tests create their databases on.
const EnvURL = "SANDBOX_TEST_DATABASE_URL"

// Store is one kind of store: Loc returns a fresh, empty store's location
// (a file path or a URL) for t.
type Store struct {
	Name string
	Loc  func(t testing.TB) string
}

// SQLite is a state.db file in t's temp dir.
var SQLite = Store{Name: "sqlite", Loc: func(t testing.TB) string { return filepath.Join(t.TempDir(), "state.db") }}

// Postgres is a fresh database on the test server.
var Postgres = Store{Name: "postgres", Loc: PostgresURL}

// Stores are the stores every store test runs against.
var Stores = []Store{SQLite, Postgres}

// Run runs fn as a subtest (or sub-benchmark) per store.
func Run[T interface {
	testing.TB
	Run(string, func(T)) bool
}](t T, fn func(t T, st Store)) {
	for _, st := range Stores {
		t.Run(st.Name, func(t T) { fn(t, st) })
	}
}

// PostgresURL creates an empty database on the test server, dropped when
// t ends, and returns its URL.
func PostgresURL(t testing.TB) string {
	t.Helper()
	base := os.Getenv(EnvURL)
	if base == "" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but %s is not set: start a server with tests/pg/cluster.sh", EnvURL)
		}
		t.Skipf("%s is not set (start a server with tests/pg/cluster.sh)", EnvURL)
	}
	return NewDatabase(t, base)
}

// NewDatabase creates an empty database on the server at base (a URL
// naming any database there), dropped when t ends.
func NewDatabase(t testing.TB, base string) string {
	t.Helper()
	b := make([]byte, 6)
	rand.Read(b)
	name := "t_" + hex.EncodeToString(b)
	admin, err := sql.Open("pgx", base)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("create test database on %s: %v", EnvURL, err)
	}
	t.Cleanup(func() {
		db, err := sql.Open("pgx", base)
		if err != nil {
			return
		}
		defer db.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		db.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	})
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}

// Server is a private PostgreSQL server, stopped when the test ends.
type Server struct {
	URL string // its "postgres" database
	dir string
}

// Cluster starts a private server on a free loopback port.
func Cluster(t testing.TB) *Server {
	t.Helper()
	if _, err := os.Stat(script()); err != nil {
		t.Fatal(err)
	}
	if os.Getenv("CI") != "true" {
		if m, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb"); len(m) == 0 {
			t.Skip("PostgreSQL server binaries are not installed")
		}
	}
	dir, err := os.MkdirTemp("", "pgtest")
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755) // the postgres user must reach its data dir
	t.Cleanup(func() { os.RemoveAll(dir) })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s := &Server{dir: filepath.Join(dir, "c")}
	out, err := s.run("start", s.dir, fmt.Sprint(port))
	if err != nil {
		t.Fatalf("start PostgreSQL: %v", err)
	}
	t.Cleanup(func() { s.run("stop", s.dir) })
	s.URL = strings.TrimSpace(out)
	return s
}

// Restart restarts the server (fast shutdown: open connections are cut).
func (s *Server) Restart() error {
	_, err := s.run("restart", s.dir)
	return err
}

func (s *Server) run(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, script(), args...).Output()
	if ee, ok := err.(*exec.ExitError); ok {
		err = fmt.Errorf("%w: %s", err, ee.Stderr)
	}
	return string(out), err
}

func script() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "tests", "pg", "cluster.sh")
}
