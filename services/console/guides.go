package console

import (
	"bytes"
	_ "embed"
	"html/template"
	texttemplate "text/template"

	"github.com/yuin/goldmark"

	"github.com/sandbox-broker/sandbox-broker/tools"
)

// guidesSource is the one text of the connect guides: the README carries
// it with example values (go run ./cmd/sandbox-broker docs), the connect
// page with this broker's URL filled in.
//
//go:embed guides.md
var guidesSource string

var guidesTemplate = texttemplate.Must(texttemplate.New("guides").Parse(guidesSource))

// GuideValues fill the guides in.
type GuideValues struct {
	Readme    bool   // the README's form: links to its sections
	MCPURL    string // the /mcp URL remote connectors use
	BaseURL   string // PUBLIC_BASE_URL
	BearerURL string // the /mcp URL in the bearer-token examples
	TokenCmd  string // shell words that print a token
}

// Markers around the README's generated connect guides.
const (
	GuidesStart = "<!-- START CONNECT GUIDES -->"
	GuidesEnd   = "<!-- END CONNECT GUIDES -->"
)

// ReplaceReadmeGuides puts the guides, with example values, between the
// README's markers.
func ReplaceReadmeGuides(readme string) (string, error) {
	md, err := guidesMarkdown(GuideValues{Readme: true, MCPURL: "https://broker.example.com/mcp", BaseURL: "https://broker.example.com",
		BearerURL: "http://127.0.0.1:8080/mcp", TokenCmd: "$(cat data/api_token)"})
	if err != nil {
		return "", err
	}
	return tools.ReplaceSection(readme, GuidesStart, GuidesEnd, md)
}

func guidesMarkdown(v GuideValues) (string, error) {
	var buf bytes.Buffer
	if err := guidesTemplate.Execute(&buf, v); err != nil {
		return "", err
	}
	return buf.String(), nil
}

// guidesHTML renders the guides for the connect page. goldmark escapes
// raw HTML by default, so nothing in the text or the values can inject
// markup.
func guidesHTML(v GuideValues) (template.HTML, error) {
	md, err := guidesMarkdown(v)
	if err != nil {
		return "", err
	}
	var buf bytes.Buffer
	if err := goldmark.Convert([]byte(md), &buf); err != nil {
		return "", err
	}
	return template.HTML(buf.String()), nil //nolint:gosec // goldmark output with raw HTML disabled
}
