package broker

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

const (
	sessionHeader  = "Mcp-Session-Id"
	sessionIdleTTL = time.Hour
	// perPrincipalSessions caps one principal's sessions; over it, that
	// principal's own oldest session is dropped, never someone else's.
	perPrincipalSessions = 100
	// maxSessions bounds memory whatever the token registry holds.
	maxSessions = 100000
)

// sessionOwners binds MCP session IDs to the principal that created them,
// so a leaked or guessed session ID is useless to anyone else: requests that
// name a session owned by someone else, or unknown to us, get 404.
type sessionOwners struct {
	mu     sync.Mutex
	owners map[string]sessionOwner
}

type sessionOwner struct {
	principal string
	lastSeen  time.Time
}

func newSessionOwners() *sessionOwners {
	return &sessionOwners{owners: map[string]sessionOwner{}}
}

func (s *sessionOwners) bind(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, _ := identity.FromContext(r.Context())
		id := r.Header.Get(sessionHeader)
		if id != "" {
			if !s.touch(id, p.ID) {
				writeRPCError(w, http.StatusNotFound, -32001, "session not found")
				return
			}
			next.ServeHTTP(w, r)
			if r.Method == http.MethodDelete {
				s.forget(id)
			}
			return
		}
		next.ServeHTTP(&sessionRecorder{ResponseWriter: w, owners: s, principal: p.ID}, r)
	})
}

// touch reports whether id belongs to principal, refreshing it.
func (s *sessionOwners) touch(id, principal string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.owners[id]
	if !ok || o.principal != principal {
		return false
	}
	o.lastSeen = time.Now()
	s.owners[id] = o
	return true
}

func (s *sessionOwners) record(id, principal string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := s.countLocked(principal); n >= perPrincipalSessions {
		s.evictOldestLocked(func(o sessionOwner) bool { return o.principal == principal })
	}
	if len(s.owners) >= maxSessions {
		s.sweepLocked()
	}
	s.owners[id] = sessionOwner{principal: principal, lastSeen: time.Now()}
}

func (s *sessionOwners) countLocked(principal string) int {
	n := 0
	for _, o := range s.owners {
		if o.principal == principal {
			n++
		}
	}
	return n
}

// evictOldestLocked drops the least recently seen session matching keep.
func (s *sessionOwners) evictOldestLocked(match func(sessionOwner) bool) {
	var oldestID string
	var oldest time.Time
	for id, o := range s.owners {
		if match(o) && (oldestID == "" || o.lastSeen.Before(oldest)) {
			oldestID, oldest = id, o.lastSeen
		}
	}
	delete(s.owners, oldestID)
}

func (s *sessionOwners) forget(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.owners, id)
}

// sweepLocked drops idle sessions, then the oldest if still full.
func (s *sessionOwners) sweepLocked() {
	cutoff := time.Now().Add(-sessionIdleTTL)
	for id, o := range s.owners {
		if o.lastSeen.Before(cutoff) {
			delete(s.owners, id)
		}
	}
	if len(s.owners) >= maxSessions {
		s.evictOldestLocked(func(sessionOwner) bool { return true })
	}
}

// sessionRecorder notes the session ID the MCP layer assigns on initialize.
type sessionRecorder struct {
	http.ResponseWriter
	owners    *sessionOwners
	principal string
	done      bool
}

func (w *sessionRecorder) WriteHeader(code int) {
	if !w.done {
		w.done = true
		if id := w.Header().Get(sessionHeader); id != "" && code < 300 {
			w.owners.record(id, w.principal)
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *sessionRecorder) Write(p []byte) (int, error) {
	if !w.done {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(p)
}

// Flush keeps SSE streaming working through the wrapper.
func (w *sessionRecorder) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the real writer.
func (w *sessionRecorder) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// sessionIDs is the MCP transport's session-ID manager. mcp-go's stateful
// manager never forgets terminated IDs, so a client looping on initialize
// would grow it without bound; this one forgets IDs idle past the TTL and
// caps both tables.
type sessionIDs struct {
	mu         sync.Mutex
	live       map[string]time.Time // last seen
	terminated map[string]time.Time
}

const sessionIDPrefix = "mcp-session-"

func newSessionIDs() *sessionIDs {
	return &sessionIDs{live: map[string]time.Time{}, terminated: map[string]time.Time{}}
}

// Generate returns a new 128-bit random session ID.
func (m *sessionIDs) Generate() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	id := sessionIDPrefix + hex.EncodeToString(b[:])
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pruneLocked(m.live)
	m.live[id] = time.Now()
	return id
}

// Validate reports terminated IDs, refreshes live ones and rejects the rest.
func (m *sessionIDs) Validate(id string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.terminated[id]; ok {
		return true, nil
	}
	if _, ok := m.live[id]; !ok {
		return false, errors.New("session not found")
	}
	m.live[id] = time.Now()
	return false, nil
}

// Terminate ends a live session.
func (m *sessionIDs) Terminate(id string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.live[id]; ok {
		delete(m.live, id)
		m.pruneLocked(m.terminated)
		m.terminated[id] = time.Now()
	}
	return false, nil
}

// pruneLocked drops entries idle past the TTL, then the oldest while full.
func (m *sessionIDs) pruneLocked(t map[string]time.Time) {
	if len(t) < maxSessions {
		return
	}
	cutoff := time.Now().Add(-sessionIdleTTL)
	for id, seen := range t {
		if seen.Before(cutoff) {
			delete(t, id)
		}
	}
	for len(t) >= maxSessions {
		var oldestID string
		var oldest time.Time
		for id, seen := range t {
			if oldestID == "" || seen.Before(oldest) {
				oldestID, oldest = id, seen
			}
		}
		delete(t, oldestID)
	}
}
