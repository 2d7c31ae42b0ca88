// Package identity holds who is calling: the principal carried by every tool
// call, and the bearer-token registry that maps HTTP tokens to principals.
package identity

import (
	"context"

	"github.com/sandbox-broker/sandbox-broker/services/quota"
)

// Principal is an authenticated caller. Every resource is scoped to ID.
type Principal struct {
	ID   string     `json:"principal"`
	Tier quota.Tier `json:"tier"`
	// Admin marks an operator (token entry "admin": true, or the embedded
	// OAuth token's admin claim); nothing grants extra rights for it yet.
	Admin bool `json:"admin,omitempty"`
}

type principalKey struct{}

// WithPrincipal returns ctx carrying p.
func WithPrincipal(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// FromContext returns the caller, if the transport authenticated one.
func FromContext(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(Principal)
	return p, ok && p.ID != ""
}
