package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/sandbox-broker/sandbox-broker/config"
	"github.com/sandbox-broker/sandbox-broker/services/broker"
)

func serve(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer, getenv func(string) string) int {
	// A client that stops reading our stderr (a stdio client gone) would
	// otherwise have the next log line kill the broker by SIGPIPE in the
	// middle of its shutdown, leaving its sandboxes behind. Caught (not
	// ignored, which children would inherit), the write just fails.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	cfg, err := config.Load(args, getenv)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return 2
	}
	logOut := stderr
	if cfg.LogFile != "" {
		f, err := os.OpenFile(cfg.LogFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			fmt.Fprintln(stderr, "LOG_FILE: cannot open:", err)
			return 2
		}
		defer f.Close()
		logOut = f
	}
	b, err := broker.New(ctx, cfg, broker.Options{Version: version, LogOut: logOut, Notice: stderr})
	if err != nil {
		fmt.Fprintln(stderr, "sandbox-broker:", err)
		return 1
	}
	defer b.Close()

	// Previews have a listener of their own, on either transport; it stops
	// before the broker closes, and the transport stops if it fails.
	servePreviews, err := b.ListenPreviews()
	if err != nil {
		fmt.Fprintln(stderr, "sandbox-broker:", err)
		return 1
	}
	sctx, cancel := context.WithCancel(ctx)
	var previewErr error
	previewsDone := make(chan struct{})
	if servePreviews != nil {
		go func() { defer close(previewsDone); previewErr = servePreviews(sctx); cancel() }()
	} else {
		close(previewsDone)
	}
	defer func() { cancel(); <-previewsDone }()

	switch cfg.Transport {
	case "stdio":
		err = b.ServeStdio(sctx, stdin, stdout)
	default:
		if !cfg.IsLoopback() {
			fmt.Fprintf(stderr, "sandbox-broker: listening beyond loopback on %s; set MCP_ALLOWED_HOSTS and keep it behind TLS\n", cfg.Addr)
		}
		var ln net.Listener
		if ln, err = net.Listen("tcp", cfg.Addr); err != nil {
			fmt.Fprintln(stderr, "sandbox-broker: MCP_HTTP_ADDR:", err)
			return 1
		}
		err = b.ServeHTTP(sctx, ln)
	}
	cancel()
	<-previewsDone
	if previewErr != nil && err == nil {
		err = fmt.Errorf("preview listener: %w", previewErr)
	}
	if err != nil && ctx.Err() == nil {
		fmt.Fprintln(stderr, "sandbox-broker:", err)
		return 1
	}
	return 0
}
