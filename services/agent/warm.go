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
// Options.IdleRelease without a run, the runtimes are stopped (the
// sandbox, its files and a notebook kernel stay); the next warm, or the
// next TypeScript or JavaScript run, starts them again.

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

// noteRun records the end of a run for the idle release.
func (s *Server) noteRun() { s.lastRun.Store(time.Now().UnixNano()) }

// releaseWhenIdle releases the runtimes once no run has ended for
// Options.IdleRelease, counted from the last run: a sandbox that never ran
// anything (a warm one in the broker's pool) keeps them.
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
		if last := s.lastRun.Load(); last != 0 {
			if since := time.Since(time.Unix(0, last)); since < idle {
				wait = idle - since
			} else {
				select {
				case runSem <- struct{}{}: // no run in progress, none starts
					if s.lastRun.CompareAndSwap(last, 0) {
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
