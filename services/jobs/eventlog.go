package jobs

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Event types, in the spec's vocabulary.
const (
	EventReady     = "ready"
	EventStdout    = "stdout"
	EventStderr    = "stderr"
	EventExit      = "exit"
	EventTimeout   = "timeout"
	EventError     = "error"
	EventCancelled = "cancelled"
	// A coding agent's task (execute_task) turns the agent's stream into
	// these instead of stdout events.
	EventAssistant  = "assistant"   // Data: the agent's text
	EventToolUse    = "tool_use"    // Tool: the tool it called; Data: the input (JSON)
	EventToolResult = "tool_result" // Data: what the tool returned; IsError when it failed
	EventResult     = "result"      // Data: the agent's final answer
	EventTask       = "task"        // Detail: the task's outcome, just before the closing event
)

// Event is one entry of a job's output log. Seq increases by one per event
// from 1; a reader passes the last Seq it saw as `since`.
type Event struct {
	Seq            int64  `json:"seq"`
	TS             string `json:"ts"`
	Type           string `json:"type"`
	Data           string `json:"data,omitempty"`
	Code           *int   `json:"code,omitempty"`
	Signal         string `json:"signal,omitempty"`
	DurationMS     *int64 `json:"duration_ms,omitempty"`
	TimeoutSeconds int    `json:"timeout_seconds,omitempty"`
	Message        string `json:"message,omitempty"`
	Tool           string `json:"tool,omitempty"`
	IsError        bool   `json:"is_error,omitempty"`
	// Detail is a structured payload (the task event's outcome).
	Detail json.RawMessage `json:"detail,omitempty"`
}

// eventLog is a job's bounded on-disk log: JSON lines in at most two
// segment files of half the cap each. When the newer segment fills, the
// older one is deleted, so the oldest events go first and a reader can
// tell how many it missed from the first sequence number still on disk.
type eventLog struct {
	dir     string
	segMax  int64
	mu      sync.Mutex
	cur     *os.File
	curN    int   // current segment number
	curSize int64 // bytes in the current segment
	next    int64 // next seq to assign
	first   int64 // first seq still on disk (0 when empty)
	changed chan struct{}
	closed  bool
}

func segName(n int) string { return fmt.Sprintf("seg-%08d.jsonl", n) }

func segNum(name string) (int, bool) {
	if !strings.HasPrefix(name, "seg-") || !strings.HasSuffix(name, ".jsonl") {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(name, "seg-"), ".jsonl"))
	return n, err == nil && n > 0
}

// openLog opens (creating) the log in dir, resuming after the last event
// already on disk.
func openLog(dir string, maxBytes int64) (*eventLog, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	l := &eventLog{dir: dir, segMax: max(maxBytes/2, 4096), next: 1, changed: make(chan struct{})}
	segs, err := l.segments()
	if err != nil {
		return nil, err
	}
	for _, n := range segs {
		err := scanSegment(filepath.Join(dir, segName(n)), func(e Event) bool {
			if l.first == 0 {
				l.first = e.Seq
			}
			if e.Seq >= l.next {
				l.next = e.Seq + 1
			}
			return true
		})
		if err != nil {
			return nil, err
		}
	}
	n := 1
	if len(segs) > 0 {
		n = segs[len(segs)-1]
	}
	if err := l.openSegment(n); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *eventLog) segments() ([]int, error) {
	ents, err := os.ReadDir(l.dir)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, e := range ents {
		if n, ok := segNum(e.Name()); ok && e.Type().IsRegular() {
			out = append(out, n)
		}
	}
	sort.Ints(out)
	return out, nil
}

func (l *eventLog) openSegment(n int) error {
	f, err := os.OpenFile(filepath.Join(l.dir, segName(n)), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return err
	}
	l.cur, l.curN, l.curSize = f, n, fi.Size()
	return nil
}

// append stamps e with the next seq and the time, and writes it.
func (l *eventLog) append(e Event, now time.Time) (Event, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return e, errors.New("job log closed")
	}
	e.Seq = l.next
	e.TS = now.UTC().Format(time.RFC3339Nano)
	b, err := json.Marshal(e)
	if err != nil {
		return e, err
	}
	b = append(b, '\n')
	if l.curSize > 0 && l.curSize+int64(len(b)) > l.segMax {
		if err := l.rotate(); err != nil {
			return e, err
		}
	}
	if _, err := l.cur.Write(b); err != nil {
		return e, err
	}
	l.curSize += int64(len(b))
	l.next++
	if l.first == 0 {
		l.first = e.Seq
	}
	close(l.changed)
	l.changed = make(chan struct{})
	return e, nil
}

// rotate starts a new segment and deletes all but the previous one.
func (l *eventLog) rotate() error {
	if err := l.cur.Close(); err != nil {
		return err
	}
	prev := l.curN
	if err := l.openSegment(prev + 1); err != nil {
		return err
	}
	segs, err := l.segments()
	if err != nil {
		return err
	}
	for _, n := range segs {
		if n < prev {
			if err := os.Remove(filepath.Join(l.dir, segName(n))); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
		}
	}
	// The oldest kept event is the first one of segment prev.
	l.first = 0
	return scanSegment(filepath.Join(l.dir, segName(prev)), func(e Event) bool {
		l.first = e.Seq
		return false
	})
}

// wait returns a channel closed at the next append.
func (l *eventLog) wait() <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.changed
}

// Page is one read of a job's log.
type Page struct {
	Events []Event
	// Dropped counts events after `since` that were deleted to respect the
	// log's size cap before this read.
	Dropped int64
	// Next is the cursor for the following read (the last Seq returned,
	// or, when nothing was, since or the last dropped Seq).
	Next int64
	// More says events remain after this page.
	More bool
}

// read returns events with Seq > since, at most maxEvents and about
// maxBytes of data.
func (l *eventLog) read(since int64, maxEvents int, maxBytes int) (Page, error) {
	l.mu.Lock()
	first, next := l.first, l.next
	segs, err := l.segments()
	l.mu.Unlock()
	if err != nil {
		return Page{}, err
	}
	p := Page{Next: since}
	size := 0
	for _, n := range segs {
		err := scanSegment(filepath.Join(l.dir, segName(n)), func(e Event) bool {
			if e.Seq <= since || e.Seq >= next {
				return true
			}
			if len(p.Events) >= maxEvents || (size > 0 && size+len(e.Data) > maxBytes) {
				p.More = true
				return false
			}
			p.Events = append(p.Events, e)
			size += len(e.Data)
			p.Next = e.Seq
			return true
		})
		if errors.Is(err, fs.ErrNotExist) {
			// Rotated away between listing and reading: rotation deletes
			// the oldest segments only, so these events precede the rest.
			continue
		}
		if err != nil {
			return Page{}, err
		}
		if p.More {
			break
		}
	}
	// Dropped counts from what was actually read, so a rotation during the
	// read is reported too; the cursor moves past what was dropped, so
	// nothing is reported twice.
	switch {
	case len(p.Events) > 0:
		p.Dropped = max(0, p.Events[0].Seq-since-1)
	case first > since+1:
		p.Dropped = first - since - 1
		p.Next = first - 1
	}
	return p, nil
}

// scanSegment calls fn for each well-formed event line until fn returns
// false. A torn last line (crash mid-write) is skipped.
func scanSegment(path string, fn func(Event) bool) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		var e Event
		if json.Unmarshal(sc.Bytes(), &e) != nil || e.Seq <= 0 {
			continue
		}
		if !fn(e) {
			return nil
		}
	}
	return sc.Err()
}

func (l *eventLog) close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	return l.cur.Close()
}
