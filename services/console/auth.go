package console

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/connguard"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// Console sessions live in memory: a broker restart logs everyone out.
const (
	sessionIdle      = time.Hour
	sessionLifetime  = 12 * time.Hour
	maxSessions      = 4096
	maxPerPrincipal  = 32
	loginNonceMaxAge = 15 * time.Minute
	csrfHeader       = "X-CSRF-Token"
	csrfField        = "csrf"
)

// session is one logged-in browser.
type session struct {
	key       string // sha256 of the cookie value
	principal identity.Principal
	csrf      string
	created   time.Time
	lastSeen  time.Time
	// oauth is set for a login through the authorization server: the
	// principal is re-checked against its tokens on every request, so a
	// revoked grant ends the console session too.
	oauth *oauthSession
}

// sessionStore holds console sessions by the hash of their cookie, so a
// memory dump reveals no usable cookie.
type sessionStore struct {
	now func() time.Time
	mu  sync.Mutex
	m   map[string]*session
}

func newSessionStore(now func() time.Time) *sessionStore {
	return &sessionStore{now: now, m: map[string]*session{}}
}

func randomToken() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}

func hashKey(cookie string) string {
	h := sha256.Sum256([]byte(cookie))
	return base64.RawURLEncoding.EncodeToString(h[:])
}

// create starts a session for p and returns its cookie value. The store
// and each principal's share of it are bounded: the oldest go first.
func (s *sessionStore) create(p identity.Principal, o *oauthSession) (string, *session) {
	cookie := randomToken()
	now := s.now()
	sess := &session{key: hashKey(cookie), principal: p, csrf: randomToken(), created: now, lastSeen: now, oauth: o}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepLocked(now)
	for s.countLocked(p.ID) >= maxPerPrincipal || len(s.m) >= maxSessions {
		s.evictOldestLocked(p.ID)
	}
	s.m[sess.key] = sess
	return cookie, sess
}

func (s *sessionStore) countLocked(principal string) int {
	n := 0
	for _, v := range s.m {
		if v.principal.ID == principal {
			n++
		}
	}
	return n
}

// evictOldestLocked drops principal's oldest session, or the oldest of
// all when it has none.
func (s *sessionStore) evictOldestLocked(principal string) {
	var oldest *session
	for _, v := range s.m {
		if v.principal.ID == principal && (oldest == nil || v.lastSeen.Before(oldest.lastSeen)) {
			oldest = v
		}
	}
	if oldest == nil {
		for _, v := range s.m {
			if oldest == nil || v.lastSeen.Before(oldest.lastSeen) {
				oldest = v
			}
		}
	}
	if oldest != nil {
		delete(s.m, oldest.key)
	}
}

func (s *sessionStore) sweepLocked(now time.Time) {
	for k, v := range s.m {
		if now.Sub(v.lastSeen) > sessionIdle || now.Sub(v.created) > sessionLifetime {
			delete(s.m, k)
		}
	}
}

// get returns the live session for a cookie value and marks it used.
func (s *sessionStore) get(cookie string) (*session, bool) {
	if cookie == "" {
		return nil, false
	}
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	sess, ok := s.m[hashKey(cookie)]
	if !ok {
		return nil, false
	}
	if now.Sub(sess.lastSeen) > sessionIdle || now.Sub(sess.created) > sessionLifetime {
		delete(s.m, sess.key)
		return nil, false
	}
	sess.lastSeen = now
	return sess, true
}

func (s *sessionStore) remove(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, key)
}

// cookieName is __Host- prefixed over https: the browser then refuses the
// cookie unless it is Secure, host-only and for "/".
func (c *Console) cookieName() string {
	if c.d.Secure {
		return "__Host-sbx_console"
	}
	return "sbx_console"
}

func (c *Console) loginCookieName() string {
	if c.d.Secure {
		return "__Host-sbx_console_login"
	}
	return "sbx_console_login"
}

func (c *Console) setCookie(w http.ResponseWriter, name, value string, maxAge time.Duration) {
	ck := &http.Cookie{Name: name, Value: value, Path: "/", HttpOnly: true, Secure: c.d.Secure, SameSite: http.SameSiteStrictMode}
	if maxAge > 0 {
		ck.MaxAge = int(maxAge.Seconds())
	} else {
		ck.MaxAge = -1
	}
	http.SetCookie(w, ck)
}

type sessionKey struct{}

func withSession(ctx context.Context, s *session) context.Context {
	return context.WithValue(ctx, sessionKey{}, s)
}

func sessionFrom(ctx context.Context) *session {
	s, _ := ctx.Value(sessionKey{}).(*session)
	return s
}

// authed requires a console session; unsafe methods also need its CSRF
// token, from the X-CSRF-Token header (htmx) or the csrf form field. A
// forged or missing token changes nothing: the request ends here.
func (c *Console) authed(h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var sess *session
		if ck, err := r.Cookie(c.cookieName()); err == nil {
			sess, _ = c.sessions.get(ck.Value)
		}
		if sess != nil && sess.oauth != nil && !c.checkOAuth(r, sess) {
			c.sessions.remove(sess.key)
			sess = nil
		}
		if sess == nil {
			if r.Method == http.MethodGet && r.Header.Get("HX-Request") == "" && !strings.HasSuffix(r.URL.Path, "/events") &&
				!strings.HasPrefix(r.URL.Path, "/console/audit/") {
				http.Redirect(w, r, "/console/login", http.StatusSeeOther)
				return
			}
			c.errorPage(w, r, http.StatusUnauthorized, "Your console session has ended. Log in again.")
			return
		}
		connguard.Trust(r.Context())
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			r.Body = http.MaxBytesReader(w, r.Body, c.d.MaxUploadBytes)
			token := r.Header.Get(csrfHeader)
			if token == "" {
				// A multipart body is bounded by the handler, which parses
				// it; the token then comes from the form.
				token = r.PostFormValue(csrfField)
			}
			if subtle.ConstantTimeCompare([]byte(token), []byte(sess.csrf)) != 1 {
				c.d.Log.Warn().Str("principal", sess.principal.ID).Str("path", r.URL.Path).Msg("console_csrf_rejected")
				c.errorPage(w, r, http.StatusForbidden, "The request did not carry this page's CSRF token, so nothing was done. Reload the page and try again.")
				return
			}
		}
		h(w, r.WithContext(withSession(r.Context(), sess)))
	})
}

// loginGuard bounds login attempts per client address.
type loginGuard struct {
	attempts *middleware.RejectionThrottle
	rows     *middleware.RejectionThrottle
}

func newLoginGuard() *loginGuard {
	// 10 attempts, then one every 6 s, per address; failed-login audit
	// rows likewise, with the suppressed count on the next one.
	return &loginGuard{attempts: middleware.NewRejectionThrottle(1.0/6, 10), rows: middleware.NewRejectionThrottle(1.0/6, 10)}
}

func (c *Console) loginPage(w http.ResponseWriter, r *http.Request) {
	if ck, err := r.Cookie(c.cookieName()); err == nil {
		if _, ok := c.sessions.get(ck.Value); ok {
			http.Redirect(w, r, "/console/playground", http.StatusSeeOther)
			return
		}
	}
	c.renderLogin(w, r, http.StatusOK, "")
}

// renderLogin shows the login form with a fresh login nonce: a cookie and
// the same value in the form (the login form's CSRF defence, so no other
// site can log a browser into its own principal).
func (c *Console) renderLogin(w http.ResponseWriter, r *http.Request, status int, msg string) {
	nonce := randomToken()
	c.setCookie(w, c.loginCookieName(), nonce, loginNonceMaxAge)
	c.render(w, r, status, "login", map[string]any{"Nonce": nonce, "Error": msg, "OAuth": c.d.OAuth != nil})
}

func (c *Console) loginSubmit(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, 16<<10)
	if err := r.ParseForm(); err != nil {
		c.renderLogin(w, r, http.StatusBadRequest, "The form could not be read.")
		return
	}
	ck, err := r.Cookie(c.loginCookieName())
	if err != nil || subtle.ConstantTimeCompare([]byte(ck.Value), []byte(r.PostForm.Get(csrfField))) != 1 {
		c.renderLogin(w, r, http.StatusForbidden, "The form did not come from this login page. Try again.")
		return
	}
	addr := connguard.AddrKey(r.RemoteAddr)
	if ok, _ := c.logins.attempts.Admit(addr); !ok {
		w.Header().Set("Retry-After", "6")
		c.auditLogin(r.Context(), addr, "", audit.OutcomeRateLimited, "RATE_LIMIT_EXCEEDED", "bearer")
		c.renderLogin(w, r, http.StatusTooManyRequests, "Too many login attempts from this address. Wait a few seconds.")
		return
	}
	token := strings.TrimSpace(r.PostForm.Get("token"))
	p, ok := c.d.Authenticate(r, token)
	if !ok {
		c.auditLogin(r.Context(), addr, "", audit.OutcomeDenied, "UNAUTHENTICATED", "bearer")
		c.renderLogin(w, r, http.StatusUnauthorized, "That token is not valid on this broker.")
		return
	}
	c.startSession(w, r, p, nil, "bearer")
}

// startSession logs p in: a new session (never one the browser brought,
// so a planted cookie gains nothing) and a row in the audit log.
func (c *Console) startSession(w http.ResponseWriter, r *http.Request, p identity.Principal, o *oauthSession, method string) {
	if _, err := c.auditLogin(r.Context(), connguard.AddrKey(r.RemoteAddr), p.ID, audit.OutcomeSuccess, "", method); err != nil {
		c.errorPage(w, r, http.StatusServiceUnavailable, "The audit log is unavailable, so you were not logged in. Try again later.")
		return
	}
	cookie, _ := c.sessions.create(p, o)
	c.setCookie(w, c.cookieName(), cookie, sessionLifetime)
	c.setCookie(w, c.loginCookieName(), "", 0)
	c.d.Log.Info().Str("principal", p.ID).Str("method", method).Msg("console_login")
	http.Redirect(w, r, "/console/playground", http.StatusSeeOther)
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	sess := sessionFrom(r.Context())
	c.sessions.remove(sess.key)
	c.setCookie(w, c.cookieName(), "", 0)
	c.d.Log.Info().Str("principal", sess.principal.ID).Msg("console_logout")
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// auditLogin writes a login's single row (tool console.login): who, how,
// from which address, never the token. Refused logins are throttled per
// address so a flood cannot grow the log without bound.
func (c *Console) auditLogin(ctx context.Context, addr, principal string, outcome audit.Outcome, code, method string) (int64, error) {
	params := map[string]any{"method": method, "client": addr}
	if outcome != audit.OutcomeSuccess {
		ok, suppressed := c.logins.rows.Admit(addr)
		if !ok {
			return 0, nil
		}
		if suppressed > 0 {
			params["suppressed_rejections"] = suppressed
		}
	}
	b, _ := json.Marshal(params)
	seq, err := c.d.Audit.Append(ctx, audit.Record{CallID: "console-" + randomToken()[:16], Phase: audit.PhaseOutcome,
		Principal: principal, Tool: "console.login", Params: b, Outcome: outcome, ErrorCode: code})
	if err != nil {
		c.d.Log.Error().Msg("console_login_audit_failed")
	}
	return seq, err
}
