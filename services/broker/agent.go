package broker

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/agenttask"
	"github.com/sandbox-broker/sandbox-broker/services/docker"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/modelgw"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// maxKeysFile bounds AGENT_KEYS_FILE.
const maxKeysFile = 1 << 20

// loadAgentKeys reads AGENT_KEYS_FILE, a JSON object from principal to the
// name of the environment variable that holds its model API key (the key
// itself is never in the file), and returns the keys by principal.
func loadAgentKeys(cfg config.Config) (map[string]string, error) {
	keys := map[string]string{}
	if cfg.AgentKeysFile == "" {
		return keys, nil
	}
	f, err := os.Open(cfg.AgentKeysFile)
	if err != nil {
		return nil, fmt.Errorf("AGENT_KEYS_FILE: cannot open it")
	}
	defer f.Close()
	raw, err := io.ReadAll(io.LimitReader(f, maxKeysFile+1))
	if err != nil || len(raw) > maxKeysFile {
		return nil, fmt.Errorf("AGENT_KEYS_FILE: unreadable or larger than %d bytes", maxKeysFile)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	var names map[string]string
	if err := dec.Decode(&names); err != nil {
		return nil, fmt.Errorf("AGENT_KEYS_FILE: not a JSON object of principal to variable name: %v", err)
	}
	for principal, env := range names {
		if !identity.ValidPrincipal(principal) {
			return nil, fmt.Errorf("AGENT_KEYS_FILE: %q is not a valid principal name", principal)
		}
		key := os.Getenv(env)
		if len(key) < 8 {
			return nil, fmt.Errorf("AGENT_KEYS_FILE: the variable %q named for %s is unset or too short", env, principal)
		}
		keys[principal] = key
	}
	return keys, nil
}

// agentEngineOptions gives the run engine the agent runner, with its own
// limits, when tasks are configured.
func agentEngineOptions(cfg config.Config, o *docker.Options) {
	if !cfg.TasksEnabled() {
		return
	}
	o.JobLanguages = []string{agent.LangAgent}
	o.Resources = map[string]docker.Resources{agent.LangAgent: {Memory: cfg.AgentMemoryMB << 20, NanoCPUs: int64(cfg.AgentCPUsMilli) * 1_000_000}}
}

// openTasks sets up agent tasks (execute_task): the model gateway with its
// budget store, and the tools' dependencies. It returns nil when tasks are
// not configured (the agent toolset is then not registered). Tasks need
// the Docker backend, whose agent runner they run in; on another backend
// the tools answer UNAVAILABLE.
func (b *Broker) openTasks(ctx context.Context, cfg config.Config, runs *tools.Jobs, keys map[string]string, dockerOK bool) (*tools.Tasks, error) {
	if !cfg.TasksEnabled() {
		return nil, nil
	}
	policies, err := agenttask.ParsePolicies(cfg.AgentTiers)
	if err != nil {
		return nil, err
	}
	t := &tools.Tasks{Jobs: runs, Models: cfg.AgentModels, SmallModel: cfg.AgentSmallModel,
		DefaultTimeout: time.Duration(cfg.AgentTimeoutS) * time.Second, MaxTurns: cfg.AgentMaxTurns,
		Policy: func(p identity.Principal) agenttask.Policy {
			if pol, ok := policies[string(p.Tier)]; ok {
				return pol
			}
			return policies["free"]
		}}
	if b.github != nil {
		t.GitHub = b.github
	}
	if !dockerOK || runs.Jobs == nil {
		b.log.Warn().Msg("agent_tasks_need_docker")
		return t, nil
	}
	if b.modelBudget, err = modelgw.OpenBudget(ctx, cfg.StatePath(), nil); err != nil {
		return nil, fmt.Errorf("model budget: %w", err)
	}
	b.checks = append(b.checks, check{"model_budget", b.modelBudget.Ping})
	operatorKey := cfg.AnthropicAPIKey.Reveal()
	gw, err := modelgw.New(modelgw.Options{
		Upstream: cfg.AnthropicAPIURL,
		Key: func(principal string) string {
			if k, ok := keys[principal]; ok {
				return k
			}
			return operatorKey
		},
		Models:          cfg.AgentModels,
		MaxRequestBytes: cfg.AgentMaxRequestMB << 20,
		Budget:          b.modelBudget,
		Audit:           b.audit,
		Log:             logging.Component(b.log, "modelgw"),
	})
	if err != nil {
		return nil, err
	}
	t.Gateway = gw
	return t, nil
}
