package jobs

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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
	// EventEgressDenied: the job's network proxy refused a request (the
	// first time for each host, port and rule).
	EventEgressDenied = "egress_denied"
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
	Host   string          `json:"host,omitempty"` // egress_denied
	Port   int             `json:"port,omitempty"`
	Rule   string          `json:"rule,omitempty"`
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
	written int64 // data bytes appended since open, for readers that gather
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
	l.written += int64(len(e.Data))
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

// counters returns the next seq and the data bytes written so far.
func (l *eventLog) counters() (next, written int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.next, l.written
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
	// logNext and logWritten are the log's counters when the page was
	// read: what a gathering reader counts new events from.
	logNext, logWritten int64
}

// read returns events with Seq > since, at most maxEvents and about
// maxBytes of data.
func (l *eventLog) read(since int64, maxEvents int, maxBytes int) (Page, error) {
	l.mu.Lock()
	first, next, written := l.first, l.next, l.written
	segs, err := l.segments()
	l.mu.Unlock()
	if err != nil {
		return Page{}, err
	}
	p := Page{Next: since, logNext: next, logWritten: written}
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

// tailBytes is how much of a segment's end lastSeqOnDisk reads first: an
// ended job's last event (exit, timeout, …) is a short line.
const tailBytes = 16 << 10

// lastSeqOnDisk returns the seq of the last event in the log in dir,
// reading only the end of the newest segment unless its last line is
// longer than tailBytes.
func lastSeqOnDisk(dir string) (int64, error) {
	l := &eventLog{dir: dir}
	segs, err := l.segments()
	if err != nil {
		return 0, err
	}
	for i := len(segs) - 1; i >= 0; i-- {
		path := filepath.Join(dir, segName(segs[i]))
		seq, err := lastSeqInTail(path)
		if err != nil {
			return 0, err
		}
		if seq == 0 { // no whole event in the tail: read it all
			err = scanSegment(path, func(e Event) bool {
				seq = max(seq, e.Seq)
				return true
			})
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				return 0, err
			}
		}
		if seq > 0 {
			return seq, nil
		}
	}
	return 0, nil
}

// lastSeqInTail parses the last whole event line within the file's final
// tailBytes; 0 when there is none.
func lastSeqInTail(path string) (int64, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	off := max(fi.Size()-tailBytes, 0)
	buf := make([]byte, fi.Size()-off)
	if _, err := f.ReadAt(buf, off); err != nil && !errors.Is(err, io.EOF) {
		return 0, err
	}
	lines := bytes.Split(buf, []byte("\n"))
	// The first piece may be cut (unless the tail is the whole file). A
	// torn last line does not parse and is skipped, as scanSegment does.
	first := 1
	if off == 0 {
		first = 0
	}
	for i := len(lines) - 1; i >= first; i-- {
		var e Event
		if json.Unmarshal(lines[i], &e) == nil && e.Seq > 0 {
			return e.Seq, nil
		}
	}
	return 0, nil
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
