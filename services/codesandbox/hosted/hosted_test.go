package hosted

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/csbfake"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

const testKey = "csb_v1_hosted_test_key_0123456789"

// runnerTemplate is the operator's runner template in the fake.
const runnerTemplate = "runtpl"

type env struct {
	t    *testing.T
	fake *csbfake.Server
	b    *Backend
	root string
}

func newEnv(t *testing.T, mod func(*Options), fakeOpts ...csbfake.Option) *env {
	t.Helper()
	fake := csbfake.New(t, testKey, append([]csbfake.Option{csbfake.WithRealShell()}, fakeOpts...)...)
	fake.AddTemplate(runnerTemplate, nil, 0)
	root := t.TempDir()
	o := Options{
		API:             codesandbox.Options{BaseURL: fake.URL(), APIKey: testKey, RetryBase: time.Millisecond},
		Template:        runnerTemplate,
		DBPath:          filepath.Join(root, "state.db"),
		WorkspaceLimits: workspace.Limits{MaxFiles: 100, MaxBytes: 8 << 20, MaxFileBytes: 4 << 20},
		Log:             zerolog.Nop(),
	}
	if mod != nil {
		mod(&o)
	}
	b, err := New(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return &env{t: t, fake: fake, b: b, root: root}
}

func (e *env) open(wid, principal string) *Session {
	e.t.Helper()
	s, err := e.b.Open(ctx(e.t), sandbox.SessionRef{WorkspaceID: wid, Dir: filepath.Join(e.root, "workspaces", wid), Principal: principal})
	if err != nil {
		e.t.Fatal(err)
	}
	return s.(*Session)
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

const wid1 = "0123456789abcdef0123456789abcdef"

func TestSmoke(t *testing.T) {
	e := newEnv(t, nil)
	s := e.open(wid1, "alice")
	res, err := s.Exec(ctx(t), sandbox.ExecRequest{Language: "python", Code: "import sys\nprint('hi')\nprint('err', file=sys.stderr)\nopen('out.txt','w').write('x')\nsys.exit(3)", Timeout: 10 * time.Second})
	t.Logf("%+v %v stdout=%q stderr=%q", res, err, res.Stdout, res.Stderr)
}
