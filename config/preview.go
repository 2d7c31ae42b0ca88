package config

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
)

// PreviewsOff is the PREVIEW_ADDR value that serves no previews.
const PreviewsOff = "off"

// PreviewWildcard starts a PREVIEW_BASE_URL host whose first label is the
// sandbox ID: one origin per sandbox.
const PreviewWildcard = "*."

// PreviewListenAddr is where the broker serves project previews when it
// serves them itself (the local project provider), or ok=false when
// PREVIEW_ADDR is off. Unset, it is the HTTP listener's host with the next
// port (an OS-chosen one when MCP_HTTP_ADDR's port is 0), and 127.0.0.1
// with an OS-chosen port on stdio, where MCP_HTTP_ADDR means nothing.
func (c Config) PreviewListenAddr() (addr string, ok bool) {
	switch {
	case c.PreviewAddr == PreviewsOff:
		return "", false
	case c.PreviewAddr != "":
		return c.PreviewAddr, true
	case c.Transport == "stdio":
		return "127.0.0.1:0", true
	}
	host, port, err := net.SplitHostPort(c.Addr)
	if err != nil {
		return "127.0.0.1:0", true // Validate refuses such an MCP_HTTP_ADDR
	}
	next := 0
	if n, err := strconv.Atoi(port); err == nil && n > 0 && n < 65535 {
		next = n + 1
	}
	return net.JoinHostPort(host, strconv.Itoa(next)), true
}

// PreviewBaseFor is the origin preview links point at, given the port the
// preview listener bound: PREVIEW_BASE_URL, or by default
// http://*.localhost:<port> (Chromium and Firefox resolve every name under
// localhost to loopback, and each sandbox gets an origin of its own). With a
// PUBLIC_BASE_URL beyond loopback and no PREVIEW_BASE_URL there is no
// address a remote browser could use: the error says what to set.
func (c Config) PreviewBaseFor(port int) (string, error) {
	if c.PreviewBaseURL != "" {
		return strings.TrimRight(c.PreviewBaseURL, "/"), nil
	}
	if c.PublicBaseURL != "" {
		if u, err := url.Parse(c.PublicBaseURL); err != nil || !IsLoopbackHost(u.Hostname()) {
			return "", errors.New("this broker has no address for previews: set PREVIEW_BASE_URL to an origin of their own (see README, Web projects)")
		}
	}
	return "http://" + PreviewWildcard + "localhost:" + strconv.Itoa(port), nil
}

// validatePreview checks PREVIEW_BASE_URL: an http(s) origin whose host
// (after an optional leading "*.") is a DNS name or IP address, and which
// the broker itself does not answer on, so a preview's scripts can never
// run on the broker's origin or share its host's cookies.
func validatePreview(c Config) error {
	if c.PreviewBaseURL == "" {
		return nil
	}
	u, err := url.Parse(c.PreviewBaseURL)
	if err != nil {
		return errors.New("config: PREVIEW_BASE_URL is not a valid URL; its value is not shown")
	}
	if u.User != nil || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || strings.Trim(u.Path, "/") != "" ||
		(u.Scheme != "http" && u.Scheme != "https") {
		return errors.New("config: PREVIEW_BASE_URL must be an http(s) origin such as https://*.preview.example.net, with no path, query or user info; its value is not shown")
	}
	host := strings.ToLower(u.Hostname())
	wildcard := strings.HasPrefix(host, PreviewWildcard)
	name := strings.TrimPrefix(host, PreviewWildcard)
	if ip := net.ParseIP(name); ip != nil && wildcard || ip == nil && validate.Var(name, "hostname_rfc1123") != nil {
		return fmt.Errorf("config: PREVIEW_BASE_URL host %q must be a DNS name (optionally starting with %q) or an IP address", host, PreviewWildcard)
	}
	if !wildcard && c.BrokerHosts()[name] {
		return fmt.Errorf("config: PREVIEW_BASE_URL host %q is one the broker itself answers on; previews need an origin of their own (e.g. https://*.preview.example.net)", host)
	}
	return nil
}

// BrokerHosts are the host names the HTTP listener accepts (its Host
// allow-list), lower-case: loopback, MCP_ALLOWED_HOSTS and PUBLIC_BASE_URL's.
func (c Config) BrokerHosts() map[string]bool {
	hosts := map[string]bool{"localhost": true, "127.0.0.1": true, "::1": true}
	for _, h := range c.AllowedHosts {
		hosts[strings.ToLower(h)] = true
	}
	if u, err := url.Parse(c.PublicBaseURL); err == nil && c.PublicBaseURL != "" {
		hosts[strings.ToLower(u.Hostname())] = true
	}
	return hosts
}
