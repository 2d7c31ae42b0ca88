package docker

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
)

// agentRun and agentWaitReady talk to a container's agent over its socket.
// They are variables so that tests can count or fail calls.
var (
	agentRun       = runAgent
	agentWaitReady = waitAgentReady
)

// runAgent sends one request and reads one JSON line back (protocol.go).
func runAgent(ctx context.Context, socketPath string, req agent.Request) (agent.Response, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", socketPath)
	if err != nil {
		return agent.Response{}, err
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	b, err := json.Marshal(req)
	if err != nil {
		return agent.Response{}, err
	}
	if _, err := conn.Write(append(b, '\n')); err != nil {
		return agent.Response{}, ctxErr(ctx, err)
	}
	br := bufio.NewReaderSize(io.LimitReader(conn, agent.MaxResponseBytes+1), 64<<10)
	line, err := br.ReadBytes('\n')
	if err != nil && !(errors.Is(err, io.EOF) && len(line) > 0) {
		return agent.Response{}, ctxErr(ctx, err)
	}
	if len(line) > agent.MaxResponseBytes {
		return agent.Response{}, errors.New("agent response too large")
	}
	var resp agent.Response
	if err := json.Unmarshal(bytes.TrimSpace(line), &resp); err != nil {
		return agent.Response{}, fmt.Errorf("bad agent response: %w", err)
	}
	return resp, nil
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// waitAgentReady polls the agent with ping requests until one succeeds.
func waitAgentReady(ctx context.Context, socketPath string) error {
	t := time.NewTicker(15 * time.Millisecond)
	defer t.Stop()
	var last error
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, err := runAgent(pctx, socketPath, agent.Request{Language: agent.PingLanguage})
		cancel()
		if err == nil && resp.Error == "" {
			return nil
		}
		if err == nil {
			err = errors.New(resp.Error)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent not ready: %w (last: %v)", ctx.Err(), last)
		case <-t.C:
		}
	}
}
