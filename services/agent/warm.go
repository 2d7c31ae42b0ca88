package agent

import (
	"context"
	"runtime/debug"
	"time"
)

// Warm runtimes. The agent's language runtime (the Python zygote; for
// TypeScript and JavaScript the Node resident and spare) is started on
// warm: at once, or with Options.WarmOnRequest when the broker asks
// (Request.Warm), so that it can spread the heavy preloads of many new
// sandboxes over time. A run never waits for the Python zygote: until it
// is ready, python runs start python3 directly (Response.Cold). After
// Options.IdleRelease without a run or a warm request, the runtimes are
// stopped (the sandbox, its files and a notebook kernel stay); the next
// warm, or the next TypeScript or JavaScript run, starts them again.

// HasRuntime says whether an agent of lang keeps a runtime to warm up.
func HasRuntime(lang string) bool {
	return lang == LangPython || lang == LangTypeScript || lang == LangJavaScript
}

// warm starts the runtime of the agent's language unless it is up or
// starting.
func (s *Server) warm() {
	switch s.opts.Language {
	case LangPython:
		if s.zyg != nil {
			s.zyg.warm()
		}
	case LangTypeScript, LangJavaScript:
		if s.node != nil {
			s.node.warm()
		}
	}
}

// isWarm reports whether the runtime of the agent's language is ready
// (true for a language without one).
func (s *Server) isWarm() bool {
	switch s.opts.Language {
	case LangPython:
		return s.zyg == nil || s.zyg.isReady()
	case LangTypeScript, LangJavaScript:
		return s.node == nil || s.node.isWarm()
	}
	return true
}

// release stops every runtime until the next warm and returns the
// agent's free memory to the system.
func (s *Server) release() {
	if s.zyg != nil {
		s.zyg.release()
	}
	if s.node != nil {
		s.node.release()
	}
	debug.FreeOSMemory()
	s.logf("idle: runtimes released")
}

// noteActive records a run's end or a warm request: the idle release
// counts from the last of them.
func (s *Server) noteActive() { s.lastActive.Store(time.Now().UnixNano()) }

// wantsRuntime reports whether a runtime is wanted (warm, or warming up).
func (s *Server) wantsRuntime() bool {
	return s.zyg != nil && s.zyg.wanted() || s.node != nil && s.node.resident.wanted()
}

// releaseWhenIdle releases the runtimes once neither a run nor a warm
// request has come for Options.IdleRelease, provided a run ever came: a
// sandbox that never ran anything (a warm one in the broker's pool) keeps
// them.
func (s *Server) releaseWhenIdle(ctx context.Context) {
	idle := s.opts.IdleRelease
	t := time.NewTimer(idle)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		wait := idle
		if s.ran.Load() {
			last := s.lastActive.Load()
			if since := time.Since(time.Unix(0, last)); since < idle {
				wait = idle - since
			} else if s.wantsRuntime() {
				select {
				case runSem <- struct{}{}: // no run in progress, none starts
					if s.lastActive.Load() == last {
						s.release()
					}
					<-runSem
				default:
				}
			}
		}
		t.Reset(wait)
	}
}
