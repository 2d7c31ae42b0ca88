package broker

import (
	"context"
	"errors"
	"net/http"

	"github.com/mark3labs/mcp-go/server"

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
			next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), checkedSessionKey{}, id)))
			return
		}
		next.ServeHTTP(&sessionRecorder{ResponseWriter: w, r: r, store: b.mcpSessions, principal: p.ID}, r)
	})
}

// checkedSessionKey holds, on a request's context, the session ID that
// bindSessions found live, unterminated and the caller's.
type checkedSessionKey struct{}

// sessionManagers gives the MCP transport the session store, except that
// for a request whose session bindSessions has just checked it answers
// the transport's own check of that ID from it: one read of the session's
// row per request, not two.
type sessionManagers struct{ store *mcpsessions.Store }

func (m sessionManagers) ResolveSessionIdManager(r *http.Request) server.SessionIdManager {
	if r != nil {
		if id, ok := r.Context().Value(checkedSessionKey{}).(string); ok {
			return checkedSession{Store: m.store, id: id}
		}
	}
	return m.store // nil r: the transport's idle sweeper and shutdown
}

// checkedSession is the store for a request whose session id was checked.
type checkedSession struct {
	*mcpsessions.Store
	id string
}

// Validate answers for the checked ID (Touch's check implies the
// store's); any other ID goes to the store.
func (c checkedSession) Validate(id string) (bool, error) {
	if id == c.id {
		return false, nil
	}
	return c.Store.Validate(id)
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
