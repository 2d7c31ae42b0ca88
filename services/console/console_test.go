package console

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/oauth2"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/textsafe"
)

// TestVendoredScriptsMatchChecksums: the embedded htmx files are the
// published ones (static/vendor/VENDOR.md says where from).
func TestVendoredScriptsMatchChecksums(t *testing.T) {
	for name, want := range map[string]string{
		"static/vendor/htmx-2.0.11.min.js":        "d6fdc75f204e6bdefa99b69bf1e6d4ac69b8a364f77929f45c13476b4000f717",
		"static/vendor/htmx-ext-sse-2.2.4.min.js": "98a46496de0c3605fbffdce9167ba427bdd9553184f83f149c261891a92c0136",
	} {
		b, err := staticFS.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b)
		if got := hex.EncodeToString(sum[:]); got != want {
			t.Errorf("%s: sha256 %s, want %s", name, got, want)
		}
		vendor, _ := staticFS.ReadFile("static/vendor/VENDOR.md")
		if !strings.Contains(string(vendor), want) {
			t.Errorf("VENDOR.md does not record %s", want)
		}
	}
}

// hostile is what attackers put in names, commands and arguments.
var hostile = []string{
	`<img src=x onerror=alert(1)>`,
	`"><script>alert(1)</script>`,
	"\x1b[31mred\x1b]0;title\x07",
	"invoice\u202Egnp.exe",
	"zero\u200bwidth\ufeff",
	strings.Repeat("N", 10<<10),
}

func TestRevealMakesTextInert(t *testing.T) {
	for _, s := range hostile {
		got := inert(s)
		for _, r := range got {
			if (unicode.IsControl(r) && r != '\n' && r != '\t') || textsafe.Invisible(r) {
				t.Errorf("inert(%q) kept %U", s, r)
			}
		}
		if utf8.RuneCountInString(got) > maxInertRunes+40 {
			t.Errorf("inert of %d bytes is %d runes long", len(s), utf8.RuneCountInString(got))
		}
	}
	if got := inert("a\u202Eb"); got != "a⟨U+202E⟩b" {
		t.Errorf("override shown as %q", got)
	}
	if got := output("a\n\tb\x1b[0m"); got != "a\n\tb⟨U+001B⟩[0m" {
		t.Errorf("output %q", got)
	}
	if got := inert(strings.Repeat("x", 250)); !strings.HasSuffix(got, "… (50 more characters)") {
		t.Errorf("long text cut as %q", got[190:])
	}
}

func FuzzReveal(f *testing.F) {
	for _, s := range hostile {
		f.Add(s, false)
	}
	f.Add("line\r\nnext\x00", true)
	f.Fuzz(func(t *testing.T, s string, lines bool) {
		got := reveal(s, 64, lines)
		if !utf8.ValidString(got) {
			t.Fatalf("invalid UTF-8 from %q", s)
		}
		for _, r := range got {
			if lines && (r == '\n' || r == '\t') {
				continue
			}
			if unicode.IsControl(r) || textsafe.Invisible(r) {
				t.Fatalf("reveal(%q) kept %U", s, r)
			}
		}
		if n := utf8.RuneCountInString(got); n > 64*len("⟨U+10FFFF⟩")+40 {
			t.Fatalf("reveal of %d runes is %d runes", utf8.RuneCountInString(s), n)
		}
	})
}

func newTestConsole(t *testing.T) *Console {
	t.Helper()
	c, err := New(Deps{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestFragmentsRenderHostileStringsInert renders the views that show
// attacker-chosen strings (audit rows and records, file lists, program
// output, job events, errors) with hostile values: nothing becomes markup,
// invisible characters show as marks, and long values are cut.
func TestFragmentsRenderHostileStringsInert(t *testing.T) {
	c := newTestConsole(t)
	for _, h := range hostile {
		params, _ := json.Marshal(map[string]string{"working_directory": h})
		entry := audit.Entry{Seq: 7, Time: time.Now(), Record: audit.Record{CallID: h, Phase: audit.PhaseIntent, Principal: h, Tool: h,
			Params: params, ErrorCode: h}, KeyID: h, MAC: h}
		views := map[string]any{
			"audit_row":    entry,
			"audit_record": map[string]any{"Row": audit.Row{Entry: entry, Leaf: "00", PrevMAC: "00"}, "Call": []audit.Entry{entry}},
			"file_table":   []fileRef{{Name: h, MIME: h, URI: h}},
			"chunk":        map[string]any{"Stream": h, "Text": h},
			"job_event":    jobEvent{Seq: 1, Type: h, Message: h},
			"error":        map[string]any{"Message": h},
			"jobs":         []jobInfo{{ID: "exec_1", Command: h, StartedAt: h}},
			"run_result":   map[string]any{"R": runResult{SessionID: "s", Stdout: h, Stderr: h, Files: []fileRef{{Name: h}}}, "Images": []image{{MIME: "text/html", Data: h}}},
		}
		for name, data := range views {
			out, err := c.fragment(name, data)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			for _, bad := range []string{"<img src=x", "<script", "onerror=alert(1)>", "\x1b", "\u202E", "\u200b", "data:text/html"} {
				if strings.Contains(out, bad) {
					t.Errorf("%s rendered %q raw from %q", name, bad, h[:min(len(h), 40)])
				}
			}
			if len(h) > 1000 && strings.Count(out, "N") > 4*(maxOutputRune) {
				t.Errorf("%s did not cut a %d-byte value", name, len(h))
			}
		}
	}
	// Short values are cut in tables; program output keeps more.
	long := strings.Repeat("N", 10<<10)
	out, _ := c.fragment("audit_row", audit.Entry{Record: audit.Record{Principal: long, Params: json.RawMessage(`{}`)}})
	if strings.Count(out, "N") > maxInertRunes+10 {
		t.Errorf("a 10 KB principal is %d characters in the row", strings.Count(out, "N"))
	}
}

func TestDataURLOnlyForImages(t *testing.T) {
	if got := dataURL("image/png", "iVBORw0KGgo="); got != "data:image/png;base64,iVBORw0KGgo=" {
		t.Errorf("png: %q", got)
	}
	for _, c := range [][2]string{{"text/html", "PGI+"}, {"image/png", "not base64!"}, {"image/png\";x=", "AA=="}} {
		if got := dataURL(c[0], c[1]); got != "" {
			t.Errorf("dataURL(%q, %q) = %q", c[0], c[1], got)
		}
	}
}

func TestSessionStoreBoundsAndExpiry(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s := newSessionStore(func() time.Time { return now })
	alice := identity.Principal{ID: "alice"}
	first, _ := s.create(alice, nil)
	if _, ok := s.m[first]; ok {
		t.Fatal("the store is keyed by the raw cookie")
	}
	for range maxPerPrincipal {
		now = now.Add(time.Second)
		s.create(alice, nil)
	}
	if _, ok := s.get(first); ok || s.countLocked("alice") != maxPerPrincipal {
		t.Fatalf("oldest session kept past the per-principal cap (%d)", s.countLocked("alice"))
	}
	live, sess := s.create(alice, nil)
	now = now.Add(sessionIdle - time.Minute)
	if got, ok := s.get(live); !ok || got != sess {
		t.Fatal("an active session expired")
	}
	now = now.Add(sessionIdle + time.Second)
	if _, ok := s.get(live); ok {
		t.Fatal("an idle session survived")
	}
	live, _ = s.create(alice, nil)
	for i := 0; i < 13; i++ { // active every hour, but past the lifetime
		now = now.Add(time.Hour - time.Minute)
		_, ok := s.get(live)
		if ok != (i < 12) {
			t.Fatalf("after %d hours: live %v", i+1, ok)
		}
	}
}

func TestAuditFilterFromTheForm(t *testing.T) {
	args, keep := auditFilter(url.Values{"principal": {" alice "}, "since": {"2026-01-02T03:04"}, "until": {"2026-01-02T03:04:05"},
		"outcome": {"denied"}, "evil": {"x"}})
	if args["principal"] != "alice" || args["since"] != "2026-01-02T03:04:00Z" || args["until"] != "2026-01-02T03:04:05Z" ||
		args["outcome"] != "denied" || args["evil"] != nil || keep.Get("since") != "2026-01-02T03:04" {
		t.Fatalf("args %v keep %v", args, keep)
	}
	if args, _ := auditFilter(url.Values{"since": {"yesterday"}}); args["since"] != "yesterday" {
		t.Fatal("an unparsable time must reach the tool, which refuses it")
	}
}

func TestCSPFramesOnlyPreviews(t *testing.T) {
	c, err := New(Deps{FrameSources: func() []string { return []string{"http://*.localhost:8081"} }})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.csp(); !strings.Contains(got, "frame-src http://*.localhost:8081;") || !strings.Contains(got, "frame-ancestors 'none'") {
		t.Errorf("csp %q", got)
	}
	if got := newTestConsole(t).csp(); !strings.Contains(got, "frame-src 'none'") {
		t.Errorf("csp without previews %q", got)
	}
}

// TestOAuthSessionEndsWithItsGrant: a session signed in through OAuth
// re-checks its access token on every request; once the token no longer
// verifies (its grant revoked), the session is gone for good.
func TestOAuthSessionEndsWithItsGrant(t *testing.T) {
	valid := true
	c, err := New(Deps{Authenticate: func(_ *http.Request, tok string) (identity.Principal, bool) {
		return identity.Principal{ID: "ops"}, valid && tok == "access"
	}})
	if err != nil {
		t.Fatal(err)
	}
	cookie, _ := c.sessions.create(identity.Principal{ID: "ops"},
		&oauthSession{source: oauth2.StaticTokenSource(&oauth2.Token{AccessToken: "access"})})
	h := c.authed(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	get := func() int {
		req := httptest.NewRequest("GET", "/console/playground", nil)
		req.AddCookie(&http.Cookie{Name: "sbx_console", Value: cookie})
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec.Code
	}
	if code := get(); code != http.StatusNoContent {
		t.Fatalf("live grant: %d", code)
	}
	valid = false
	if code := get(); code != http.StatusSeeOther {
		t.Fatalf("revoked grant: %d", code)
	}
	valid = true
	if code := get(); code != http.StatusSeeOther {
		t.Fatalf("the session came back: %d", code)
	}
}
