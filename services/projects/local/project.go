package local

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

const (
	seedTimeout     = 60 * time.Second
	buildOutputMax  = 1 << 20   // what Build returns of a build's output
	lastBuildMax    = 256 << 10 // what is kept of the last build's output
	consoleMaxBytes = 256 << 10 // the node server's output ring
	requestLogLines = 200       // the static preview's request log
)

// project is one project sandbox. It implements projects.Sandbox.
type project struct {
	p        *Provider
	id       string
	template string
	dir      string // host workspace directory
	sess     sandbox.Session
	// owner gives what the broker writes into the workspace to the
	// project sandbox's uid.
	owner func(context.Context) (workspace.Option, error)

	mu        sync.Mutex // guards the build state; WriteFiles holds it while writing
	gen       uint64     // bumped by WriteFiles and builds: the app server restarts
	building  bool       // a build job runs: files stay as they are until it ends
	built     bool
	lastBuild []byte
	lastExit  int

	console  *ring     // the app server's stdout and stderr
	requests *lineRing // static previews: "GET /path -> 200"

	srv server // the node template's app server
}

// ID implements projects.Sandbox.
func (pr *project) ID() string { return pr.id }

// static reports whether the template is served from its build output.
func (pr *project) static() bool { return pr.template != "node" }

// outDir is where the template's build writes the static site.
func (pr *project) outDir() string {
	if pr.template == "next" {
		return "out"
	}
	return "dist"
}

func (pr *project) workspace(opts ...workspace.Option) (*workspace.Workspace, error) {
	return workspace.Open(pr.dir, pr.p.o.WorkspaceLimits, append(opts, workspace.WithForbiddenNames(projects.ForbiddenPrefixes...))...)
}

func (pr *project) generation() uint64 {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return pr.gen
}

// seed copies the starter's files from the image into the workspace and
// links its installed dependencies (read-only in the image).
func (pr *project) seed(ctx context.Context) error {
	// pr.template comes from projects.Templates, never from the caller.
	code := fmt.Sprintf(`set -e
cd /opt/starters/%[1]s
find . -mindepth 1 -maxdepth 1 ! -name node_modules -exec cp -R -t /mnt/data/ {} +
ln -sfn /opt/starters/%[1]s/node_modules /mnt/data/node_modules
`, pr.template)
	ctx, cancel := context.WithTimeout(ctx, createTimeout)
	defer cancel()
	res, err := pr.sess.Exec(ctx, sandbox.ExecRequest{Language: Language, Code: code, Timeout: seedTimeout, MaxOutputBytes: 16 << 10})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 || res.TimedOut {
		pr.p.log.Warn().Str("project", pr.id).Int("exit", res.ExitCode).Bool("timed_out", res.TimedOut).Msg("project_seed_failed")
		return brokererr.New(brokererr.Unavailable, "the %s starter could not be copied into the sandbox", pr.template)
	}
	return nil
}

// WriteFiles implements projects.Sandbox on the host side of the workspace.
func (pr *project) WriteFiles(ctx context.Context, files map[string][]byte) error {
	paths := make([]string, 0, len(files))
	for p := range files {
		if _, err := workspace.ValidatePath(p, projects.ForbiddenPrefixes...); err != nil {
			return err
		}
		paths = append(paths, p)
	}
	sort.Strings(paths)
	own, err := pr.owner(ctx)
	if err != nil {
		return err
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	if pr.building {
		return errBuilding()
	}
	w, err := pr.workspace(own)
	if err != nil {
		return err
	}
	defer w.Close()
	pr.gen++
	for _, p := range paths {
		if err := ctx.Err(); err != nil {
			return brokererr.Wrap(err, brokererr.Unavailable, "the call was cancelled")
		}
		if err := w.Write(p, files[p], true); err != nil {
			return err
		}
	}
	return nil
}

// ReadFile implements projects.Sandbox: a file larger than max is refused,
// never cut, since commits must not store half a file.
func (pr *project) ReadFile(ctx context.Context, path string, max int64) ([]byte, error) {
	w, err := pr.workspace()
	if err != nil {
		if brokererr.CodeOf(err) == brokererr.SandboxNotFound {
			return nil, notFound()
		}
		return nil, err
	}
	defer w.Close()
	if lim := w.Limits().MaxFileBytes; max <= 0 || max > lim {
		max = lim
	}
	f, fi, err := w.OpenFile(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi.Size() > max {
		return nil, brokererr.New(brokererr.FileSizeExceeded, "file is larger than %d bytes", max)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1)) // it may grow meanwhile
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.InternalError, "cannot read file")
	}
	if int64(len(b)) > max {
		return nil, brokererr.New(brokererr.FileSizeExceeded, "file is larger than %d bytes", max)
	}
	return b, nil
}

func errBuilding() error {
	return brokererr.New(brokererr.Conflict, "a build of this sandbox is running; wait for its execution to end (get_execution_output) or cancel it (cancel_execution)")
}

// StartBuild implements projects.JobBuilder: `npm run build` as a job in
// the project's container, its output streamed to sink as it comes. While
// it runs, WriteFiles and another build answer CONFLICT; when it ends the
// app server restarts on the next preview.
func (pr *project) StartBuild(ctx context.Context, id string, sink sandbox.JobSink) (sandbox.Job, error) {
	jr, ok := pr.sess.(sandbox.JobRunner)
	if !ok {
		return nil, brokererr.New(brokererr.Unavailable, "this sandbox backend cannot run project builds")
	}
	pr.mu.Lock()
	if pr.building {
		pr.mu.Unlock()
		return nil, errBuilding()
	}
	pr.building = true
	pr.gen++
	pr.mu.Unlock()
	out := newRing(lastBuildMax)
	tee := func(stream string, data []byte) {
		out.Write(data)
		sink(stream, data)
	}
	job, err := jr.StartJob(ctx, sandbox.JobSpec{ID: id, Language: Language, Command: "npm run build 2>&1", Timeout: projects.CommandTimeout}, tee)
	if err != nil {
		pr.mu.Lock()
		pr.building = false
		pr.mu.Unlock()
		return nil, err
	}
	b := &buildJob{Job: job, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		<-job.Done()
		x := job.Exit()
		exit := x.ExitCode
		switch {
		case x.TimedOut:
			tee(sandbox.StreamStdout, fmt.Appendf(nil, "\n[the build was stopped after %s]\n", projects.CommandTimeout))
			exit = -1
		case x.Err != nil:
			exit = -1
		case x.Signal == "SIGKILL":
			tee(sandbox.StreamStdout, fmt.Appendf(nil, "\n[the build was killed (SIGKILL): cancelled, or out of memory (the limit is %d MiB)]\n", projects.MemoryBytes>>20))
		}
		pr.mu.Lock()
		pr.building, pr.built = false, true
		pr.gen++
		pr.lastExit = exit
		pr.lastBuild = out.Tail(lastBuildMax)
		pr.mu.Unlock()
		pr.p.log.Info().Str("project", pr.id).Int("exit", exit).Bool("timed_out", x.TimedOut).
			Int64("duration_ms", x.Duration.Milliseconds()).Msg("project_build")
	}()
	return b, nil
}

// buildJob is a build's job, done once the project has recorded its end.
type buildJob struct {
	sandbox.Job
	done chan struct{}
}

func (b *buildJob) Done() <-chan struct{} { return b.done }

// Build implements projects.Sandbox: StartBuild, waited for. A build that
// runs out of time returns what it printed, a note and exit code -1; one
// whose caller gives up is stopped.
func (pr *project) Build(ctx context.Context) ([]byte, int, error) {
	out := newRing(buildOutputMax)
	job, err := pr.StartBuild(ctx, files.NewWorkspaceID(), func(_ string, data []byte) { out.Write(data) })
	if err != nil {
		return nil, -1, err
	}
	select {
	case <-job.Done():
	case <-ctx.Done():
		stopJob(ctx, job)
		return nil, -1, brokererr.Wrap(ctx.Err(), brokererr.Unavailable, "the call was cancelled; the build was stopped")
	}
	x := job.Exit()
	if x.Err != nil {
		return nil, -1, brokererr.Wrap(x.Err, brokererr.Unavailable, "the build's sandbox stopped answering")
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return out.Tail(buildOutputMax), pr.lastExit, nil
}

// ConsoleLog implements projects.Sandbox. For the node template it is the
// app server's stdout and stderr; for static templates (react, vue, next)
// there is no server process, so it is the last build's warning and error
// lines followed by the preview's request log ("GET /path -> 200").
func (pr *project) ConsoleLog(ctx context.Context, max int) ([]byte, error) {
	if max <= 0 {
		max = consoleMaxBytes
	}
	if !pr.static() {
		return pr.console.Tail(max), nil
	}
	var b bytes.Buffer
	pr.mu.Lock()
	if pr.building {
		b.WriteString("[a build is running]\n")
	}
	if pr.built {
		fmt.Fprintf(&b, "[last build: exit %d]\n", pr.lastExit)
		for _, l := range warningLines(pr.lastBuild) {
			b.WriteString(l)
			b.WriteByte('\n')
		}
	} else {
		b.WriteString("[no build yet]\n")
	}
	pr.mu.Unlock()
	b.WriteString("[preview requests]\n")
	for _, l := range pr.requests.Lines() {
		b.WriteString(l)
		b.WriteByte('\n')
	}
	return tail(b.Bytes(), max), nil
}

// warningLines picks the lines of a build's output that report a problem.
func warningLines(out []byte) []string {
	var lines []string
	for l := range strings.SplitSeq(string(out), "\n") {
		ll := strings.ToLower(l)
		if strings.Contains(ll, "warn") || strings.Contains(ll, "error") ||
			strings.Contains(l, "(!)") || strings.Contains(l, "⚠") {
			lines = append(lines, strings.TrimRight(l, "\r"))
		}
	}
	return lines
}

// PreviewURL implements projects.Sandbox.
func (pr *project) PreviewURL(ctx context.Context) (string, error) {
	u, err := pr.p.o.Link(pr.id)
	if be := brokererr.As(err); be != nil {
		return "", be // e.g. no public URL to link to: the message says so
	}
	if err != nil {
		return "", brokererr.Wrap(err, brokererr.InternalError, "cannot make the preview link")
	}
	return u, nil
}

// release stops the app server and the containers; files stay.
func (pr *project) release(ctx context.Context) error {
	pr.srv.stop(ctx)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer cancel()
	return pr.sess.Release(ctx)
}

// destroy stops everything and deletes the workspace.
func (pr *project) destroy(ctx context.Context) error {
	pr.srv.stop(ctx)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer cancel()
	return pr.sess.Destroy(ctx)
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return append([]byte{}, b...)
}
