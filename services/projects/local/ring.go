package local

import "sync"

// ring keeps the last max bytes written to it.
type ring struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func newRing(max int) *ring { return &ring{max: max} }

// Write appends p, dropping the oldest bytes beyond max.
func (r *ring) Write(p []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(p) >= r.max {
		r.buf = append(r.buf[:0], p[len(p)-r.max:]...)
		return
	}
	if drop := len(r.buf) + len(p) - r.max; drop > 0 {
		r.buf = append(r.buf[:0], r.buf[drop:]...)
	}
	r.buf = append(r.buf, p...)
}

// Tail returns a copy of the last n bytes.
func (r *ring) Tail(n int) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return tail(r.buf, n)
}

// lineRing keeps the last max lines.
type lineRing struct {
	mu    sync.Mutex
	lines []string
	max   int
}

func newLineRing(max int) *lineRing { return &lineRing{max: max} }

func (r *lineRing) Add(l string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.lines) >= r.max {
		r.lines = append(r.lines[:0], r.lines[len(r.lines)-r.max+1:]...)
	}
	r.lines = append(r.lines, l)
}

func (r *lineRing) Lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.lines...)
}
