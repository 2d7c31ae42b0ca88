package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// sseEvent is one server-sent event. Data is an HTML fragment rendered by
// html/template (so every value in it is escaped), swapped in by htmx's
// SSE extension.
type sseEvent struct {
	ID   int64
	Name string
	Data string
}

// sse writes an event stream.
type sse struct {
	mu sync.Mutex // a tail's pings come from another goroutine
	w  http.ResponseWriter
	rc *http.ResponseController
}

// startSSE sends the stream's headers. Nothing may be cached or buffered
// on the way (X-Accel-Buffering: nginx).
func startSSE(w http.ResponseWriter) *sse {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	s := &sse{w: w, rc: http.NewResponseController(w)}
	_ = s.rc.Flush()
	return s
}

// send writes one event; multi-line data goes out as several data lines.
func (s *sse) send(e sseEvent) error {
	var b strings.Builder
	if e.ID > 0 {
		fmt.Fprintf(&b, "id: %d\n", e.ID)
	}
	if e.Name != "" {
		fmt.Fprintf(&b, "event: %s\n", e.Name)
	}
	for _, line := range strings.Split(e.Data, "\n") {
		b.WriteString("data: ")
		b.WriteString(strings.TrimSuffix(line, "\r"))
		b.WriteByte('\n')
	}
	b.WriteByte('\n')
	return s.write(b.String())
}

func (s *sse) write(text string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.w.Write([]byte(text)); err != nil {
		return err
	}
	return s.rc.Flush()
}

// ping keeps proxies from closing an idle stream.
func (s *sse) ping() error { return s.write(": ping\n\n") }

// lastEventID is where a reconnecting EventSource resumes.
func lastEventID(r *http.Request) int64 {
	n, err := strconv.ParseInt(r.Header.Get("Last-Event-ID"), 10, 64)
	if err != nil || n < 0 {
		return 0
	}
	return n
}

const keepAlive = 15 * time.Second

// A run is a streamed tool call the console started on a POST (run_code,
// a project build): its events are kept until it ends and a little
// after, so the browser's EventSource can connect, and reconnect, to
// read them.
type run struct {
	id    string
	owner string // the console session's key
	mu    sync.Mutex
	evs   []sseEvent
	bytes int
	done  bool
	ended time.Time
	wake  chan struct{} // closed and replaced at each event
}

// Bounds on runs: per session, in all, and what one keeps.
const (
	maxRunsPerSession = 8
	maxRuns           = 256
	maxRunBytes       = 8 << 20
	runKeep           = 5 * time.Minute
)

var errTooManyRuns = errors.New("too many runs under way")

type runRegistry struct {
	now func() time.Time
	mu  sync.Mutex
	m   map[string]*run
}

func newRunRegistry(now func() time.Time) *runRegistry {
	return &runRegistry{now: now, m: map[string]*run{}}
}

// start registers a run for a console session, dropping runs that ended
// long enough ago.
func (g *runRegistry) start(owner string) (*run, error) {
	now := g.now()
	g.mu.Lock()
	defer g.mu.Unlock()
	mine := 0
	for id, r := range g.m {
		r.mu.Lock()
		stale := r.done && now.Sub(r.ended) > runKeep
		live := !r.done
		r.mu.Unlock()
		if stale {
			delete(g.m, id)
			continue
		}
		if live && r.owner == owner {
			mine++
		}
	}
	if mine >= maxRunsPerSession || len(g.m) >= maxRuns {
		return nil, errTooManyRuns
	}
	r := &run{id: randomToken()[:22], owner: owner, wake: make(chan struct{})}
	g.m[r.id] = r
	return r, nil
}

func (g *runRegistry) get(id, owner string) (*run, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	r, ok := g.m[id]
	if !ok || r.owner != owner {
		return nil, false
	}
	return r, true
}

// emit adds an event. Past maxRunBytes only the final events get in.
func (r *run) emit(name, data string, final bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return
	}
	if !final && r.bytes+len(data) > maxRunBytes {
		return
	}
	r.bytes += len(data)
	r.evs = append(r.evs, sseEvent{ID: int64(len(r.evs) + 1), Name: name, Data: data})
	close(r.wake)
	r.wake = make(chan struct{})
}

// finish marks the run done; its last event was emitted.
func (r *run) finish(now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.done, r.ended = true, now
	close(r.wake)
	r.wake = make(chan struct{})
}

// since returns the events after id, whether the run is done, and a
// channel closed at the next event.
func (r *run) since(id int64) ([]sseEvent, bool, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if id > int64(len(r.evs)) {
		id = int64(len(r.evs))
	}
	return append([]sseEvent(nil), r.evs[id:]...), r.done, r.wake
}

// stream sends a run's events from the browser's Last-Event-ID on, until
// the run is done or the browser goes.
func (r *run) stream(ctx context.Context, w http.ResponseWriter, from int64) {
	s := startSSE(w)
	t := time.NewTicker(keepAlive)
	defer t.Stop()
	for {
		evs, done, wake := r.since(from)
		for _, e := range evs {
			if s.send(e) != nil {
				return
			}
			from = e.ID
		}
		if done {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-wake:
		case <-t.C:
			if s.ping() != nil {
				return
			}
		}
	}
}
