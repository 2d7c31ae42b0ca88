package agent

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// ErrNotReached wraps a failure to connect to the agent: the request was
// never sent, so nothing ran and the caller may retry on a new sandbox
// (the agent's container died, say with a restarted Docker daemon).
var ErrNotReached = errors.New("agent: not reached")

// ClientMargin is added to the request's timeout for the client's deadline:
// it covers the agent's kill, sweep and output drain.
const ClientMargin = 10 * time.Second

// Dialer connects to an agent: its Unix socket (SocketDialer), or a pod's
// mutual-TLS port. An error from it means nothing was sent.
type Dialer func(ctx context.Context) (net.Conn, error)

// SocketDialer dials the agent's Unix socket at path (see DialSocket).
func SocketDialer(path string) Dialer {
	return func(ctx context.Context) (net.Conn, error) { return DialSocket(ctx, path) }
}

// Run sends req to the agent listening on socketPath and returns its
// Response (RunVia through SocketDialer).
func Run(ctx context.Context, socketPath string, req Request) (Response, error) {
	return RunVia(ctx, SocketDialer(socketPath), req)
}

// RunVia sends req to the agent dial reaches and returns its
// Response. The call is bounded by ctx and by the request's timeout (or
// DefaultTimeoutMS) plus ClientMargin; the answer is read through a
// MaxResponseBytes limit and decoded strictly (unknown fields, trailing
// data or an oversized answer are errors). A Response with Error set is
// returned with a nil error: the agent answered, but could not run the code.
func RunVia(ctx context.Context, dial Dialer, req Request) (Response, error) {
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	if req.TimeoutMS <= 0 {
		timeout = DefaultTimeoutMS * time.Millisecond
	}
	if req.Language == PingLanguage {
		timeout = 0
	}
	deadline := time.Now().Add(timeout + ClientMargin)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	dctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	c, err := dial(dctx)
	if err != nil {
		return Response{}, fmt.Errorf("%w: %w", ErrNotReached, err)
	}
	defer c.Close()
	_ = c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()

	b, err := json.Marshal(req)
	if err != nil {
		return Response{}, fmt.Errorf("agent: encode request: %w", err)
	}
	if len(b)+1 > MaxRequestBytes {
		return Response{}, fmt.Errorf("agent: request of %d bytes exceeds %d", len(b)+1, MaxRequestBytes)
	}
	if _, err := c.Write(append(b, '\n')); err != nil {
		return Response{}, ctxErr(ctx, fmt.Errorf("agent: write: %w", err))
	}
	data, err := io.ReadAll(io.LimitReader(c, MaxResponseBytes+1))
	if err != nil {
		return Response{}, ctxErr(ctx, fmt.Errorf("agent: read: %w", err))
	}
	if len(data) > MaxResponseBytes {
		return Response{}, fmt.Errorf("agent: response exceeds %d bytes", MaxResponseBytes)
	}
	return decodeResponse(data)
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%v)", ctx.Err(), err)
	}
	return err
}

// decodeResponse decodes exactly one JSON object followed by optional
// whitespace.
func decodeResponse(data []byte) (Response, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return Response{}, errors.New("agent: empty response")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var resp Response
	if err := dec.Decode(&resp); err != nil {
		return Response{}, fmt.Errorf("agent: decode response: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return Response{}, errors.New("agent: trailing data after the response")
	}
	return resp, nil
}

// Ping asks the agent for a cheap liveness answer; warm reports whether
// the runtime of its language is ready (its Python zygote, say). With
// start set it also asks the agent to start that runtime.
func Ping(ctx context.Context, socketPath string, start bool) (warm bool, err error) {
	resp, err := Run(ctx, socketPath, Request{Language: PingLanguage, Warm: start})
	if err != nil {
		return false, err
	}
	if resp.Error != "" {
		return false, fmt.Errorf("agent: ping: %s", resp.Error)
	}
	return resp.Warm, nil
}

// WaitReady pings the agent until it answers, with a short backoff (1 ms
// doubling to 4 ms: a new session waits on this), until ctx is done. Use
// it after starting a container.
func WaitReady(ctx context.Context, socketPath string) error {
	return waitPing(ctx, socketPath, false)
}

// WaitWarm is WaitReady that also asks for the runtime of the agent's
// language (see Request.Warm) and waits until it is ready (backoff up to
// 50 ms).
func WaitWarm(ctx context.Context, socketPath string) error {
	return waitPing(ctx, socketPath, true)
}

// WarmTimeout bounds one warm-up (the Python data stack's preload).
const WarmTimeout = 2 * time.Minute

// WarmInTurn waits for a turn in w, then, unless skip says the sandbox
// wants it no more, has the agent at socketPath warm its language runtime
// and waits (at most WarmTimeout) until it is ready. It returns nil when
// skipped.
func WarmInTurn(ctx context.Context, w *sandbox.Warmups, socketPath string, skip func() bool) error {
	var err error
	if werr := w.Run(ctx, func(ctx context.Context) {
		if skip() {
			return
		}
		wctx, cancel := context.WithTimeout(ctx, WarmTimeout)
		defer cancel()
		err = WaitWarm(wctx, socketPath)
	}); werr != nil {
		return werr
	}
	return err
}

func waitPing(ctx context.Context, socketPath string, warm bool) error {
	backoff, maxBackoff := time.Millisecond, 4*time.Millisecond
	if warm {
		maxBackoff = 50 * time.Millisecond
	}
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		ready, err := Ping(pctx, socketPath, warm)
		cancel()
		if err == nil && (ready || !warm) {
			return nil
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			if err == nil {
				return fmt.Errorf("agent: runtime not warm: %w", ctx.Err())
			}
			return fmt.Errorf("agent: not ready: %w (last error: %v)", ctx.Err(), err)
		case <-t.C:
		}
		backoff = min(backoff*2, maxBackoff)
	}
}

// ExecResult maps the agent's answer to a run's result. dur is the host's
// clock, which bills the run: the agent's own figure is untrusted. An
// answer with Error set (the agent could not run the code) is UNAVAILABLE.
func ExecResult(resp Response, dur time.Duration) (sandbox.ExecResult, error) {
	if resp.Error != "" {
		msg := resp.Error
		if len(msg) > 300 {
			msg = msg[:300] + "…"
		}
		return sandbox.ExecResult{Duration: dur}, brokererr.New(brokererr.Unavailable, "the sandbox could not run the code: %s", msg)
	}
	res := sandbox.ExecResult{
		ExitCode:        resp.ExitCode,
		Signal:          resp.Signal,
		Stdout:          resp.Stdout,
		Stderr:          resp.Stderr,
		Truncated:       resp.Truncated,
		TimedOut:        resp.TimedOut,
		Duration:        dur,
		DisplaysDropped: max(resp.DisplaysDropped, 0),
	}
	for _, d := range resp.Displays {
		if x, ok := decodeDisplay(d); ok && len(res.Displays) < MaxDisplays {
			res.Displays = append(res.Displays, x)
		} else {
			res.DisplaysDropped++
		}
	}
	if e := resp.Exception; e != nil {
		res.Exception = &sandbox.Exception{Name: e.Name, Value: e.Value}
	}
	if k := resp.Kernel; k != nil {
		res.Kernel = &sandbox.KernelStatus{ExecutionCount: max(k.ExecutionCount, 0), Started: k.Started, Reason: k.Lost, Ended: k.Ended}
	}
	return res, nil
}

// decodeDisplay checks one of the agent's displays: known kind and MIME
// types only, images valid base64 of the format their type names.
func decodeDisplay(d Display) (sandbox.Display, bool) {
	if d.Kind != DisplayResult && d.Kind != DisplayData {
		return sandbox.Display{}, false
	}
	out := sandbox.Display{Kind: d.Kind, Data: map[string][]byte{}}
	for _, mime := range DisplayMIMETypes {
		v, ok := d.Data[mime]
		if !ok {
			continue
		}
		if !strings.HasPrefix(mime, "image/") {
			out.Data[mime] = []byte(v)
			continue
		}
		b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(v))
		if err != nil || !imageMagic(mime, b) {
			continue
		}
		out.Data[mime] = b
	}
	return out, len(out.Data) > 0
}

func imageMagic(mime string, b []byte) bool {
	switch mime {
	case "image/png":
		return isPNG(b)
	case "image/jpeg":
		return len(b) > 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff
	}
	return false
}

// UnknownLanguage is a backend's answer to a run in a language it does not
// offer, naming the ones it does.
func UnknownLanguage(lang string, available iter.Seq[string]) error {
	msg := "none"
	if langs := slices.Sorted(available); len(langs) > 0 {
		msg = strings.Join(langs, ", ")
	}
	if len(lang) > 40 {
		lang = lang[:40] + "…"
	}
	return brokererr.New(brokererr.UnknownLanguage, "unknown language %q; available: %s", lang, msg)
}
