package broker

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/config"
)

func TestLoadAgentKeys(t *testing.T) {
	write := func(content string) config.Config {
		p := filepath.Join(t.TempDir(), "keys.json")
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return config.Config{AgentKeysFile: p}
	}
	t.Setenv("ALICE_MODEL_KEY", "sk-ant-alice-0123456789")
	keys, err := loadAgentKeys(write(`{"alice": "ALICE_MODEL_KEY"}`))
	if err != nil || len(keys) != 1 || keys["alice"] != "sk-ant-alice-0123456789" {
		t.Fatalf("keys %v, %v", keys, err)
	}
	if keys, err := loadAgentKeys(config.Config{}); err != nil || len(keys) != 0 {
		t.Fatalf("no file: %v %v", keys, err)
	}
	for content, want := range map[string]string{
		`{"alice": "UNSET_MODEL_KEY_VAR"}`: "UNSET_MODEL_KEY_VAR",
		`{"bad name!": "ALICE_MODEL_KEY"}`: "not a valid principal",
		`["ALICE_MODEL_KEY"]`:              "not a JSON object",
	} {
		_, err := loadAgentKeys(write(content))
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "sk-ant-alice") {
			t.Errorf("%s: %v, want an error naming %q and not the key", content, err, want)
		}
	}
}
