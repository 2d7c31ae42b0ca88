package console

import (
	"context"
	"crypto/subtle"
	"net/http"
	"sync"
	"time"

	"golang.org/x/oauth2"
)

// OAuthLogin signs people in through the broker's own authorization
// server (OAUTH_MODE=embedded): the console is one more public client,
// with PKCE, and the consent page approves it as for any connector. The
// resulting grant shows among the others, and revoking it logs the
// console session out.
type OAuthLogin struct {
	Config   oauth2.Config // client ID, endpoints, redirect URI, scope
	Resource string        // RFC 8707 resource: the broker's /mcp
	// HTTP reaches the token endpoint (in-process, through the broker's
	// own handler).
	HTTP *http.Client
	// Ensure registers the console's client if it is missing (unused
	// registrations expire).
	Ensure func(ctx context.Context) error

	mu      sync.Mutex
	pending map[string]pendingLogin // by state
}

type pendingLogin struct {
	verifier string
	created  time.Time
}

// oauthSession keeps a console session's tokens, refreshed as they expire.
type oauthSession struct {
	source oauth2.TokenSource
}

const (
	oauthPendingTTL = 10 * time.Minute
	maxPending      = 1024
)

func (o *OAuthLogin) ctx(ctx context.Context) context.Context {
	return context.WithValue(ctx, oauth2.HTTPClient, o.HTTP)
}

// oauthStart sends the browser to the authorization endpoint with a fresh
// state (kept server-side and in a cookie, so only this browser can
// finish) and PKCE challenge.
func (c *Console) oauthStart(w http.ResponseWriter, r *http.Request) {
	o := c.d.OAuth
	if o == nil {
		c.errorPage(w, r, http.StatusNotFound, "OAuth sign-in is not enabled on this broker.")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	if err := o.Ensure(ctx); err != nil {
		c.d.Log.Error().Msg("console_oauth_client_failed")
		c.errorPage(w, r, http.StatusServiceUnavailable, "OAuth sign-in is unavailable right now.")
		return
	}
	state, verifier := randomToken(), oauth2.GenerateVerifier()
	now := c.d.Now()
	o.mu.Lock()
	if o.pending == nil {
		o.pending = map[string]pendingLogin{}
	}
	for k, p := range o.pending {
		if now.Sub(p.created) > oauthPendingTTL || len(o.pending) >= maxPending {
			delete(o.pending, k)
		}
	}
	o.pending[state] = pendingLogin{verifier: verifier, created: now}
	o.mu.Unlock()
	// Lax: the callback arrives as a redirect from the consent page.
	http.SetCookie(w, &http.Cookie{Name: c.oauthCookieName(), Value: state, Path: "/console/oauth/", MaxAge: int(oauthPendingTTL.Seconds()),
		HttpOnly: true, Secure: c.d.Secure, SameSite: http.SameSiteLaxMode})
	u := o.Config.AuthCodeURL(state, oauth2.S256ChallengeOption(verifier), oauth2.SetAuthURLParam("resource", o.Resource))
	http.Redirect(w, r, u, http.StatusSeeOther)
}

func (c *Console) oauthCookieName() string {
	if c.d.Secure {
		return "__Secure-sbx_console_oauth"
	}
	return "sbx_console_oauth"
}

// oauthCallback exchanges the code and logs the token's principal in.
func (c *Console) oauthCallback(w http.ResponseWriter, r *http.Request) {
	o := c.d.OAuth
	if o == nil {
		c.errorPage(w, r, http.StatusNotFound, "OAuth sign-in is not enabled on this broker.")
		return
	}
	q := r.URL.Query()
	state := q.Get("state")
	ck, err := r.Cookie(c.oauthCookieName())
	if err != nil || state == "" || subtle.ConstantTimeCompare([]byte(ck.Value), []byte(state)) != 1 {
		c.errorPage(w, r, http.StatusForbidden, "This sign-in did not start in this browser. Start again from the login page.")
		return
	}
	o.mu.Lock()
	p, ok := o.pending[state]
	delete(o.pending, state)
	o.mu.Unlock()
	http.SetCookie(w, &http.Cookie{Name: c.oauthCookieName(), Path: "/console/oauth/", MaxAge: -1, HttpOnly: true, Secure: c.d.Secure, SameSite: http.SameSiteLaxMode})
	if !ok || c.d.Now().Sub(p.created) > oauthPendingTTL {
		c.errorPage(w, r, http.StatusBadRequest, "This sign-in has expired. Start again from the login page.")
		return
	}
	if e := q.Get("error"); e != "" {
		c.errorPage(w, r, http.StatusForbidden, "The sign-in was not approved.")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 15*time.Second)
	defer cancel()
	tok, err := o.Config.Exchange(o.ctx(ctx), q.Get("code"), oauth2.VerifierOption(p.verifier), oauth2.SetAuthURLParam("resource", o.Resource))
	if err != nil {
		c.errorPage(w, r, http.StatusForbidden, "The authorization code was refused. Start again from the login page.")
		return
	}
	principal, ok := c.d.Authenticate(r, tok.AccessToken)
	if !ok {
		c.errorPage(w, r, http.StatusForbidden, "The access token was refused.")
		return
	}
	// The source refreshes with the broker's own token endpoint, in a
	// context that outlives this request.
	src := o.Config.TokenSource(o.ctx(context.WithoutCancel(r.Context())), tok)
	c.startSession(w, r, principal, &oauthSession{source: oauth2.ReuseTokenSource(tok, src)}, "oauth")
}

// checkOAuth re-verifies an OAuth session's access token (refreshing it
// when it expired): a revoked grant, or a principal that changed, ends
// the session.
func (c *Console) checkOAuth(r *http.Request, sess *session) bool {
	tok, err := sess.oauth.source.Token()
	if err != nil {
		return false
	}
	p, ok := c.d.Authenticate(r, tok.AccessToken)
	return ok && p.ID == sess.principal.ID
}
