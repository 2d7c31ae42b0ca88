package csbfake

import (
	"slices"
	"strconv"
)

// progress is a VM's SetupProgress (pitcher-protocol/messages/setup.d.ts:
// 2-13) as setup/get and setup/progress carry it. A VM's setup runs when a
// client first joins after a clean boot (its steps, the template's setup
// tasks, finish at once): IDLE with no steps before, FINISHED with them
// after. The caller holds s.mu.
func (sb *sandbox) progress() map[string]any {
	state := "IDLE"
	steps := []map[string]any{}
	if sb.setupRan {
		state = "FINISHED"
		for i, cmd := range sb.setupTasks {
			steps = append(steps, map[string]any{"name": "Setup task " + strconv.Itoa(i+1), "command": cmd, "shellId": nil, "finishStatus": "SUCCEEDED"})
		}
	}
	return map[string]any{"state": state, "steps": steps, "currentStepIndex": 0}
}

// SetSetupTasks gives a template setup tasks; forks inherit them. A VM
// whose setup lists steps answers setup/get with them once a client has
// joined, so the SDK need not wait for setup/progress.
func (s *Server) SetSetupTasks(id string, commands ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if sb := s.sandboxes[id]; sb != nil {
		sb.setupTasks = slices.Clone(commands)
	}
}

// HoldSetup keeps every VM's setup from starting, and so any setup/progress
// from being sent, until release is called.
func (s *Server) HoldSetup() (release func()) {
	hold := make(chan struct{})
	s.mu.Lock()
	s.setupHold = hold
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		if s.setupHold == hold {
			s.setupHold = nil
			close(hold)
		}
		s.bumpLocked()
		s.mu.Unlock()
	}
}

// SetResponseStatus(false) makes the agent answer without the status key.
// The SDK's types carry one (pitcher-protocol/message.d.ts:11-25) but its
// receiveMessage routes on the result and error keys alone.
func (s *Server) SetResponseStatus(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.noStatus = !on
}

// SetAgentScheme sets the scheme of the pitcher_url start returns: "ws"
// (default) or "http", which the SDK's ws library also dials.
func (s *Server) SetAgentScheme(scheme string) {
	if scheme != "ws" && scheme != "http" {
		panic("csbfake: agent scheme must be ws or http")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.agentScheme = scheme
}

// runSetup runs after a client joined: it runs the VM's setup (unless
// held, and if it has not run since the last clean boot) and sends that
// client setup/progress, as the real agent does for a client that joined
// with asyncProgress.
func (s *Server) runSetup(ac *agentConn, sb *sandbox) {
	s.mu.Lock()
	hold := s.setupHold
	s.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ac.ctx.Done():
			return
		}
	}
	s.mu.Lock()
	sb.setupRan = true
	params := sb.progress()
	s.calls = append(s.calls, PitcherCall{SandboxID: sb.id, Method: "setup/progress", Params: params, FromAgent: true})
	s.bumpLocked()
	s.mu.Unlock()
	ac.notify("setup/progress", params)
}
