package broker

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mark3labs/mcp-go/mcp"
	"github.com/mark3labs/mcp-go/server"
)

// HealthURI is the MCP resource with the broker's health.
const HealthURI = "health://check"

type check struct {
	name string
	fn   func(context.Context) error
}

// Health is the body of /readyz and of health://check.
type Health struct {
	Status     string            `json:"status"` // "ok" or "degraded"
	Version    string            `json:"version"`
	UptimeS    int64             `json:"uptime_s"`
	Components map[string]string `json:"components"` // name → "ok" or "error"
	// Pool counts warm sandbox containers per language (informational:
	// an empty pool refills in the background and is not a failure).
	Pool map[string]int `json:"pool,omitempty"`
	// Details an operator should see that are not failures (when a
	// GitHub token expires, and a warning a week ahead).
	Details map[string]string `json:"details,omitempty"`
}

// healthCache keeps the last result for a second: /readyz needs no token,
// and a flood of it must not turn into a flood of Docker and SQLite pings.
type healthCache struct {
	mu   sync.Mutex
	at   time.Time
	last Health
}

// Health runs every component check with a short timeout, at most once a
// second.
func (b *Broker) Health(ctx context.Context) Health {
	b.health.mu.Lock()
	defer b.health.mu.Unlock()
	if time.Since(b.health.at) < time.Second {
		h := b.health.last
		h.UptimeS = int64(time.Since(b.started) / time.Second)
		if b.poolStats != nil { // in memory, so never stale
			h.Pool = b.poolStats()
		}
		return h
	}
	h := b.checkHealth(ctx)
	b.health.at, b.health.last = time.Now(), h
	return h
}

// minFreeBytes is the free space SANDBOX_ROOT needs to be ready: with
// less, writes start to fail (the audit log's first) and calls are
// refused.
const minFreeBytes = 16 << 20

// storageCheck fails while the filesystem holding root is (nearly) full.
func storageCheck(root string) func(context.Context) error {
	return func(context.Context) error {
		var st unix.Statfs_t
		if err := unix.Statfs(root, &st); err != nil {
			return err
		}
		if free := st.Bavail * uint64(st.Bsize); free < minFreeBytes {
			return fmt.Errorf("SANDBOX_ROOT has %d bytes free", free)
		}
		if st.Files > 0 && st.Ffree < 64 {
			return fmt.Errorf("SANDBOX_ROOT has %d inodes free", st.Ffree)
		}
		return nil
	}
}

func (b *Broker) checkHealth(ctx context.Context) Health {
	h := Health{Status: "ok", Version: b.version, UptimeS: int64(time.Since(b.started) / time.Second), Components: map[string]string{}}
	for _, c := range b.checks {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := c.fn(cctx)
		cancel()
		if err != nil {
			h.Status = "degraded"
			h.Components[c.name] = "error"
			b.log.Warn().Str("check", c.name).Msg("health_check_failed")
			continue
		}
		h.Components[c.name] = "ok"
	}
	if b.poolStats != nil {
		h.Pool = b.poolStats()
	}
	h.Details = b.githubDetails()
	return h
}

func (b *Broker) addHealthResource(s *server.MCPServer) {
	s.AddResource(
		mcp.NewResource(HealthURI, "Broker health", mcp.WithResourceDescription("Status, uptime and component checks"), mcp.WithMIMEType("application/json")),
		func(ctx context.Context, req mcp.ReadResourceRequest) ([]mcp.ResourceContents, error) {
			body, err := json.Marshal(b.Health(ctx))
			if err != nil {
				return nil, err
			}
			return []mcp.ResourceContents{mcp.TextResourceContents{URI: HealthURI, MIMEType: "application/json", Text: string(body)}}, nil
		})
}
