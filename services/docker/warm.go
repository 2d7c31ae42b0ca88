package docker

import (
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// warmTurnLimit bounds the wait for a warm-up's turn; a later cold run
// asks again.
const warmTurnLimit = 10 * time.Minute

// warmAsync has c's agent warm its language runtime in the background, in
// its turn (Options.Warmups); at most one warm-up is pending per
// container. A session's container unused for the agent's idle release is
// left cold: the agent would only release it again.
func (e *Engine) warmAsync(c *ctr) {
	if !agent.HasRuntime(c.lang) || !c.warming.CompareAndSwap(false, true) {
		return
	}
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		defer c.warming.Store(false)
		ctx, cancel := c.untilDied(e.ctx, warmTurnLimit)
		defer cancel()
		err := agent.WarmInTurn(ctx, e.o.Warmups, c.socket(), func() bool {
			used := c.used.Load() // 0 while pooled
			return c.gone.Load() || (e.o.IdleRelease > 0 && used != 0 && time.Since(time.Unix(0, used)) >= e.o.IdleRelease)
		})
		if err != nil && ctx.Err() == nil {
			e.log.Warn().Err(err).Str("container", shortID(c.dockerID)).Str("language", c.lang).Msg("sandbox_not_warm")
		}
	}()
}
