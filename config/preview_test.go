package config

import (
	"strings"
	"testing"
)

func TestPreviewListenAddr(t *testing.T) {
	for _, tc := range []struct {
		transport, addr, preview, want string
		ok                             bool
	}{
		{"http", "127.0.0.1:8080", "", "127.0.0.1:8081", true},
		{"http", "0.0.0.0:9000", "", "0.0.0.0:9001", true},
		{"http", "[::1]:8080", "", "[::1]:8081", true},
		{"http", "127.0.0.1:0", "", "127.0.0.1:0", true},     // tests: any free port
		{"http", "127.0.0.1:65535", "", "127.0.0.1:0", true}, // no next port
		{"stdio", "127.0.0.1:8080", "", "127.0.0.1:0", true},
		{"http", "127.0.0.1:8080", "127.0.0.2:7000", "127.0.0.2:7000", true},
		{"stdio", "127.0.0.1:8080", "off", "", false},
	} {
		c := Defaults()
		c.Transport, c.Addr, c.PreviewAddr = tc.transport, tc.addr, tc.preview
		if got, ok := c.PreviewListenAddr(); got != tc.want || ok != tc.ok {
			t.Errorf("%+v: %q %v", tc, got, ok)
		}
	}
}

func TestPreviewBaseFor(t *testing.T) {
	c := Defaults()
	if got, err := c.PreviewBaseFor(8081); err != nil || got != "http://*.localhost:8081" {
		t.Errorf("default: %q %v", got, err)
	}
	c.PublicBaseURL = "http://localhost:8080"
	if got, err := c.PreviewBaseFor(8081); err != nil || got != "http://*.localhost:8081" {
		t.Errorf("loopback PUBLIC_BASE_URL: %q %v", got, err)
	}
	// A remote broker has no default a browser could reach.
	c.PublicBaseURL = "https://broker.example.com"
	if _, err := c.PreviewBaseFor(8081); err == nil || !strings.Contains(err.Error(), "PREVIEW_BASE_URL") {
		t.Errorf("remote PUBLIC_BASE_URL without PREVIEW_BASE_URL: %v", err)
	}
	c.PreviewBaseURL = "https://*.preview.example.net/"
	if got, err := c.PreviewBaseFor(8081); err != nil || got != "https://*.preview.example.net" {
		t.Errorf("PREVIEW_BASE_URL: %q %v", got, err)
	}
}

func TestPreviewConfigValidation(t *testing.T) {
	for _, ok := range []map[string]string{
		{"PREVIEW_BASE_URL": "https://*.preview.example.net"},
		{"PREVIEW_BASE_URL": "http://*.localhost:8081"},
		{"PREVIEW_BASE_URL": "https://preview.example.net:8443/"},
		{"PREVIEW_BASE_URL": "http://127.0.0.2:8081"},
		{"PREVIEW_ADDR": "off"},
		{"PREVIEW_ADDR": "127.0.0.1:0"},
		{"PROJECT_BUILD_WAIT_S": "1"},
	} {
		if _, err := Load(nil, envOf(ok)); err != nil {
			t.Errorf("%v refused: %v", ok, err)
		}
	}
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		// The broker's own hosts: previews would share its origin or cookies.
		{map[string]string{"PREVIEW_BASE_URL": "http://localhost:8081"}, "answers on"},
		{map[string]string{"PREVIEW_BASE_URL": "http://127.0.0.1:8081"}, "answers on"},
		{map[string]string{"PREVIEW_BASE_URL": "https://broker.example.com:8443", "PUBLIC_BASE_URL": "https://broker.example.com"}, "answers on"},
		{map[string]string{"PREVIEW_BASE_URL": "https://b.example.com", "MCP_ALLOWED_HOSTS": "B.example.com"}, "answers on"},
		{map[string]string{"PREVIEW_BASE_URL": "https://*.127.0.0.1"}, "DNS name"},
		{map[string]string{"PREVIEW_BASE_URL": "https://a.*.example.com"}, "DNS name"},
		{map[string]string{"PREVIEW_BASE_URL": "https://*.example.com/previews"}, "no path"},
		{map[string]string{"PREVIEW_BASE_URL": "https://u:secret-pw@p.example.com"}, "PREVIEW_BASE_URL"},
		{map[string]string{"PREVIEW_BASE_URL": "ftp://p.example.com"}, "PREVIEW_BASE_URL"},
		{map[string]string{"PREVIEW_ADDR": "on"}, "PREVIEW_ADDR"},
		{map[string]string{"PROJECT_BUILD_WAIT_S": "51"}, "PROJECT_BUILD_WAIT_S"},
	} {
		_, err := Load(nil, envOf(tc.env))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error about %q", tc.env, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "secret-pw") {
			t.Errorf("error reveals user info: %v", err)
		}
	}
}
