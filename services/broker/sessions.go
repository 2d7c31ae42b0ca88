package broker

import (
	"net/http"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

const (
	sessionHeader  = "Mcp-Session-Id"
	sessionIdleTTL = time.Hour
	maxSessions    = 10000
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
	if len(s.owners) >= maxSessions {
		s.sweepLocked()
	}
	s.owners[id] = sessionOwner{principal: principal, lastSeen: time.Now()}
}

func (s *sessionOwners) forget(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.owners, id)
}

// sweepLocked drops idle sessions, then the oldest if still full.
func (s *sessionOwners) sweepLocked() {
	cutoff := time.Now().Add(-sessionIdleTTL)
	var oldestID string
	var oldest time.Time
	for id, o := range s.owners {
		if o.lastSeen.Before(cutoff) {
			delete(s.owners, id)
			continue
		}
		if oldestID == "" || o.lastSeen.Before(oldest) {
			oldestID, oldest = id, o.lastSeen
		}
	}
	if len(s.owners) >= maxSessions {
		delete(s.owners, oldestID)
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
