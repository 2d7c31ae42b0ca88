package config

import "testing"

func TestIsLoopbackHost(t *testing.T) {
	for h, want := range map[string]bool{
		"localhost": true, "LocalHost": true, "127.0.0.1": true, "127.8.9.10": true, "::1": true,
		"": false, "localhost.evil.example": false, "10.0.0.1": false, "0.0.0.0": false, "::": false, "example.com": false,
	} {
		if got := IsLoopbackHost(h); got != want {
			t.Errorf("IsLoopbackHost(%q) = %v", h, got)
		}
	}
	for addr, want := range map[string]bool{"127.0.0.1:8080": true, "[::1]:80": true, "localhost:1": true, ":8080": false, "0.0.0.0:80": false, "127.0.0.1": false} {
		if got := (Config{Addr: addr}).IsLoopback(); got != want {
			t.Errorf("IsLoopback(%q) = %v", addr, got)
		}
	}
}
