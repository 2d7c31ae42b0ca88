package broker

import (
	"net/http"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/files"
	"github.com/sandbox-broker/sandbox-broker/services/projects"
)

// previewCookie carries a verified preview link's exp/kid/sig, scoped to
// one sandbox's path, so the page's own asset requests are authorised too.
const previewCookie = "sbx_preview"

// previewHandler serves /preview/{sandbox_id}/… for providers the broker
// serves itself: a signed link (or the cookie it sets) is required, and
// the provider's handler gets the path below the prefix.
func (b *Broker) previewHandler(ps projects.PreviewServer) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		rest := strings.TrimPrefix(r.URL.Path, files.PreviewPrefix)
		id, sub, ok := strings.Cut(rest, "/")
		if !ok || !files.ValidWorkspaceID(id) {
			http.NotFound(w, r)
			return
		}
		scope := files.PreviewPrefix + id + "/"
		proof := r.URL.RawQuery
		fromQuery := strings.Contains(proof, "sig=")
		if !fromQuery {
			if c, err := r.Cookie(previewCookie); err == nil {
				proof = c.Value
			} else {
				proof = ""
			}
		}
		exp, err := b.signer.VerifyPreview(id, proof)
		if err != nil || !b.projects.Exists(r.Context(), id) {
			b.refusalLog("preview_denied", b.log.Info).Str("sandbox_id", id).Bool("signed_query", fromQuery).Msg("preview_denied")
			http.Error(w, "preview link invalid or expired: ask for a new preview_url", http.StatusForbidden)
			return
		}
		if fromQuery {
			// The provider's CSP sandbox gives the page an opaque origin, so its
			// asset requests count as cross-site: SameSite=None where the
			// browser allows it (HTTPS), Lax otherwise.
			secure := r.TLS != nil || strings.HasPrefix(b.signer.BaseURL, "https://")
			same := http.SameSiteLaxMode
			if secure {
				same = http.SameSiteNoneMode
			}
			http.SetCookie(w, &http.Cookie{Name: previewCookie, Value: proof, Path: scope, Expires: exp,
				MaxAge: int(time.Until(exp).Seconds()), HttpOnly: true, Secure: secure, SameSite: same})
		}
		h, err := ps.Preview(r.Context(), id)
		if err != nil {
			http.Error(w, "preview unavailable: "+b.redactor.Message(err.Error(), 200), http.StatusServiceUnavailable)
			return
		}
		r2 := r.Clone(r.Context())
		r2.URL.Path = "/" + sub
		r2.URL.RawPath = ""
		r2.URL.RawQuery = stripProof(r.URL.RawQuery)
		r2.Header.Del("Cookie")
		r2.Header.Del("Authorization")
		h.ServeHTTP(w, r2)
	})
}

// stripProof removes the link's exp/kid/sig from the query passed on.
func stripProof(q string) string {
	var keep []string
	for _, kv := range strings.Split(q, "&") {
		k, _, _ := strings.Cut(kv, "=")
		if kv != "" && k != "exp" && k != "kid" && k != "sig" {
			keep = append(keep, kv)
		}
	}
	return strings.Join(keep, "&")
}

// projectPreviews returns the provider's preview server when the broker
// serves previews itself (the local provider).
func (b *Broker) projectPreviews() (projects.PreviewServer, bool) {
	if b.projects == nil {
		return nil, false
	}
	ps, ok := b.projects.Provider().(projects.PreviewServer)
	return ps, ok
}
