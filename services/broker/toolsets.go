package broker

import (
	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/docker"
	"github.com/sandbox-broker/sandbox-broker/tools"
)

// markUnconfigured tells the tool group which services this broker lacks,
// so their tools are not listed (they could only answer NOT_CONFIGURED),
// and says so in the log with what to configure.
func (b *Broker) markUnconfigured(g *tools.Group, cfg config.Config, tasks *tools.Tasks) {
	mark := func(s tools.Service, why string) {
		g.Unconfigured(s, why)
		b.log.Info().Str("service", string(s)).Str("reason", why).Msg("tools_not_listed")
	}
	switch {
	case b.sandboxes != nil:
	case cfg.Backend == "none":
		mark(tools.ServiceSandbox, "SANDBOX_BACKEND=none")
	default:
		mark(tools.ServiceSandbox, "the sandbox backend did not start (see sandbox_backend_unavailable in the log)")
	}
	_, onDocker := b.backend.(*docker.Engine)
	switch {
	case b.projects != nil:
	case cfg.CSBAPIKey.Reveal() != "" || onDocker:
		mark(tools.ServiceProjects, "the project provider did not start (see project_provider_unavailable in the log)")
	default:
		mark(tools.ServiceProjects, "set CSB_API_KEY for hosted projects, or use the Docker backend for local ones")
	}
	if b.github == nil {
		mark(tools.ServiceGitHub, "GITHUB_REPOS_FILE is not set")
	}
	switch {
	case tasks != nil && tasks.Gateway != nil:
	case tasks == nil:
		mark(tools.ServiceModels, "set ANTHROPIC_API_KEY or AGENT_KEYS_FILE")
	default:
		mark(tools.ServiceModels, "agent tasks need the Docker backend")
	}
}
