package broker

import (
	"errors"
	"net/http"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/mcpsessions"
)

const sessionHeader = "Mcp-Session-Id"

// bindSessions ties MCP session IDs to the principal that created them,
// so a leaked or guessed session ID is useless to anyone else: requests
// that name a session owned by someone else, or unknown, get 404. The
// binding is kept in the shared state store (services/mcpsessions), so
// any replica serves any session.
func (b *Broker) bindSessions(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, _ := identity.FromContext(r.Context())
		id := r.Header.Get(sessionHeader)
		if id != "" {
			if err := b.mcpSessions.Touch(r.Context(), id, p.ID); err != nil {
				if errors.Is(err, mcpsessions.ErrNotFound) {
					writeRPCError(w, http.StatusNotFound, -32001, "session not found")
				} else {
					writeRPCError(w, http.StatusServiceUnavailable, -32603, "the session store is unavailable; retry shortly")
				}
				return
			}
			next.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(&sessionRecorder{ResponseWriter: w, r: r, store: b.mcpSessions, principal: p.ID}, r)
	})
}

// sessionRecorder binds the session ID the MCP layer assigns on initialize
// to the caller before the response goes out.
type sessionRecorder struct {
	http.ResponseWriter
	r         *http.Request
	store     *mcpsessions.Store
	principal string
	done      bool
}

func (w *sessionRecorder) WriteHeader(code int) {
	if !w.done {
		w.done = true
		if id := w.Header().Get(sessionHeader); id != "" && code < 300 {
			if err := w.store.Bind(w.r.Context(), id, w.principal); err != nil {
				// Unbound, the ID is refused on its next use (404): the
				// client initializes again.
				code = http.StatusServiceUnavailable
				w.Header().Del(sessionHeader)
			}
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
