package broker

import (
	"context"
	"io"
	"log"

	"github.com/mark3labs/mcp-go/server"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/middleware"
	"github.com/sandbox-broker/sandbox-broker/services/identity"
	"github.com/sandbox-broker/sandbox-broker/services/logging"
	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// LocalPrincipal is who a stdio client is: the operator who started us.
var LocalPrincipal = identity.Principal{ID: "local", Tier: quota.TierPro}

// ServeStdio speaks MCP on in/out until ctx ends or in closes. Nothing but
// protocol is written to out.
func (b *Broker) ServeStdio(ctx context.Context, in io.Reader, out io.Writer) error {
	s := server.NewStdioServer(b.mcp)
	s.SetContextFunc(func(ctx context.Context) context.Context {
		return identity.WithPrincipal(middleware.WithSource(ctx, audit.Source{Transport: "stdio"}), LocalPrincipal)
	})
	s.SetErrorLogger(log.New(logging.Component(b.log, "stdio"), "", 0))
	b.log.Info().Msg("stdio_listening")
	return s.Listen(ctx, in, out)
}
