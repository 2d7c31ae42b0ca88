package oauth

import (
	"context"
	"crypto/subtle"
	"html/template"
	"net/http"
	"net/url"
	"strings"

	"github.com/zitadel/oidc/v3/pkg/oidc"
	"github.com/zitadel/oidc/v3/pkg/op"

	"github.com/sandbox-broker/sandbox-broker/audit"
)

// consentCookie carries the CSRF value of one consent page (double
// submit: the form field, the cookie and the stored request must agree).
const consentCookie = "sandbox_broker_consent"

var consentTmpl = template.Must(template.New("consent").Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Authorize {{.Client}} – sandbox-broker</title>
<style>body{font-family:system-ui,sans-serif;max-width:34rem;margin:3rem auto;padding:0 1rem;line-height:1.5}
code{background:#f2f2f2;padding:0 .2em}.err{color:#a00}input[type=password]{width:100%;padding:.4em;font-size:1em}
button{font-size:1em;padding:.4em 1.2em;margin:.8em .6em 0 0}</style></head>
<body>
<h1>Authorize a connector</h1>
{{if .Error}}<p class="err" role="alert">{{.Error}}</p>{{end}}
{{if .ID}}
<p><strong>{{.Client}}</strong> wants to run code on this sandbox-broker for you.</p>
<p>After you approve, it is sent back to <code>{{.RedirectHost}}</code>.</p>
<p>It will act as the principal of the bearer token you enter below, with that token's tier, until you revoke it.
Scope: <code>{{.Scope}}</code>.</p>
<form method="post" action="{{.Action}}">
<input type="hidden" name="id" value="{{.ID}}">
<input type="hidden" name="csrf" value="{{.CSRF}}">
<label for="token">One of this broker's bearer tokens (MCP_API_TOKEN, MCP_TOKENS_FILE or SANDBOX_ROOT/api_token)</label>
<input type="password" id="token" name="token" autocomplete="off" autofocus>
<button type="submit" name="action" value="approve">Approve</button>
<button type="submit" name="action" value="deny">Deny</button>
</form>
{{end}}
</body></html>
`))

type consentView struct {
	Client, RedirectHost, Scope, ID, CSRF, Action, Error string
}

// consentHeaders forbid framing (clickjacking) and any script; the form may
// post only here and be redirected only to the client.
func (s *Server) consentHeaders(w http.ResponseWriter, redirectURI string) {
	formAction := "'self'"
	if u, err := url.Parse(redirectURI); err == nil && u.Scheme != "" {
		if u.Scheme == "http" || u.Scheme == "https" {
			formAction += " " + u.Scheme + "://" + u.Host
		} else {
			formAction += " " + u.Scheme + ":"
		}
	}
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; frame-ancestors 'none'; form-action "+formAction)
	h.Set("X-Frame-Options", "DENY")
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	// Not no-referrer: with it a browser posts the form with "Origin:
	// null", which the Origin checks refuse (TestConsoleOAuthLoginInChromium).
	h.Set("Referrer-Policy", "same-origin")
}

func (s *Server) renderConsent(w http.ResponseWriter, status int, redirectURI string, v consentView) {
	s.consentHeaders(w, redirectURI)
	w.WriteHeader(status)
	_ = consentTmpl.Execute(w, v)
}

func (s *Server) view(ctx context.Context, a authRequest, msg string) consentView {
	name := "An unnamed client"
	if c, err := s.store.Client(ctx, a.clientID); err == nil && c.Metadata.ClientName != "" {
		name = c.Metadata.ClientName
	}
	host := ""
	if hs := redirectHosts([]string{a.redirectURI}); len(hs) > 0 {
		host = hs[0]
	}
	return consentView{Client: name, RedirectHost: host, Scope: strings.Join(grantScopes(a.scopes), " "),
		ID: a.id, CSRF: a.csrf, Action: PathConsent, Error: msg}
}

// consentPage serves GET /oauth/consent?id=….
func (s *Server) consentPage(w http.ResponseWriter, r *http.Request) {
	a, err := s.requests.pending(r.URL.Query().Get("id"))
	if err != nil {
		s.renderConsent(w, http.StatusBadRequest, "", consentView{Error: "This authorization request is unknown or has expired. Start again from your client."})
		return
	}
	http.SetCookie(w, &http.Cookie{Name: consentCookie, Value: a.csrf, Path: PathConsent, MaxAge: int(requestTTL.Seconds()),
		HttpOnly: true, Secure: s.secure, SameSite: http.SameSiteStrictMode})
	s.renderConsent(w, http.StatusOK, a.redirectURI, s.view(r.Context(), a, ""))
}

// consentSubmit serves the form: approve with a bearer token, or deny.
func (s *Server) consentSubmit(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	ev := s.newEvent("oauth.consent")
	if err := r.ParseForm(); err != nil {
		ev.reject(ctx, "invalid_request", map[string]any{"reason": "form"})
		s.renderConsent(w, http.StatusBadRequest, "", consentView{Error: "The form could not be read."})
		return
	}
	a, err := s.requests.pending(r.PostForm.Get("id"))
	if err != nil {
		ev.reject(ctx, "invalid_request", map[string]any{"reason": "unknown_request"})
		s.renderConsent(w, http.StatusBadRequest, "", consentView{Error: "This authorization request is unknown or has expired. Start again from your client."})
		return
	}
	ev.set(map[string]any{"client_id": a.clientID, "redirect_host": s.view(ctx, a, "").RedirectHost})
	if !s.sameOrigin(r) || !csrfOK(r, a.csrf) {
		ev.reject(ctx, "invalid_request", map[string]any{"reason": "csrf"})
		s.renderConsent(w, http.StatusForbidden, "", consentView{Error: "The form did not come from this consent page. Open the link from your client again."})
		return
	}
	switch r.PostForm.Get("action") {
	case "deny":
		ev.end(ctx, audit.OutcomeDenied, "access_denied", map[string]any{"decision": "denied"})
		s.requests.remove(a.id)
		op.AuthRequestError(w, r, &a, oidc.ErrAccessDenied().WithDescription("the operator denied the request"), authorizer{s.provider, s})
		return
	case "approve":
	default:
		ev.reject(ctx, "invalid_request", map[string]any{"reason": "action"})
		s.renderConsent(w, http.StatusBadRequest, a.redirectURI, s.view(ctx, a, "Choose Approve or Deny."))
		return
	}
	p, ok := s.cfg.Principals.Authenticate(strings.TrimSpace(r.PostForm.Get("token")))
	if !ok {
		dropped := s.requests.failedAttempt(a.id)
		ev.reject(ctx, "access_denied", map[string]any{"reason": "bad_bearer_token", "request_dropped": dropped})
		if dropped {
			s.renderConsent(w, http.StatusUnauthorized, "", consentView{Error: "Too many wrong tokens. Start again from your client."})
			return
		}
		s.renderConsent(w, http.StatusUnauthorized, a.redirectURI, s.view(ctx, a, "That is not one of this broker's bearer tokens."))
		return
	}
	if err := ev.begin(ctx, p.ID, map[string]any{"decision": "approved", "scope": strings.Join(grantScopes(a.scopes), " ")}); err != nil {
		s.renderConsent(w, http.StatusServiceUnavailable, "", consentView{Error: "The audit log is unavailable, so nothing was approved. Try again later."})
		return
	}
	if err := s.requests.approve(a.id, p); err != nil {
		ev.end(ctx, audit.OutcomeFailure, "invalid_request", map[string]any{"reason": "unknown_request"})
		s.renderConsent(w, http.StatusBadRequest, "", consentView{Error: "This authorization request is unknown or has expired. Start again from your client."})
		return
	}
	approved, err := s.requests.get(a.id)
	if err != nil {
		ev.end(ctx, audit.OutcomeFailure, "server_error", nil)
		s.renderConsent(w, http.StatusBadRequest, "", consentView{Error: "This authorization request has expired. Start again from your client."})
		return
	}
	callback, err := op.BuildAuthResponseCallbackURL(ctx, approved, s.provider)
	if err != nil {
		ev.end(ctx, audit.OutcomeFailure, "server_error", nil)
		s.log.Error().Err(err).Msg("oauth_code_failed")
		s.renderConsent(w, http.StatusInternalServerError, "", consentView{Error: "The code could not be issued. Start again from your client."})
		return
	}
	ev.end(ctx, audit.OutcomeSuccess, "", nil)
	http.Redirect(w, r, withIssuer(callback, s.cfg.Issuer), http.StatusSeeOther)
}

// withIssuer adds the RFC 9207 iss parameter to an authorization response.
func withIssuer(callback, issuer string) string {
	u, err := url.Parse(callback)
	if err != nil {
		return callback
	}
	q := u.Query()
	q.Set("iss", issuer)
	u.RawQuery = q.Encode()
	return u.String()
}

func csrfOK(r *http.Request, want string) bool {
	c, err := r.Cookie(consentCookie)
	if err != nil {
		return false
	}
	form := r.PostForm.Get("csrf")
	return want != "" && subtle.ConstantTimeCompare([]byte(form), []byte(want)) == 1 &&
		subtle.ConstantTimeCompare([]byte(c.Value), []byte(want)) == 1
}

// sameOrigin refuses a form posted from another site, when the browser says
// where it came from.
func (s *Server) sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
		return false
	}
	if o := r.Header.Get("Origin"); o != "" {
		return strings.EqualFold(strings.TrimSuffix(o, "/"), s.cfg.Issuer)
	}
	return true
}
