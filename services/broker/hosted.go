package broker

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"time"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox/hosted"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// openHosted starts SANDBOX_BACKEND=codesandbox: sessions in CodeSandbox
// VMs, with the local Docker engine behind it when SANDBOX_FALLBACK=docker
// (a call CodeSandbox could not take then runs there, and says so).
// dockerOK says the Docker engine runs.
func (b *Broker) openHosted(ctx context.Context, cfg config.Config, agentBin string) (sandbox.Backend, bool, error) {
	if cfg.CSBAPIKey.Reveal() == "" {
		return nil, false, errors.New("SANDBOX_BACKEND=codesandbox needs CSB_API_KEY")
	}
	h, err := hosted.New(ctx, hosted.Options{
		API:             b.csbAPI(cfg),
		Template:        cfg.CSBRunnerTemplate,
		Tier:            cfg.CSBVMTier,
		Network:         cfg.CSBVMNetwork,
		IdleTimeout:     time.Duration(cfg.IdleTimeoutMS) * time.Millisecond,
		WorkspaceLimits: workspaceLimits(cfg),
		DBPath:          filepath.Join(cfg.Root, "state.db"),
		Log:             b.log,
	})
	if err != nil {
		return nil, false, err
	}
	sweep := func(ctx context.Context) {
		if n, err := h.Sweep(ctx); err != nil {
			b.log.Warn().Str("error_code", string(brokererr.CodeOf(err))).Msg("csb_session_sweep_failed")
		} else if n > 0 {
			b.log.Info().Int("deleted", n).Msg("csb_session_sweep")
		}
	}
	b.loop(sweep)
	b.every(30*time.Minute, sweep)
	if cfg.Fallback != "docker" {
		return h, false, nil
	}
	d, err := b.openDocker(ctx, cfg, agentBin)
	if err != nil {
		b.log.Warn().Str("cause", causeText(b.redactor, err, 300)).Msg("docker_fallback_unavailable")
		return h, false, nil
	}
	b.poolStats = func() map[string]int { return d.Stats().PoolReady }
	return &sandbox.Fallback{Primary: h, Secondary: d, OnFallback: func(ref sandbox.SessionRef, err error) {
		b.log.Warn().Str("workspace_id", ref.WorkspaceID).Str("error_code", string(brokererr.CodeOf(err))).Msg("sandbox_fallback_to_docker")
	}}, true, nil
}

// csbAPI is the CodeSandbox client's configuration, its requests counted
// in the upstream metrics; it follows no redirects (the bearer key stays
// with the API's host).
func (b *Broker) csbAPI(cfg config.Config) codesandbox.Options {
	return codesandbox.Options{BaseURL: cfg.CSBAPIURL, APIKey: cfg.CSBAPIKey.Reveal(), HTTP: &http.Client{
		Transport:     b.pm.instrument("codesandbox", nil),
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}
