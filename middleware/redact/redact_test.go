package redact_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/sandbox-broker/sandbox-broker/middleware/redact"
)

// Token-shaped test values, assembled so that no scanner flags this file.
var (
	ghPAT  = "github_" + "pat_" + "11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz"
	ghp    = "gh" + "p_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4"
	gho    = "gh" + "o_" + "ZYXWVUTSRQPONMLKJIHGFEDCBA98"
	ghs    = "gh" + "s_" + "0123456789abcdefghijABCDEFGHIJ"
	csb    = "cs" + "b_" + "live_0123456789-abcdef"
	akia   = "AK" + "IA" + "IOSFODNN7EXAMPLE"
	awsKey = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
	pem    = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA7Vq\nabcdef==\n-----END RSA PRIVATE KEY-----"
)

// leftovers finds anything that still looks like a credential.
var leftovers = regexp.MustCompile(`github_pat_[A-Za-z0-9_]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|csb_[A-Za-z0-9_-]{12,}|AKIA[0-9A-Z]{16}|PRIVATE KEY-----\n|[A-Za-z0-9/+=]{40}`)

func TestConfiguredSecrets(t *testing.T) {
	const short = "hunter22"              // 8 bytes: the minimum that counts
	const long = "hunter22-and-much-more" // contains short
	r := redact.New([]string{short, long, "", "tiny"}, nil)
	cases := map[string]string{
		"pw=" + long + ";":           "pw=[REDACTED];",
		"pw=" + short + ";":          "pw=[REDACTED];",
		long + long:                  "[REDACTED]",
		"tiny stays, " + short + "!": "tiny stays, [REDACTED]!",
		"nothing here":               "nothing here",
	}
	for in, want := range cases {
		if got := r.String(in); got != want {
			t.Errorf("String(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestOverlappingSecretsLeaveNoFragment(t *testing.T) {
	// The tail of one secret is the head of the other: leftmost replacement
	// of either alone would leave part of the other in the output.
	a, b := "12345678", "5678abcdefgh"
	r := redact.New([]string{a, b}, nil)
	for _, in := range []string{a + "abcdefgh", "x1234" + b + "y", "abababab" + "ab"} {
		got := r.String(in)
		for _, frag := range []string{"abcdefgh", "1234", "5678"} {
			if strings.Contains(got, frag) {
				t.Errorf("String(%q) = %q still holds %q", in, got, frag)
			}
		}
	}
	// A secret overlapping itself.
	self := redact.New([]string{"abababab"}, nil)
	if got := self.String("ababababab!"); got != "[REDACTED]!" {
		t.Errorf("self-overlap: got %q", got)
	}
}

func TestTokenShapes(t *testing.T) {
	r := redact.New(nil, nil)
	cases := []struct{ name, in, keep string }{
		{"github_pat", "token " + ghPAT + " end", "token [REDACTED] end"},
		{"ghp", "x " + ghp, "x [REDACTED]"},
		{"gho", gho + ".", "[REDACTED]."},
		{"ghs", "(" + ghs + ")", "([REDACTED])"},
		{"csb", "key=" + csb, "key=[REDACTED]"},
		{"akia", "id " + akia + " ok", "id [REDACTED] ok"},
		{"aws secret", "aws_secret_access_key = " + awsKey, "aws_secret_access_key = [REDACTED]"},
		{"aws secret quoted", `"AWS_SECRET_ACCESS_KEY": "` + awsKey + `"`, `"AWS_SECRET_ACCESS_KEY": "[REDACTED]"`},
		{"aws secret mixed case", "Aws_SeCrEt_Access_Key=" + awsKey, "Aws_SeCrEt_Access_Key=[REDACTED]"},
		{"bearer", "Authorization: Bearer abc.DEF-ghi-jkl.mnopqrstu==", "Authorization: [REDACTED]"},
		{"bearer mixed case", "authorization: bEaReR 0123456789abcdefXYZ", "authorization: [REDACTED]"},
		{"pem", "key:\n" + pem + "\ndone", "key:\n[REDACTED]\ndone"},
		{"pem unterminated", "key:\n-----BEGIN PRIVATE KEY-----\nMIIE", "key:\n[REDACTED]"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := r.String(c.in); got != c.keep {
				t.Errorf("String(%q) = %q, want %q", c.in, got, c.keep)
			}
		})
	}
	// Near misses are left alone.
	for _, s := range []string{"ghp_short", "github_pat_short", "AKIA123", "bearer of news", "thoughtful_" + strings.Repeat("a", 30)} {
		if got := r.String(s); got != s {
			t.Errorf("String(%q) = %q, want unchanged", s, got)
		}
	}
}

func TestTokenExposedByAnotherRedactionIsRedacted(t *testing.T) {
	r := redact.New(nil, nil)
	// The ghp token has no word boundary until the AWS secret before it
	// becomes [REDACTED]; the output must still not carry it.
	in := "aws_secret_access_key=" + awsKey + ghp
	got := r.String(in)
	if strings.Contains(got, ghp[4:]) {
		t.Fatalf("String(%q) = %q leaks the token", in, got)
	}
	if again := r.String(got); again != got {
		t.Fatalf("not idempotent: %q then %q", got, again)
	}
}

func TestMessageHostPaths(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "sandbox-root")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(root, link); err != nil {
		t.Fatal(err)
	}
	// Relative form of the root, as SANDBOX_ROOT=./data would give.
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(wd, root)
	if err != nil {
		t.Fatal(err)
	}
	secret := "s3cr3t-value-123"
	for _, configured := range []string{root, link, rel} {
		r := redact.New([]string{secret}, []string{configured})
		cases := []string{
			"open " + root + "/ws/a.txt: permission denied",
			"open " + configured + "/ws/a.txt: no such file",
			"read /home/alice/.ssh/id_rsa: denied",
			"write /var/lib/broker/state.db failed",
			"secret " + secret + " at /root/secret",
		}
		for _, in := range cases {
			got := r.Message(in, 500)
			for _, bad := range []string{root, configured, "/home/alice", "/var/lib", "/root/", secret} {
				if strings.Contains(got, bad) {
					t.Errorf("root %q: Message(%q) = %q leaks %q", configured, in, got, bad)
				}
			}
			if !strings.Contains(got, redact.PathMarker) && !strings.Contains(got, redact.Marker) {
				t.Errorf("Message(%q) = %q has no marker", in, got)
			}
		}
	}
	r := redact.New(nil, []string{root})
	// Sandbox-side paths are the model's own and stay readable.
	for _, in := range []string{"file /mnt/data/out.csv not found", "cannot open /data/x and /tmp/y"} {
		if got := r.Message(in, 500); got != in {
			t.Errorf("Message(%q) = %q, want unchanged", in, got)
		}
	}
	// Replacing a path can give a glued token its word boundary.
	in := root + ghp
	if got := r.Message(in, 500); strings.Contains(got, ghp[4:]) {
		t.Errorf("Message(%q) = %q leaks the token", in, got)
	}
}

func TestMessageCap(t *testing.T) {
	r := redact.New(nil, nil)
	got := r.Message(strings.Repeat("é", 300), 200)
	if len(got) > 200 || !utf8.ValidString(got) || !strings.HasSuffix(got, "…") {
		t.Fatalf("Message cap: len %d valid %v %q", len(got), utf8.ValidString(got), got[len(got)-6:])
	}
	// Cutting the text must not turn a non-key into a key-shaped tail.
	in := "x " + akia + "BCDEF"
	if got := r.Message(in, len("x ")+len(akia)+len("…")); strings.Contains(got, akia) {
		t.Errorf("Message(%q) = %q ends in a key", in, got)
	}
}

func TestTruncate(t *testing.T) {
	cases := []struct {
		in   string
		max  int
		want string
	}{
		{"hello", 0, "hello"},
		{"hello", 5, "hello"},
		{"hello", 4, "h…"},
		{"hello", 3, "…"},
		{"hello", 2, "he"},
		{"hello", 1, "h"},
		{"héllo", 5, "h…"}, // é is 2 bytes: h + … is 4 bytes, hé… would be 6
		{"日本語", 4, "…"},
		{"日本語", 6, "日…"},
		{"日本語", 2, ""},
	}
	for _, c := range cases {
		got := redact.Truncate(c.in, c.max)
		if got != c.want {
			t.Errorf("Truncate(%q, %d) = %q, want %q", c.in, c.max, got, c.want)
		}
		if c.max > 0 && len(got) > c.max {
			t.Errorf("Truncate(%q, %d) = %q is %d bytes", c.in, c.max, got, len(got))
		}
		if !utf8.ValidString(got) {
			t.Errorf("Truncate(%q, %d) = %q splits a rune", c.in, c.max, got)
		}
	}
}

func TestValueWalksNestedValues(t *testing.T) {
	secret := "top-secret-value"
	r := redact.New([]string{secret}, nil)
	in := map[string]any{
		"plain": "ok",
		"n":     float64(3),
		"b":     true,
		"nil":   nil,
		secret:  "key is a secret",
		"list":  []any{"a " + ghp, map[string]any{"deep": []any{secret}}},
	}
	out := r.Value(in).(map[string]any)
	if out["plain"] != "ok" || out["n"] != float64(3) || out["b"] != true || out["nil"] != nil {
		t.Errorf("non-secret values changed: %#v", out)
	}
	if _, ok := out[secret]; ok {
		t.Errorf("secret key survived: %#v", out)
	}
	if out[redact.Marker] != "key is a secret" {
		t.Errorf("redacted key missing: %#v", out)
	}
	list := out["list"].([]any)
	if list[0] != "a [REDACTED]" {
		t.Errorf("list[0] = %q", list[0])
	}
	deep := list[1].(map[string]any)["deep"].([]any)
	if deep[0] != redact.Marker {
		t.Errorf("deep = %#v", deep)
	}
	// The input is not modified.
	if in["list"].([]any)[0] != "a "+ghp {
		t.Error("Value modified its input")
	}
}

func TestNilRedactor(t *testing.T) {
	var r *redact.Redactor
	if got := r.String(ghp); got != ghp {
		t.Errorf("nil String = %q", got)
	}
	if got := r.Message("/home/x/y", 100); got != redact.PathMarker {
		t.Errorf("nil Message = %q", got)
	}
}

func FuzzRedact(f *testing.F) {
	const secret = "Fz-s3cret-V4lue!"
	r := redact.New([]string{secret, "0123456789abcdef"}, []string{"/srv/sbx"})
	for _, s := range []string{
		"", "a", secret, secret[:8], secret[4:], "Fz-s3cret-V4lue", "ghp_", "aws_secret_access_key=",
		"aws_secret_access_key=" + awsKey, "Bearer ", "bEaReR 0123456789abcdef", "-----BEGIN PRIVATE KEY-----",
		"\xff\xfe", "é", "[REDACTED]", "/home/x", "0123456789abcde", akia, ghPAT,
	} {
		f.Add("p:", s)
	}
	// Regressions: a token glued to an AWS secret, and mixed-case key names.
	f.Add("aws_secret_access_key="+awsKey, ghp)
	f.Add("Aws_SeCrEt_Access_Key=", awsKey)
	f.Fuzz(func(t *testing.T, prefix, s string) {
		in := prefix + s + secret + s
		got := r.String(in)
		if strings.Contains(got, secret) {
			t.Fatalf("String(%q) = %q contains the secret", in, got)
		}
		if again := r.String(got); again != got {
			t.Fatalf("not idempotent:\n in  %q\n 1st %q\n 2nd %q", in, got, again)
		}
		if raw := r.String(s); r.String(raw) != raw {
			t.Fatalf("not idempotent on %q", s)
		}
		if utf8.ValidString(in) && !utf8.ValidString(got) {
			t.Fatalf("String(%q) = %q is not valid UTF-8", in, got)
		}
		msg := r.Message(in, 200)
		if len(msg) > 200 || strings.Contains(msg, secret) {
			t.Fatalf("Message(%q) = %q", in, msg)
		}
		if utf8.ValidString(in) && !utf8.ValidString(msg) {
			t.Fatalf("Message(%q) = %q is not valid UTF-8", in, msg)
		}
		if m := leftovers.FindString(got); m != "" && !strings.Contains(in, m) {
			t.Fatalf("String(%q) = %q created %q", in, got, m)
		}
	})
}

// TestTokensInJSONEscapedText: results are JSON text, where a newline is the
// two characters `\n`, so a token right after it follows a word character.
func TestTokensInJSONEscapedText(t *testing.T) {
	r := redact.New(nil, nil)
	in := `{"output":"x\nAKIAABCDEFGHIJKLMNOP\nghp_` + strings.Repeat("a", 36) + `\ncsb_v1_abcdefghijklmnop\nBearer abcdefghijklmnopqrstu"}`
	out := r.String(in)
	for _, leak := range []string{"AKIAABCD", "ghp_aaaa", "csb_v1_abc", "abcdefghijklmnopqrstu"} {
		if strings.Contains(out, leak) {
			t.Errorf("%q survived in %q", leak, out)
		}
	}
}
