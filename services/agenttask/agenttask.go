// Package agenttask runs a coding agent (Claude Code or OpenCode) headless
// in a session's sandbox: the command and environment that start it with
// auto-approval against the broker's model gateway, and the reader that
// turns its JSON stream into execution events and the task's outcome.
package agenttask

import (
	"encoding/json"
	"strconv"

	"github.com/sandbox-broker/sandbox-broker/services/modelgw"
)

// Agents execute_task can run.
const (
	ClaudeCode = "claude-code"
	OpenCode   = "opencode"
)

// Agents lists them, the default first.
var Agents = []string{ClaudeCode, OpenCode}

// PlaceholderKey is the only API key a sandbox ever holds. The gateway
// ignores it (the job's egress socket is what identifies the caller) and
// the real API refuses it, so printing it gives nothing away.
const PlaceholderKey = "sandbox-placeholder-key-useless-outside-the-gateway"

// Spec is one task to start.
type Spec struct {
	Agent  string
	Prompt string
	Model  string // the main model
	// SmallModel is what the agent may use for background work (Claude
	// Code's "haiku" calls); it must be allowed by the gateway too.
	SmallModel string
	MaxTurns   int
}

// Command returns the bash command that runs the agent and the
// environment it needs (added to the sandbox's base environment). The
// prompt travels in the environment, not the command line, and is unset
// before the agent starts; the command itself is fixed text.
func Command(s Spec) (string, map[string]string) {
	env := map[string]string{
		"TASK_PROMPT": s.Prompt,
		"TASK_MODEL":  s.Model,
	}
	switch s.Agent {
	case OpenCode:
		cfg, _ := json.Marshal(map[string]any{
			"$schema": "https://opencode.ai/config.json",
			"provider": map[string]any{"anthropic": map[string]any{"options": map[string]any{
				"baseURL": modelgw.BaseURL + "/v1", "apiKey": PlaceholderKey,
			}}},
			"small_model": "anthropic/" + s.SmallModel,
			"autoupdate":  false,
			"share":       "disabled",
		})
		env["OPENCODE_CONFIG_CONTENT"] = string(cfg)
		for _, k := range []string{"OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_LSP_DOWNLOAD", "OPENCODE_DISABLE_SHARE"} {
			env[k] = "1"
		}
		return `prompt=$TASK_PROMPT; unset TASK_PROMPT; exec opencode run --format json --auto -m "anthropic/$TASK_MODEL" "$prompt"`, env
	}
	env["ANTHROPIC_BASE_URL"] = modelgw.BaseURL
	env["ANTHROPIC_API_KEY"] = PlaceholderKey
	env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] = s.SmallModel
	env["ANTHROPIC_SMALL_FAST_MODEL"] = s.SmallModel
	// No auto-update, telemetry, error reports or other traffic beside the
	// model calls; a few retries only (a refused budget is final anyway).
	env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
	env["DISABLE_AUTOUPDATER"] = "1"
	env["DISABLE_TELEMETRY"] = "1"
	env["DISABLE_ERROR_REPORTING"] = "1"
	env["CLAUDE_CODE_MAX_RETRIES"] = "3"
	env["CLAUDE_CONFIG_DIR"] = "/tmp/.claude"
	return `prompt=$TASK_PROMPT; unset TASK_PROMPT; exec claude -p "$prompt" --output-format stream-json --verbose ` +
		`--dangerously-skip-permissions --no-session-persistence --model "$TASK_MODEL" --max-turns ` + strconv.Itoa(max(s.MaxTurns, 1)), env
}
