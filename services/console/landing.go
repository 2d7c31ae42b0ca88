package console

import (
	"net/http"
	"sort"
	"strings"
)

// landing is the connect page, open to anyone who reaches the broker (it
// shows what /readyz shows, and no token): status, the MCP URL, the
// connect guides with it filled in, and where a generated token is kept.
func (c *Console) landing(w http.ResponseWriter, r *http.Request) {
	st := c.d.Status(r.Context())
	v := GuideValues{MCPURL: st.MCPURL, BaseURL: strings.TrimSuffix(st.MCPURL, "/mcp"), BearerURL: st.MCPURL, TokenCmd: "<your token>"}
	if st.TokenFile != "" {
		v.TokenCmd = "$(cat $SANDBOX_ROOT/" + st.TokenFile + ")"
	}
	guides, err := guidesHTML(v)
	if err != nil {
		c.d.Log.Error().Err(err).Msg("console_guides_failed")
	}
	var comps []component
	for name, s := range st.Components {
		comps = append(comps, component{Name: name, Status: s})
	}
	sort.Slice(comps, func(i, j int) bool { return comps[i].Name < comps[j].Name })
	// The page is public, but a logged-in visitor sees the nav.
	if ck, err := r.Cookie(c.cookieName()); err == nil {
		if sess, ok := c.sessions.get(ck.Value); ok {
			r = r.WithContext(withSession(r.Context(), sess))
		}
	}
	c.render(w, r, http.StatusOK, "landing", map[string]any{"S": st, "Components": comps, "Guides": guides})
}

type component struct{ Name, Status string }
